"""Checkpoint folders (or hub ids from the local Hugging Face cache) -> a ready Engine: target (resident or
streamed), optional draft (a model of its own, or the target's twin: --draft self), shared tokenizer.

    Models.open(target, draft)             configs, safetensors headers and the tokenizers; no weights read
          .plan(offload, runtime, limits)  the memory plan (plan/search.py): where everything will live, or one line
          .load(offload, runtime, limits)  allocate and load exactly what the plan counted -> Loaded(engine)
    load_engine(...)                       the three in one call
    open_target_layers(...)                the target's decoder layers as a Placement says: resident layers
                                           and/or a ring (ring.py) over a host arena or disk store (stores.py, disk.py)
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

import torch
from tqdm import tqdm

from offspec.config import ModelConfig, OffloadConfig, RunLimits, RuntimeConfig
from offspec.engine.draft_records import DraftLog, choose, read_record, record_key
from offspec.engine.generate import Engine
from offspec.engine.metrics import StartTimes
from offspec.engine.pair_cache import pair_key
from offspec.engine.prompt import stop_token_ids
from offspec.engine.rounds import plain_first_round
from offspec.errors import BudgetError, InputError
from offspec.formats import published
from offspec.formats.checkpoint import Checkpoint
from offspec.formats.draft_quant import TWIN_QUANTS, auto_twin_quant, check_draft_quant, resolve_draft_quant
from offspec.formats.hub import resolve_model
from offspec.formats.layout import LayerWeights
from offspec.formats.open import load_tokenizer, open_checkpoint, same_tokenizer_files
from offspec.formats.quant import QuantizedResident, check_target_quant, dequantized, target_layout
from offspec.model.draft import DraftBeside, load_draft, load_resident
from offspec.model.forward import Model, ResidentLayers
from offspec.model.vocab import check_rows_cover_tokenizer, check_same_tokenizer, token_id_count
from offspec.plan.machine import Machine
from offspec.plan.memory import MemoryPlan
from offspec.plan.placement import LayerPlan, Placement, check_resident_quant
from offspec.plan.search import make_plan
from offspec.plan.sizes import ModelSpec, published_runtime
from offspec.stream.disk import DiskStore, disk_store_exists, prepare_disk_store
from offspec.stream.ring import LayerStreamer, StreamStats
from offspec.stream.staged import BlockLayout, LayerTensorsFn, StoreInfo, pack_layer
from offspec.stream.stores import HostArenaStore, TieredStore, WeightStore
from offspec.stream.transfer import make_backend

SELF_DRAFT = "self"     # --draft self: the target's own layers held quantized (model.draft.load_twin)

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise InputError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_device(name: str, check_available: bool = True) -> torch.device:
    """check_available False: a device of another machine (a Ray worker's), so CUDA need not be here."""
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"unknown device {name!r}; use cpu or cuda[:N]") from None
    if check_available and device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {name!r} requested but CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"device type {device.type!r} is not supported; use cpu or cuda[:N]")
    return device


def runtime_config(device: torch.device, dtype: torch.dtype, draft_quant: str = "auto", target_quant: str = "none",
                   resident_quant: str = "auto", twin: bool = False) -> RuntimeConfig:
    """The RuntimeConfig of a run on `device`, checked before any model is read: draft_quant "auto" resolved for
    the device and dtype (draft_quant.auto_draft_quant; for a twin, --draft self: auto_twin_quant, whose int4 on a
    GPU becomes nf4 (int8 on a CPU), with a note, where PyTorch's int4 kernel cannot run), each quantization one
    that they can run. The CLI makes this machine's; cluster.engines_on_ray the Ray workers'
    (their device is chosen there)."""
    held = resolve_draft_quant(draft_quant, device.type, dtype, twin)
    check_target_quant(target_quant, device, dtype)
    try:
        check_draft_quant(held, device, dtype)
    except InputError as err:
        if draft_quant != "auto" or held != "int4":
            raise
        held = "nf4" if device.type == "cuda" else "int8"        # the kernel failed, not the user's choice
        print(f"note: {err}; the twin holds {held} instead", file=sys.stderr)
        check_draft_quant(held, device, dtype)
    # "on" with no --target-quant may still hold a published checkpoint's layers: the plan checks it there.
    check_resident_quant(resident_quant, quantized=True)
    return RuntimeConfig(device=device, dtype=dtype, draft_quant=held, target_quant=target_quant,
                         resident_quant=resident_quant)


