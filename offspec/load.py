"""Checkpoint folders (or hub ids from the local Hugging Face cache) -> a ready Engine: target (resident or
streamed), optional draft, shared tokenizer.

    Models.open(target, draft)             configs, safetensors headers and the tokenizers; no weights read
          .plan(offload, runtime, limits)  the memory plan (plan.py): where everything will live, or one line
          .load(offload, runtime, limits)  allocate and load exactly what the plan counted -> Loaded(engine)
    load_engine(...)                       the three in one call
"""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional

import torch

from .checkpoint import Checkpoint, load_tokenizer
from .config import OffloadConfig, RunLimits, RuntimeConfig
from .draft import load_resident
from .errors import InputError
from .generate import Engine
from .hub import resolve_model
from .model import Model
from .plan import Machine, MemoryPlan, ModelSpec, Placement, make_plan
from .prompt import stop_token_ids
from .quant import check_draft_quant
from .vocab import check_rows_cover_tokenizer, check_same_tokenizer, token_id_count

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


def store_dir_for(ckpt: Checkpoint, dtype: torch.dtype, home: Path, quant: str = "none") -> Path:
    """Default place of a checkpoint's packed disk store: one folder per (weights, dtype, quantization)."""
    key = hashlib.sha1(f"{ckpt.path.resolve()}|{ckpt.fingerprint()}|{dtype}".encode()).hexdigest()[:12]
    quantized = "" if quant == "none" else f"-{quant}"
    return home / "stores" / f"{ckpt.path.name}-{str(dtype).replace('torch.', '')}{quantized}-{key}"


def load_target(ckpt: Checkpoint, offload: OffloadConfig, runtime: RuntimeConfig, progress: bool = True,
                placement: Optional[Placement] = None) -> Model:
    """The target: globals first, then its layers as `placement` (the memory plan's) says; no placement:
    as offload says (plan.place_layers with its gpu_budget)."""
    everything_resident = (placement is not None and not placement.streamed) or (
        placement is None and offload.mode == "none" and offload.gpu_budget is None)
    if everything_resident and runtime.target_quant == "none":
        return load_resident(ckpt, runtime.device, runtime.dtype)
    from .demo import offspec_home
    from .offload import open_target_layers

    globals_ = ckpt.global_weights(runtime.device, runtime.dtype)
    quant = runtime.target_quant
    store_dir = offload.store_dir or str(store_dir_for(ckpt, runtime.dtype, offspec_home(), quant))
    layers = open_target_layers(ckpt.layer_tensors, ckpt.config, offload, runtime.device, runtime.dtype,
                                store_dir=store_dir, progress=progress, source_id=ckpt.fingerprint(),
                                placement=placement, quant=quant, resident_quant=runtime.resident_quant)
    return Model(ckpt.config, globals_, layers)


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
    load_seconds: float
    plan: MemoryPlan               # what was allocated where, as planned before loading


@dataclass
class Models:
    """The checkpoints of one run, opened cheaply: configs and safetensors headers checked, the shared
    tokenizer loaded, no weight read. Plan, then load."""
    target: Checkpoint
    draft: Optional[Checkpoint]
    tokenizer: object
    eos_ids: list[int]              # EOS and chat end tokens, from the tokenizer and generation_config
    n_shared: Optional[int]         # token ids both tokenizers know: the rows the draft may propose (vocab.py)
    open_seconds: float

    @staticmethod
    def open(target_dir: str | Path, draft_dir: Optional[str | Path]) -> "Models":
        """target_dir / draft_dir: a model folder, or a hub id (hub.resolve_model)."""
        start = time.perf_counter()
        target_dir = resolve_model(target_dir)
        target = Checkpoint(target_dir)
        tokenizer = load_tokenizer(target_dir)
        check_rows_cover_tokenizer(target.config.vocab_size, token_id_count(tokenizer), f"target {target_dir}")
        draft, n_shared = None, None
        if draft_dir is not None:
            draft_dir = resolve_model(draft_dir)
            draft = Checkpoint(draft_dir)
            draft_tokenizer = load_tokenizer(draft_dir)
            # Embedding rows may differ (padded vocabularies); the tokenizers may not (vocab.py).
            n_shared = check_same_tokenizer(tokenizer, draft_tokenizer)
            check_rows_cover_tokenizer(draft.config.vocab_size, token_id_count(draft_tokenizer), f"draft {draft_dir}")
        eos = stop_token_ids(tokenizer, generation_eos(target_dir))
        return Models(target, draft, tokenizer, eos, n_shared, time.perf_counter() - start)

    def plan(self, offload: OffloadConfig, runtime: RuntimeConfig, limits: RunLimits = RunLimits(),
             machine: Optional[Machine] = None) -> MemoryPlan:
        """The memory plan for this machine now (or `machine`), before anything is allocated."""
        return make_plan(ModelSpec.of(self.target), ModelSpec.of(self.draft) if self.draft else None, offload,
                         runtime, limits, machine or Machine.measure(runtime.device))

    def load(self, offload: OffloadConfig, runtime: RuntimeConfig, limits: RunLimits = RunLimits(),
             progress: bool = True, machine: Optional[Machine] = None) -> Loaded:
        """Plan, then load in the plan's order: draft, target globals, target layers (resident, ring, arena
        or store). The engine keeps to the plan's context, tree budget and prefill chunk."""
        start = time.perf_counter()
        plan = self.plan(offload, runtime, limits, machine)
        # The plan resolved "auto" and decided the pinned budget; the stores obey both.
        offload = replace(offload, mode=plan.mode, host_budget=plan.pinned_budget)
        draft = None
        if self.draft is not None:
            check_draft_quant(runtime.draft_quant, runtime.device, runtime.dtype)
            draft = load_resident(self.draft, runtime.device, runtime.dtype, runtime.draft_quant)
        target = load_target(self.target, offload, runtime, progress, placement=plan.placement)
        for ckpt in (self.target, self.draft):
            if ckpt is not None:
                ckpt.close()     # the weights now live in the models, the arena or the store
        engine = Engine(target, draft, self.tokenizer, self.eos_ids, n_shared=self.n_shared, context=plan.context,
                        max_tree_budget=plan.tree_budget, prefill_chunk=plan.prefill_chunk,
                        max_concurrency=plan.concurrency, plan=plan, target_quant=runtime.target_quant,
                        draft_quant=runtime.draft_quant)
        return Loaded(engine, self.target, self.draft, self.tokenizer,
                      self.open_seconds + time.perf_counter() - start, plan)


def load_engine(target_dir: str | Path, draft_dir: Optional[str | Path], offload: OffloadConfig,
                runtime: RuntimeConfig, progress: bool = True, limits: RunLimits = RunLimits(),
                machine: Optional[Machine] = None) -> Loaded:
    """target_dir / draft_dir: a model folder, or a hub id such as Qwen/Qwen2.5-7B-Instruct (hub.resolve_model)."""
    return Models.open(target_dir, draft_dir).load(offload, runtime, limits, progress, machine)
