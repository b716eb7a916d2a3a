"""A twin's 4-bit layers kept on disk once built, like a prepared store:
$OFFSPEC_HOME/twins/<target folder>-int4-<key>.safetensors.

Only where building it costs: an int4 twin quantized on a CPU from the target's resident dense layers (reading
its file back costs what the drive needs for 0.31x of the target's bf16 bytes; build and read times:
docs/notes/2026-11-29-choosing-the-draft.md). On a GPU the twin is quantized on the device as the target's layers
pass, faster than the file could be read, so nothing is kept.

The file holds every Int4Weight of the twin's layers (int4.Int4Weight: its packed values in the CPU kernel's layout
and its (K/G, N', 2) scales and zeros), named "<layer>.<field>.packed" / ".scales_zeros", and in its metadata each
matrix's (G, N, K); the lm_head is not in it (draft_quant.draft_lm_head: on a CPU, an int8 copy made at load). The
key hashes what the bytes depend on: the target's weights (Checkpoint.fingerprint), the compute dtype, the groups
(int4.held_group: a published format's own, else int4.GROUP), torch's version (the packed layout is the kernel's)
and VERSION (bumped when int4's quantization or what the file holds changes). A file of another key is never read
(another name); one that does not load (truncated, edited) is rebuilt with one warning line. Written to a temporary
name, then renamed, so a run stopped while writing leaves no file that looks whole. A drive without room for it is
skipped with one line.
"""
from __future__ import annotations

import glob
import hashlib
import json
import os
import shutil
import sys
from dataclasses import fields, replace
from pathlib import Path
from typing import Callable

import torch

from offspec.formats.checkpoint import Checkpoint
from offspec.formats.int4 import Int4Weight, held_group
from offspec.formats.layout import LayerWeights, format_bytes
from offspec.formats.weights import matrix_names
from offspec.model.forward import Model

FREE_MARGIN = 1 << 30       # bytes the drive keeps free beyond the file
VERSION = 3                 # of int4's quantization (quantize_groups, group_size) and of what the file holds


def twins_dir() -> Path:
    from offspec.formats.demo import offspec_home
    return offspec_home() / "twins"


def twin_path(ckpt: Checkpoint, dtype: torch.dtype) -> Path:
    """Where the int4 twin of `ckpt` in `dtype` is kept (module docstring: the key)."""
    text = f"{ckpt.fingerprint()}|int4 v{VERSION}|g{held_group(ckpt.quant)}|{dtype}|torch {torch.__version__}|cpu"
    return twins_dir() / _file_name(ckpt.path.name, hashlib.sha1(text.encode()).hexdigest()[:16])


def _file_name(target: str, key: str) -> str:
    """A twin file's name: its target's folder (or GGUF file) name and its key."""
    return f"{target}-int4-{key}.safetensors"


def cached_layers(ckpt: Checkpoint, target: Model, build: Callable[[], list[LayerWeights]]) -> list[LayerWeights]:
    """The int4 twin's layers of `target` (its layers resident and dense, on the CPU): read from their file where
    one is kept, else build() and kept. Their vectors (norms, biases) are the target's own tensors."""
    path = twin_path(ckpt, target.dtype)
    if path.is_file():
        try:
            return _read(path, target)
        except Exception as err:       # a file that does not load is rebuilt: noted, never fatal
            print(f"offspec: warning: rebuilding the twin: {path} does not load ({' '.join(str(err).split())})",
                  file=sys.stderr)
    layers = build()
    _write(path, layers, ckpt.path.name)
    return layers


def _weights(layers: list[LayerWeights]) -> dict[str, Int4Weight]:
    """Every Int4Weight of a twin's layers, by its name in the file."""
    named = {f"{i}.{f.name}": getattr(w, f.name) for i, w in enumerate(layers) for f in fields(w)}
    return {name: w for name, w in named.items() if isinstance(w, Int4Weight)}


def _write(path: Path, layers: list[LayerWeights], target: str) -> None:
    from safetensors.torch import save_file

    weights = _weights(layers)
    tensors = {f"{name}.{part}": getattr(w, part).contiguous() for name, w in weights.items()
               for part in ("packed", "scales_zeros")}
    size = sum(t.numel() * t.element_size() for t in tensors.values())
    path.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(path.parent).free
    if free < size + FREE_MARGIN:
        print(f"offspec: note: the twin is not kept on disk ({format_bytes(size)} needed, {format_bytes(free)} free "
              f"in {path.parent}); it is built again next run", file=sys.stderr)
        return
    meta = {"shapes": json.dumps({name: [w.group, *w.shape] for name, w in weights.items()})}
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    try:
        save_file(tensors, str(tmp), metadata=meta)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        print(f"offspec: warning: could not keep the twin in {path} ({err})", file=sys.stderr)
        return
    print(f"offspec: the twin's int4 matrices are kept in {path} ({format_bytes(size)}); later runs read them "
          f"instead of quantizing the target again{_others(path, target)}", file=sys.stderr)


def _others(path: Path, target: str) -> str:
    """The other twin files of `target` beside path (another key: dtype, torch or offspec version), for the line
    that says a twin was kept: an upgrade leaves the old twin unread, as big as the new one."""
    others = [p for p in path.parent.glob(_file_name(glob.escape(target), "*")) if p != path]
    if not others:
        return ""
    size = format_bytes(sum(p.stat().st_size for p in others))
    return (f"; {len(others)} other twin file{'s' * (len(others) > 1)} of this target there ({size}), kept for "
            f"another dtype, torch or offspec version: delete {'them' if len(others) > 1 else 'it'} if unused")


def _read(path: Path, target: Model) -> list[LayerWeights]:
    """The twin's layers from their file, beside the target's own vectors."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        shapes = json.loads(f.metadata()["shapes"])
        weights = {name: Int4Weight(f.get_tensor(f"{name}.packed"), f.get_tensor(f"{name}.scales_zeros"), group,
                                    (n, k)) for name, (group, n, k) in shapes.items()}
    layers = []
    for i, w in enumerate(target.layers.layers):
        names = matrix_names(w)
        if any(f"{i}.{name}" not in weights for name in names):
            raise ValueError(f"layer {i}'s matrices are not all in the file")
        layers.append(replace(w, **{name: weights.pop(f"{i}.{name}") for name in names}))
    if weights:
        raise ValueError(f"{len(weights)} matrices of layers the target does not have")
    return layers