def store_dir_for(ckpt: Checkpoint, dtype: torch.dtype, home: Path, quant: str = "none") -> Path:
    """Default place of a checkpoint's packed disk store: one folder per (weights, dtype, quantization)."""
    key = hashlib.sha1(f"{ckpt.path.resolve()}|{ckpt.fingerprint()}|{dtype}".encode()).hexdigest()[:12]
    quantized = "" if quant == "none" else f"-{published.short(quant)}"
    return home / "stores" / f"{ckpt.path.name}-{str(dtype).replace('torch.', '')}{quantized}-{key}"


def load_target(ckpt: Checkpoint, layers: LayerPlan, runtime: RuntimeConfig, progress: bool = True) -> Model:
    """The target: globals first, then its layers as `layers` (the memory plan's) says."""
    host = torch.device("cpu")
    embed_device = host if layers.embed_on_host else None
    lm_head_device = host if layers.lm_head_on_host else None
    if layers.dense_resident:
        return load_resident(ckpt, runtime.device, runtime.dtype, embed_device=embed_device,
                             lm_head_device=lm_head_device)
    globals_ = ckpt.global_weights(runtime.device, runtime.dtype, embed_device, lm_head_device)
    target_layers = open_target_layers(ckpt.layer_tensors, ckpt.config, layers, runtime.device, runtime.dtype,
                                       progress=progress, source_id=ckpt.fingerprint())
    return Model(ckpt.config, globals_, target_layers)


def generation_eos(path: Path):
    file = Path(path) / "generation_config.json"
    if file.is_file():
        try:
            return json.loads(file.read_text()).get("eos_token_id")
        except json.JSONDecodeError:
            return None
    return None


@dataclass
class Loaded:
    engine: Engine
    target_ckpt: Checkpoint
    draft_ckpt: Optional[Checkpoint]
    tokenizer: object
    start: StartTimes              # the start, timed: open, plan, draft, target
    plan: MemoryPlan               # what was allocated where, as planned before loading

    @property
    def load_seconds(self) -> float:
        return self.start.total


@dataclass
class DraftCandidate:
    """A draft the run may take: a model of its own, or the target's twin (a second handle on its checkpoint)."""
    ckpt: Checkpoint
    twin: bool
    n_shared: Optional[int]         # token ids both tokenizers know: the rows the draft may propose (vocab.py)
    given: str                      # as the user gave it (a folder, a hub id, SELF_DRAFT)

    @property
    def label(self) -> str:
        return SELF_DRAFT if self.twin else self.ckpt.path.name


