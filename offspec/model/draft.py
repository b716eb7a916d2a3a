"""The draft: a small model resident on the compute device, run by the same forward as the target; or the
target's own layers held quantized beside its globals (its twin, --draft self)."""
from __future__ import annotations

import threading
import time
from dataclasses import fields, replace
from typing import Optional

import torch
from tqdm import tqdm

from offspec.formats.checkpoint import Checkpoint
from offspec.formats.draft_quant import QUANT_MODES, TWIN_QUANTS
from offspec.formats.int4 import Int4Weight, source_group
from offspec.formats.layout import GlobalWeights, LayerWeights
from offspec.formats.weights import Int8Weight, with_quantized_matrices
from offspec.model.forward import LayerSource, Model, ResidentLayers
from offspec.model.twin_store import cached_layers


def load_resident(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, quant: str = "none",
                  embed_device: Optional[torch.device] = None, lm_head_device: Optional[torch.device] = None,
                  head: str = "as is") -> Model:
    """Every weight on `device` for good (the draft; also the target with offload mode "none"), but the
    embedding and the lm_head where embed_device / lm_head_device say (the memory plan's embed_on_host,
    lm_head_on_host).

    quant (only for the draft: it changes p, never the output; see weights.py, int4.py):
      "int8"       the layers' matrices also get a per-row int8 copy that calls over a few rows read instead
                   (+50% memory for the draft; faster on a CPU)
      "int8-held"  the layers' matrices held only as per-row int8 (0.50x of bf16)
      "nf4"        the layers' matrices held only as bitsandbytes nf4 (0.28x of bf16)
      "int4"       the layers' matrices held only in 4-bit groups (0.31x), read in 4 bits
    head: the lm_head's form, as the memory plan chose it (plan.draft_head, from draft_quant.draft_lm_head).
    A held layer is quantized right after it is read, so loading needs one dense layer more, not a model."""
    layers = _layers(ckpt, device, dtype, quant)
    globals_ = ckpt.global_weights(device, dtype, embed_device, lm_head_device)
    return Model(ckpt.config, _with_head(globals_, head), ResidentLayers(layers))


def load_twin(ckpt: Checkpoint, target: Model, quant: str, head: str, progress: bool = False) -> Model:
    """--draft self: the target as its own draft, on the target's compute device, beside its embedding and final
    norm (shared, not copied). ckpt: the target's checkpoint (a handle of its own). quant (TWIN_QUANTS):
      "int8"       the target's own resident dense matrices, lm_head too, each beside its per-row int8 copy
                   (weights.Int8Weight): calls over a few rows read the copies, wider ones the target's matrices;
                   only for a target whose layers are all resident and dense (search.make_plan sees to it)
      "int4"       every layer's matrices held in 4-bit groups (int4.Int4Weight; a 4-bit checkpoint's own groups,
                   where it has them: int4.source_group)
      "int8-held"  every layer's matrices held per-row int8 | bitsandbytes nf4
      "nf4"
    head: the lm_head's form, as the memory plan chose it (plan.draft_head, from draft_quant.draft_lm_head): the
    target's itself, beside an int8 copy, or an int4 copy of it on the device.
    A held twin is built from one pass over the target's own layers (resident, or streamed from its arena or
    store: no second read of the checkpoint, and a published format's layers dequantized as the target's are);
    only a target held quantized and all resident is read again from the checkpoint (its layers dequantize into
    one shared scratch that the target's first round may be using while the twin loads beside it).
    An int4 twin of a resident dense target on a CPU is kept on disk once built, and read from there by later
    runs (twin_store.py). Its distributions differ from the target's only by the quantization of its matrices."""
    if quant not in TWIN_QUANTS:
        raise ValueError(f"a twin holds the target's matrices quantized ({', '.join(TWIN_QUANTS)}), not {quant!r}")
    resident = isinstance(target.layers, ResidentLayers)
    dense = resident and all(isinstance(w.q_proj, torch.Tensor) for w in target.layers.layers)
    if quant == "int8" and not dense:
        raise ValueError("an int8 twin reads the target's resident dense layers; this target has none")

    def build() -> list[LayerWeights]:
        if resident and not dense:
            return _layers(ckpt, target.device, target.dtype, quant, progress)
        return quantized_pass(target.layers, ckpt.config.n_layers, quant, source_group(ckpt.quant), progress)

    if quant == "int4" and dense and target.device.type == "cpu":     # kept on disk once built (twin_store.py)
        layers = cached_layers(ckpt, target, build)
    else:
        layers = build()
    return Model(ckpt.config, _with_head(target.globals, head), ResidentLayers(layers))


