"""The draft: a small model resident on the compute device, run by the same forward as the target."""
from __future__ import annotations

import threading
import time
from dataclasses import replace
from typing import Optional

import torch

from offspec.formats.checkpoint import Checkpoint
from offspec.formats.quant import QUANT_MODES, Int8Weight, with_quantized_matrices
from offspec.model.forward import Model, ResidentLayers


def load_resident(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, quant: str = "none",
                  embed_device: Optional[torch.device] = None, lm_head_device: Optional[torch.device] = None) -> Model:
    """Every weight on `device` for good (the draft; also the target with offload mode "none"), but the
    embedding and the lm_head where embed_device / lm_head_device say (the memory plan's embed_on_host,
    lm_head_on_host).

    quant (only for the draft: it changes p, never the output; see quant.py):
      "int8"       the layers' matrices and lm_head also get a per-row int8 copy that calls over a few rows
                   read instead (+50% memory for the draft; faster on a CPU)
      "int8-held"  the layers' matrices held only as per-row int8 (0.50x of bf16), lm_head dense
      "nf4"        the layers' matrices held only as bitsandbytes nf4 (0.28x of bf16), lm_head dense
    A held layer is quantized right after it is read, so loading needs one dense layer more, not a model."""
    if quant not in QUANT_MODES:
        raise ValueError(f"unknown quantization {quant!r}; expected one of {', '.join(QUANT_MODES)}")
    layers = []
    for i in range(ckpt.config.n_layers):
        w = ckpt.layer_weights(i, device, dtype)
        layers.append(w if quant == "none" else with_quantized_matrices(w, quant))
    globals_ = ckpt.global_weights(device, dtype, embed_device, lm_head_device)
    if quant == "int8":
        globals_ = replace(globals_, lm_head=Int8Weight.quantize(globals_.lm_head))   # embed stays as it is
    return Model(ckpt.config, globals_, ResidentLayers(layers))


class DraftBeside:
    """The draft loading on its own thread while the target runs its first round, which needs no draft where
    that round is a plain prefill (a CPU with the target resident: controller.Controller.for_run), so the first
    token does not wait for it. Its config and dtype are there at once; forward(), and any other attribute of
    the model, wait for the load (and raise its error, if any); `seconds` is what the load took. close() waits
    for a load still running."""

    def __init__(self, ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, quant: str = "none"):
        self.cfg, self.dtype, self.device = ckpt.config, dtype, device
        self.seconds: Optional[float] = None
        self._model: Optional[Model] = None
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._load, args=(ckpt, quant), name="offspec-draft-load", daemon=True)
        self._thread.start()

    def _load(self, ckpt: Checkpoint, quant: str) -> None:
        start = time.perf_counter()
        try:
            self._model = load_resident(ckpt, self.device, self.dtype, quant)
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