@dataclass
class Models:
    """The checkpoints of one run, opened cheaply: configs and safetensors headers checked, the shared
    tokenizer loaded, no weight read. Plan, then load. With several drafts given, the plan keeps one (plan())."""
    target: Checkpoint
    drafts: list[DraftCandidate]    # the drafts the run may take; one after plan() (none: the target alone)
    tokenizer: object
    eos_ids: list[int]              # EOS and chat end tokens, from the tokenizer and generation_config
    open_seconds: float
    optional_twin: bool = False     # the twin was not asked for: where it does not fit, the target runs alone
    own_quants: bool = False        # several drafts with --draft-quant auto: each held as it would be alone
    device_name: str = ""           # the device the plan was made for (draft records are kept per device)

    @staticmethod
    def open(target_dir: str | Path, draft_dir: Union[None, str, Path, Sequence[str | Path]],
             optional_twin: bool = False, draft_quant: str = "auto") -> "Models":
        """target_dir / draft_dir: a model folder, or a hub id (hub.resolve_model); draft_dir SELF_DRAFT: the
        target's twin (its own layers held quantized, model.draft.load_twin), read through a second handle. Several
        drafts (a sequence): the plan takes one (plan()), each held as draft_quant says (auto: as it would be
        alone). optional_twin: the twin is a default, not asked for: the plan drops it where the target would not
        stream or it does not fit."""
        start = time.perf_counter()
        target_dir = resolve_model(target_dir)
        target = open_checkpoint(target_dir)
        tokenizer = load_tokenizer(target_dir)
        check_rows_cover_tokenizer(target.config.vocab_size, token_id_count(tokenizer), f"target {target_dir}")
        given = [] if draft_dir is None else [draft_dir] if isinstance(draft_dir, (str, Path)) else list(draft_dir)
        drafts = [_open_draft(target_dir, tokenizer, d) for d in given]
        eos = stop_token_ids(tokenizer, generation_eos(target_dir))
        return Models(target, drafts, tokenizer, eos, time.perf_counter() - start,
                      optional_twin and any(d.twin for d in drafts), len(drafts) > 1 and draft_quant == "auto")

    @property
    def draft(self) -> Optional[Checkpoint]:
        """The draft's checkpoint (the first given, until plan() has chosen), None without one."""
        return self.drafts[0].ckpt if self.drafts else None

    @property
    def twin(self) -> bool:
        return bool(self.drafts) and self.drafts[0].twin

    @property
    def n_shared(self) -> Optional[int]:
        return self.drafts[0].n_shared if self.drafts else None

    def draft_spec(self, draft: Optional[DraftCandidate] = None) -> Optional[ModelSpec]:
        draft = draft or (self.drafts[0] if self.drafts else None)
        if draft is None:
            return None
        return ModelSpec.of(draft.ckpt).as_twin() if draft.twin else ModelSpec.of(draft.ckpt)

    def runtime(self, runtime: RuntimeConfig, draft: Optional[DraftCandidate] = None) -> RuntimeConfig:
        """The run's RuntimeConfig for these models with `draft` (default the first): of several drafts, each
        one's own auto quantization; a twin reads the target's layers quantized (a --draft-quant that would not
        becomes quant.auto_twin_quant; the CLI refuses it earlier, in runtime_config)."""
        draft = draft or (self.drafts[0] if self.drafts else None)
        if draft is not None and self.own_quants:
            own = runtime_config(runtime.device, runtime.dtype, "auto", twin=draft.twin).draft_quant
            runtime = replace(runtime, draft_quant=own)
        if draft is not None and draft.twin and runtime.draft_quant not in TWIN_QUANTS:
            return replace(runtime, draft_quant=auto_twin_quant(runtime.device.type, runtime.dtype))
        return runtime

    def plan(self, offload: OffloadConfig, runtime: RuntimeConfig, limits: RunLimits = RunLimits(),
             machine: Optional[Machine] = None) -> MemoryPlan:
        """The memory plan for this machine now (or `machine`), before anything is allocated: every "auto"
        resolved (plan.make_plan), and of several drafts the one the run takes; the others are closed, for good.

        A twin that was not asked for (optional_twin) is kept only where the target, planned alone, streams some
        of its layers (a pass then costs copies, against which a twin's round is cheap) and the twin fits beside
        it: with every layer resident a pass costs about what a twin's round does
        (docs/notes/2026-11-28-int4-twin.md). Of several drafts that fit, the plan takes the one its draft records
        say (draft_records.choose: each measured once, then the fastest). Without one, the target runs alone;
        the plan's notes say why."""
        from offspec.formats.demo import offspec_home
        machine = machine or Machine.measure(runtime.device)
        self.device_name = machine.name
        quant = published_runtime(ModelSpec.of(self.target), self.runtime(runtime)).target_quant
        store_dir = str(store_dir_for(self.target, runtime.dtype, offspec_home(), quant))
        target = ModelSpec.of(self.target)

        def planned(draft: Optional[DraftCandidate]) -> MemoryPlan:
            return make_plan(target, self.draft_spec(draft) if draft else None, offload, self.runtime(runtime, draft),
                             limits, machine, store_dir=store_dir)

        if len(self.drafts) <= 1 and not self.optional_twin:
            return planned(self.drafts[0] if self.drafts else None)
        notes, plans, resident = [], {}, None
        alone = planned(None) if self.optional_twin else None
        for draft in self.drafts:
            if draft.twin and self.optional_twin and not alone.placement.streamed:
                resident = ("every target layer stays resident, where a twin's round costs about what it saves "
                            "(--draft self drafts with it anyway)")
                continue
            try:
                plans[id(draft)] = planned(draft)
            except BudgetError as err:
                notes.append(f"draft {draft.label} does not fit beside the target ({err})")
        fitting = [d for d in self.drafts if id(d) in plans]
        if len(fitting) > 1:
            i, why = choose([d.label for d in fitting], [read_record(self._record_key(d, plans[id(d)], runtime))
                                                         for d in fitting])
            fitting, notes = [fitting[i]], notes + [why]
        for draft in self.drafts:
            if all(draft is not kept for kept in fitting):
                draft.ckpt.close()
        self.drafts, self.optional_twin = fitting, False
        if not fitting and alone is None:
            raise BudgetError(f"no draft fits beside the target: {'; '.join(notes)}")
        if not fitting:
            why = "; ".join(notes + [resident] if resident else notes)
            return replace(alone, notes=alone.notes + (f"the target runs alone: {why}",))
        plan = plans[id(fitting[0])]
        return replace(plan, notes=plan.notes + tuple(notes))

    def _pair_key(self, draft: DraftCandidate, plan: MemoryPlan, runtime: RuntimeConfig) -> str:
        """The pair's key (pair_cache.pair_key) with `draft` as `plan` holds it: the pair's caches and, with the
        device, the draft records (draft_records.record_key) are named by it."""
        return pair_key(self.target, draft.ckpt, target_quant=plan.target_quant, draft_quant=plan.draft_quant,
                        dtype=runtime.dtype, twin=draft.twin)

    def _record_key(self, draft: DraftCandidate, plan: MemoryPlan, runtime: RuntimeConfig) -> str:
        return record_key(self._pair_key(draft, plan, runtime), self.device_name)

    def load(self, offload: OffloadConfig, runtime: RuntimeConfig, limits: RunLimits = RunLimits(),
             progress: bool = True, machine: Optional[Machine] = None) -> Loaded:
        """Plan, then load in the plan's order: draft, target globals, target layers (resident, ring, arena
        or store). The engine keeps to the plan's context, tree budget, prefill chunk and requests in flight
        (limits.concurrency None: the most the plan fits, recorded in plan.concurrency_auto)."""
        t0 = time.perf_counter()
        plan = self.plan(offload, runtime, limits, machine)
        # A published checkpoint's own quantization; a twin's held as the plan says (search.make_plan).
        runtime = replace(runtime, target_quant=plan.target_quant, draft_quant=plan.draft_quant)
        t1 = time.perf_counter()
        draft = None
        # A run whose first round is a plain prefill loads the draft beside it, after the target, and the first
        # token does not wait for it. A twin is built after the target: it shares the target's globals.
        beside = self.draft is not None and plain_first_round(runtime.device.type == "cuda",
                                                              bool(plan.placement.streamed))
        if self.draft is not None:
            check_draft_quant(runtime.draft_quant, runtime.device, runtime.dtype)
            if not beside and not self.twin:
                draft = self._load_draft(runtime, plan.draft_head, None, progress)
        t2 = time.perf_counter()
        target = load_target(self.target, plan.layers, runtime, progress)
        self.target.close()      # the weights now live in the model, the arena or the store
        t3 = time.perf_counter()
        twin_of = target if self.twin else None
        if beside:
            draft = DraftBeside(self.draft, runtime.device, runtime.dtype, runtime.draft_quant, plan.draft_head,
                                twin_of=twin_of)
        elif self.twin:
            draft = self._load_draft(runtime, plan.draft_head, twin_of, progress)
        pair = self._pair_key(self.drafts[0], plan, runtime) if self.drafts else None   # pair_cache's, draft records'
        engine = Engine(target, draft, self.tokenizer, self.eos_ids, n_shared=self.n_shared, context=plan.context,
                        max_tree_budget=plan.tree_budget, prefill_chunk=plan.prefill_chunk,
                        max_concurrency=plan.concurrency, plan=plan, target_quant=runtime.target_quant,
                        draft_quant=runtime.draft_quant, twin=self.twin, pair=pair,
                        draft_log=DraftLog(record_key(pair, self.device_name), self.drafts[0].label) if pair else None)
        t4 = time.perf_counter()
        start = StartTimes(open=self.open_seconds, plan=t1 - t0, draft=t2 - t1 + t4 - t3, target=t3 - t2)
        return Loaded(engine, self.target, self.draft, self.tokenizer, start, plan)

    def _load_draft(self, runtime: RuntimeConfig, head: str, twin_of, progress: bool) -> Model:
        """The draft, now, on the compute device, its lm_head as `head` (plan.draft_head): a model of its own, or
        (twin_of: the target) its twin."""
        draft = load_draft(self.draft, runtime.device, runtime.dtype, runtime.draft_quant, head, twin_of, progress)
        self.draft.close()
        return draft