def quantized_pass(source: LayerSource, n_layers: int, quant: str, group: Optional[int] = None,
                   progress: bool = False) -> list[LayerWeights]:
    """Every layer of `source` with its matrices as `quant` holds them (weights.with_quantized_matrices; group:
    int4's source group), from one pass. A streamed slot is reused once the next piece is asked for: each
    piece's matrices are quantized and its vectors copied before then (int8 keeps the matrix itself: resident
    dense layers only). A split ring hands a layer over in parts (LAYER_PARTS), merged here."""
    streamed = not isinstance(source, ResidentLayers)
    pieces: list[dict] = [{} for _ in range(n_layers)]
    bar = tqdm(total=n_layers, desc=f"twin layers ({quant})", unit="layer", disable=not progress, leave=False)
    for layer, w in source.pass_layers():
        held = with_quantized_matrices(w, quant, group)
        for f in fields(held):
            t = getattr(held, f.name)
            if f.name != "part" and t is not None:
                pieces[layer][f.name] = t.clone() if streamed and isinstance(t, torch.Tensor) else t
        bar.update(layer + 1 - bar.n)
    bar.close()
    return [LayerWeights(**p) for p in pieces]


def _with_head(globals_: GlobalWeights, head: str) -> GlobalWeights:
    """The draft's globals with its lm_head in the form `head` (draft_quant.HEAD_WORDS' keys): "as is", "int8"
    (beside a per-row int8 copy), "int4" (4-bit groups on the compute device, final_norm's, wherever the dense
    one is)."""
    if head == "int4":
        return replace(globals_, lm_head=Int4Weight.quantize(globals_.lm_head, device=globals_.final_norm.device))
    if head == "int8":
        return replace(globals_, lm_head=Int8Weight.quantize(globals_.lm_head))
    return globals_


def load_draft(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, quant: str, head: str,
               twin_of: Optional[Model] = None, progress: bool = False) -> Model:
    """The draft on `device`, its lm_head as `head` (plan.draft_head): a model of its own (load_resident), or,
    twin_of the target, its twin (load_twin)."""
    if twin_of is None:
        return load_resident(ckpt, device, dtype, quant, head=head)
    return load_twin(ckpt, twin_of, quant, head, progress)


def _layers(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, quant: str,
            progress: bool = False) -> list[LayerWeights]:
    """Every decoder layer on `device`, as `quant` (QUANT_MODES) holds it; one dense layer in memory at a time."""
    if quant not in QUANT_MODES:
        raise ValueError(f"unknown quantization {quant!r}; expected one of {', '.join(QUANT_MODES)}")
    layers, source = [], source_group(ckpt.quant)
    for i in tqdm(range(ckpt.config.n_layers), desc=f"draft layers ({quant})", unit="layer", disable=not progress,
                  leave=False):
        w = ckpt.layer_weights(i, device, dtype)
        layers.append(w if quant == "none" else with_quantized_matrices(w, quant, source))
    return layers


class DraftBeside:
    """The draft loading on its own thread while the target runs its first round, which needs no draft where
    that round is a plain prefill (a CPU with the target resident: controller.Controller.for_run), so the first
    token does not wait for it. Its config and dtype are there at once; forward(), and any other attribute of
    the model, wait for the load (and raise its error, if any); `seconds` is what the load took. close() waits
    for a load still running."""

    def __init__(self, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, quant: str, head: str,
                 twin_of: Optional[Model] = None):
        """twin_of: the target, when the draft is its twin (load_twin); None: a model of its own."""
        self.cfg, self.dtype, self.device = ckpt.config, dtype, device
        self.seconds: Optional[float] = None
        self._model: Optional[Model] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._load, args=(ckpt, quant, head, twin_of), name="offspec-draft-load",
                                        daemon=True)
        self._thread.start()

    def _load(self, ckpt: Checkpoint, quant: str, head: str, twin_of: Optional[Model]) -> None:
        start = time.perf_counter()
        try:
            self._model = load_draft(ckpt, self.device, self.dtype, quant, head, twin_of)
        except BaseException as err:     # handed to the first forward(), never swallowed
            self._error = err
        finally:
            ckpt.close()                 # the weights now live in the model
            self.seconds = time.perf_counter() - start

    def model(self) -> Model:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._model

    def forward(self, *args, **kwargs) -> torch.Tensor:
        return self.model().forward(*args, **kwargs)

    def wait_loaded(self) -> float:
        """Wait for the load; -> the seconds waited (0 once loaded)."""
        start = time.perf_counter()
        self.model()
        return time.perf_counter() - start

    def __getattr__(self, name: str):
        """Anything else of the model (its layers, globals): once it is loaded."""
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.model(), name)

    def close(self) -> None:
        self._thread.join()
