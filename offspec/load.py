"""Checkpoint folders (or hub ids from the local Hugging Face cache) -> a ready Engine: target (resident or
streamed), optional draft, shared tokenizer."""
from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from .checkpoint import Checkpoint, load_tokenizer
from .config import OffloadConfig, RuntimeConfig
from .draft import load_resident
from .errors import InputError
from .generate import Engine
from .hub import resolve_model
from .model import Model
from .prompt import stop_token_ids
from .vocab import check_rows_cover_tokenizer, check_same_tokenizer, token_id_count

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}


def parse_dtype(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise InputError(f"unknown dtype {name!r}; choose one of {', '.join(DTYPES)}")
    return DTYPES[name]


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise InputError(f"unknown device {name!r}; use cpu or cuda[:N]") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise InputError(f"device {name!r} requested but CUDA is not available on this machine")
    if device.type not in ("cpu", "cuda"):
        raise InputError(f"device type {device.type!r} is not supported; use cpu or cuda[:N]")
    return device


def store_dir_for(ckpt: Checkpoint, dtype: torch.dtype, home: Path) -> Path:
    """Default place of a checkpoint's packed disk store: one folder per (weights, dtype)."""
    key = hashlib.sha1(f"{ckpt.path.resolve()}|{ckpt.fingerprint()}|{dtype}".encode()).hexdigest()[:12]
    return home / "stores" / f"{ckpt.path.name}-{str(dtype).replace('torch.', '')}-{key}"


def load_target(ckpt: Checkpoint, offload: OffloadConfig, runtime: RuntimeConfig, progress: bool = True) -> Model:
    if offload.mode == "none" and offload.gpu_budget is None:
        return load_resident(ckpt, runtime.device, runtime.dtype)
    from .demo import offspec_home
    from .offload import open_target_layers

    store_dir = offload.store_dir or str(store_dir_for(ckpt, runtime.dtype, offspec_home()))
    layers = open_target_layers(ckpt.layer_tensors, ckpt.config, offload, runtime.device, runtime.dtype,
                                store_dir=store_dir, progress=progress, source_id=ckpt.fingerprint())
    return Model(ckpt.config, ckpt.global_weights(runtime.device, runtime.dtype), layers)


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


def load_engine(target_dir: str | Path, draft_dir: Optional[str | Path], offload: OffloadConfig,
                runtime: RuntimeConfig, progress: bool = True) -> Loaded:
    """target_dir / draft_dir: a model folder, or a hub id such as Qwen/Qwen2.5-7B-Instruct (hub.resolve_model)."""
    start = time.perf_counter()
    target_dir = resolve_model(target_dir)
    target_ckpt = Checkpoint(target_dir)
    tokenizer = load_tokenizer(target_dir)
    check_rows_cover_tokenizer(target_ckpt.config.vocab_size, token_id_count(tokenizer), f"target {target_dir}")
    draft_ckpt, draft, n_shared = None, None, None
    if draft_dir is not None:
        draft_dir = resolve_model(draft_dir)
        draft_ckpt = Checkpoint(draft_dir)
        draft_tokenizer = load_tokenizer(draft_dir)
        # Embedding rows may differ (padded vocabularies); the tokenizers may not (vocab.py).
        n_shared = check_same_tokenizer(tokenizer, draft_tokenizer)
        check_rows_cover_tokenizer(draft_ckpt.config.vocab_size, token_id_count(draft_tokenizer), f"draft {draft_dir}")
        draft = load_resident(draft_ckpt, runtime.device, runtime.dtype, runtime.draft_quant)
    target = load_target(target_ckpt, offload, runtime, progress)
    for ckpt in (target_ckpt, draft_ckpt):
        if ckpt is not None:
            ckpt.close()     # the weights now live in the models, the arena or the store
    eos = stop_token_ids(tokenizer, generation_eos(target_dir))
    engine = Engine(target, draft, tokenizer, eos, n_shared=n_shared)
    return Loaded(engine, target_ckpt, draft_ckpt, tokenizer, time.perf_counter() - start)