def _open_draft(target_dir: Path, tokenizer, draft_dir: str | Path) -> DraftCandidate:
    """A draft given to Models.open, its tokenizer checked against the target's: SELF_DRAFT, the target's twin."""
    if draft_dir == SELF_DRAFT:
        return DraftCandidate(open_checkpoint(target_dir), twin=True, n_shared=None, given=SELF_DRAFT)
    given, draft_dir = str(draft_dir), resolve_model(draft_dir)
    draft = open_checkpoint(draft_dir)
    draft_tokenizer = tokenizer if same_tokenizer_files(target_dir, draft_dir) else load_tokenizer(draft_dir)
    # Embedding rows may differ (padded vocabularies); the tokenizers may not (vocab.py).
    n_shared = check_same_tokenizer(tokenizer, draft_tokenizer)
    check_rows_cover_tokenizer(draft.config.vocab_size, token_id_count(draft_tokenizer), f"draft {draft_dir}")
    return DraftCandidate(draft, twin=False, n_shared=n_shared, given=given)


def load_engine(target_dir: str | Path, draft_dir: Optional[str | Path], offload: OffloadConfig,
                runtime: RuntimeConfig, progress: bool = True, limits: RunLimits = RunLimits(),
                machine: Optional[Machine] = None) -> Loaded:
    """target_dir / draft_dir: a model folder, or a hub id such as Qwen/Qwen2.5-7B-Instruct (hub.resolve_model)."""
    return Models.open(target_dir, draft_dir).load(offload, runtime, limits, progress, machine)


# ---------------------------------------------------------------- the target's layers, as placed

@dataclass
class TargetLayers:
    """What open_target_layers returns: a LayerSource (hand it to Model as its layers) that also says what
    was decided, reports streaming stats and stops the streamer's threads on close()."""
    source: Union[ResidentLayers, LayerStreamer]   # the layers themselves
    placement: Placement                           # resident layers and ring size
    host: Optional[StoreInfo]                      # where the streamed layers live; None when nothing streams

    def pass_layers(self) -> Iterator[tuple[int, LayerWeights]]:
        return self.source.pass_layers()

    def stats(self) -> Optional[StreamStats]:
        return self.source.stats() if isinstance(self.source, LayerStreamer) else None

    def close(self) -> None:
        if isinstance(self.source, LayerStreamer):
            self.source.close()

    def __enter__(self) -> "TargetLayers":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _resident_layer(i: int, block: torch.Tensor, layout: BlockLayout, device: torch.device,
                    scratch: Optional[torch.Tensor] = None) -> Union[LayerWeights, QuantizedResident]:
    """A host block of `layout` (layer i) -> the layer on the device for good: dense (a quantized block is copied,
    dequantized there, and dropped), or with a scratch ((dense nbytes,) uint8 on the device) the quantized
    block itself, held, dequantized into the scratch every pass."""
    on_device = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)   # (nbytes,)
    on_device.copy_(block)
    if scratch is not None:
        return QuantizedResident(layout, on_device, scratch, i)
    return dequantized(layout, on_device, i)[1]


def open_target_layers(layer_tensors_fn: LayerTensorsFn, cfg: ModelConfig, layers: LayerPlan, device: torch.device,
                       dtype: torch.dtype, progress: bool = True, *, source_id: str = "") -> TargetLayers:
    """The target's decoder layers, as `layers` (plan.LayerPlan: the memory plan's, or LayerPlan.of) says.

    layer_tensors_fn(i) gives layer i's tensors keyed by LayerWeights field names, any dtype (cast to
    `dtype` when packed). Placement mode "none": all resident. "cpu": streamed layers packed into a host arena.
    "cpu+disk": the placement's host layers in a host arena, the others read from the store (stores.TieredStore).
    "disk": the packed store at layers.store_dir, built once with a progress bar when missing; source_id (e.g.
    Checkpoint.fingerprint()) is recorded in it, and a store built from other weights is refused. The result is a
    LayerSource; close it (or use it as a context manager) to stop the streamer's threads.

    A quantized target (layers.quant "int8" | "nf4"): every layer is quantized once, into the packed store
    (whatever the mode: quantizing a 70B takes the better part of an hour on a few cores, reading it back
    seconds); the arena and the ring hold quantized blocks, the ring's dense buffers the dequantized layer in
    `dtype`. Resident layers are dense, or held as their quantized blocks and dequantized every pass into one
    shared scratch layer (placement.resident_held). A store of another quantization is refused."""
    placement, quant = layers.placement, layers.quant
    check_target_quant(quant, device, dtype)
    layout = target_layout(cfg, dtype, quant)
    if layers.dense_resident:
        resident_layers = []
        for i in tqdm(range(cfg.n_layers), desc="loading layers", unit="layer", disable=not progress):
            block = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)   # (nbytes,) one block per layer
            pack_layer(layer_tensors_fn, i, layout, block)
            resident_layers.append(layout.views(block))
        return TargetLayers(ResidentLayers(resident_layers), placement, host=None)

    backend = make_backend(device)
    with contextlib.ExitStack() as on_error:
        on_error.callback(backend.close)
        disk: Optional[DiskStore] = None
        if layers.from_store:
            directory = layers.store_dir
            if directory is None:
                raise InputError("disk offload and quantized targets need a store directory (store_dir)")
            if not disk_store_exists(directory):
                prepare_disk_store(layer_tensors_fn, cfg.n_layers, layout, directory, progress, source_id=source_id)
            disk = DiskStore(directory, layout, cfg.n_layers, backend, source_id=source_id,
                             drop_page_cache=layers.drop_page_cache, direct_io=layers.disk_io == "direct")
            on_error.callback(disk.close)

        def host_block(layer: int) -> torch.Tensor:
            """Layer `layer`'s block on the host: read from the store, or packed from its tensors."""
            if disk is not None:
                return disk.read_layer(layer)
            block = torch.empty(layout.nbytes, dtype=torch.uint8)
            pack_layer(layer_tensors_fn, layer, layout, block)
            return block

        # Held quantized resident layers and a compact ring share one scratch layer: the plan counted it once
        # (scratch_nbytes); a split compact ring's is its largest dense part (counted in split_nbytes). The plan
        # sized it: LayerPlan.scratch_nbytes.
        assert not (placement.split and placement.resident_held), "held layers need a whole-layer scratch"
        scratch = (torch.empty(layers.scratch_nbytes, dtype=torch.uint8, device=device)   # (scratch_nbytes,)
                   if layers.scratch_nbytes else None)
        resident = {i: _resident_layer(i, host_block(i), layout, device, scratch if placement.resident_held else None)
                    for i in tqdm(placement.resident, desc="loading resident layers", unit="layer",
                                  disable=not progress or not placement.resident)}
        if not placement.streamed:
            on_error.close()      # the store and the backend were only needed to read the layers
            return TargetLayers(ResidentLayers([resident[i] for i in range(cfg.n_layers)]), placement, host=None)
        store: WeightStore
        if placement.mode == "cpu+disk":     # the host tier filled from the store; the disk tier read each pass
            arena = HostArenaStore.filled(lambda layer, block: block.copy_(disk.read_layer(layer)), layout,
                                          placement.host_layers, backend, layers.host_budget, progress)
            on_error.callback(arena.close)
            store = TieredStore(arena, disk, placement.streamed)
        elif placement.mode == "cpu" and disk is not None:     # quantized: the arena is filled from the store
            store = HostArenaStore.filled(lambda layer, block: block.copy_(disk.read_layer(layer)), layout,
                                          placement.streamed, backend, layers.host_budget, progress)
            on_error.callback(store.close)
            disk.close()
        elif placement.mode == "cpu":
            store = HostArenaStore.build(layer_tensors_fn, layout, placement.streamed, backend,
                                         layers.host_budget, progress)
            on_error.callback(store.close)
        else:
            store = disk
        streamer = LayerStreamer(store, backend, cfg.n_layers, resident, placement.n_slots, overlap=layers.overlap,
                                 scratch=scratch if placement.compact else None, split=placement.split)
        on_error.pop_all()
    return TargetLayers(streamer, placement, store.info())
