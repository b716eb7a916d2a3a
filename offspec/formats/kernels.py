"""The fused dequantization kernels (kernels_jit.py) launched for a matrix's quantization, and the fallback to the
torch transcriptions where they cannot run.

On a CUDA device every streamed published, GGUF and int8 matrix is dequantized by one kernel launch
(dequantize); a CPU keeps the torch transcriptions, which are also the kernels' reference in the tests. Where
Triton is missing or a kernel cannot be built for the device (an old GPU), one warning line says so and the torch
path runs from then on: the output is the same, only slower. OFFSPEC_DEQUANT=torch forces the torch path (for
A/B runs of the same engine).

launch() runs a kernel on any device Triton can drive, a CPU one included under TRITON_INTERPRET=1 (the tests).
"""
from __future__ import annotations

import functools
import importlib
import logging
import os
from typing import Optional

import torch

from offspec.formats import gguf_blocks, published

log = logging.getLogger("offspec")

# Output tile (rows, columns) and warps a program takes, by kernel (compressed-tensors by its bits): the fastest
# of those timed on a 70B layer (scripts/gpu_session.py, docs/gpu/). AWQ and GPTQ pack along the input rows, so
# their tiles are tall; the others read their rows in order, so theirs are long.
TILES = {"awq": (128, 32, 4), "gptq": (64, 64, 4), "ct4": (4, 1024, 8), "ct8": (8, 512, 4), "int8": (16, 256, 4),
         "gguf": (2, 1024, 4)}
OUT_KINDS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}
GGUF_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K")   # TYPE ids


@functools.lru_cache(maxsize=1)
def _jit():
    """The kernels module, or None (with its one warning) where Triton cannot be imported."""
    try:
        kernels_jit = importlib.import_module("offspec.formats.kernels_jit")
    except ImportError as err:
        log.warning(f"Triton is not available ({err}): published checkpoints are dequantized by the slower torch "
                    f"path (pip install triton)")
        return None
    return kernels_jit


_broken: list[str] = []     # the first launch error, once seen: the torch path from then on


def tile_key(quant: str) -> str:
    """The TILES entry a quantization's kernel launches with."""
    if gguf_blocks.is_gguf(quant):
        return "gguf"
    if quant.startswith("ct-"):
        return f"ct{published.ct_params(quant)[0]}"           # by its bits
    return quant.split("-")[0]                                 # int8, gptq-..., awq-...


def handles(quant: str) -> bool:
    """Whether a kernel exists for this quantization (nf4 has bitsandbytes' own)."""
    return quant == "int8" or published.is_published(quant)


def dequantize(quant: str, pieces: dict[str, torch.Tensor], out: torch.Tensor, field: Optional[str] = None,
               layer: Optional[int] = None) -> bool:
    """out (N, K) on a CUDA device <- the matrix its pieces hold, by its fused kernel. False (out untouched) where
    the torch path must do it: not CUDA, no kernel for this quantization, OFFSPEC_DEQUANT=torch, or a kernel that
    cannot run here (said once)."""
    if out.device.type != "cuda" or not handles(quant) or os.environ.get("OFFSPEC_DEQUANT", "") == "torch":
        return False
    return launched(quant, pieces, out, field, layer)


def launched(quant: str, pieces: dict[str, torch.Tensor], out: torch.Tensor, field: Optional[str] = None,
             layer: Optional[int] = None) -> bool:
    """launch(), or False once Triton is missing or a launch has failed (one warning line, then the torch path
    for the rest of the run: no traceback, the same output)."""
    if _broken or _jit() is None:
        return False
    try:
        launch(quant, pieces, out, field, layer)
    except Exception as err:      # an old GPU, a Triton that cannot compile for it: say so once, then torch
        _broken.append(f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
        where = torch.cuda.get_device_name(out.device) if out.device.type == "cuda" else str(out.device)
        log.warning(f"the Triton dequantization kernels cannot run on {where} ({_broken[0]}): the slower torch "
                    f"path dequantizes from now on")
        return False
    return True


def launch(quant: str, pieces: dict[str, torch.Tensor], out: torch.Tensor, field: Optional[str] = None,
           layer: Optional[int] = None) -> None:
    """out (N, K) float32 | float16 | bfloat16 <- its pieces, by the kernel of `quant` (field, layer: which
    matrix, as published.dequantize takes them). Raises where Triton cannot run it."""
    jit = _jit()
    if jit is None:
        raise RuntimeError("Triton is not available")
    assert out.is_contiguous() and all(p.is_contiguous() for p in pieces.values())
    N, K = out.shape
    dst, kind = (out.view(torch.uint16) if out.dtype == torch.bfloat16 else out), OUT_KINDS[out.dtype]
    if gguf_blocks.is_gguf(quant):
        name = gguf_blocks.type_of(quant, field, layer)
        t, row = gguf_blocks.BY_NAME[name], gguf_blocks.row_nbytes(name, K)
        raw = pieces["blocks"][: N * row]
        BN, BK, warps = TILES[tile_key(quant)]
        NB = max(1, BK // t.block)                                             # blocks a row a program
        jit.gguf_kernel[(_cdiv(N, BN), _cdiv(K // t.block, NB))](
            raw, raw.view(torch.int16), dst, N, K, row, TYPE=GGUF_TYPES.index(name), B=t.block, SIZE=t.size,
            OUT=kind, BN=BN, NB=NB, num_warps=warps, enable_fp_fusion=False)
    elif quant == "int8":
        scale = pieces["scale"]
        _run(jit.int8_kernel, tile_key(quant), N, K, pieces["int8"], scale, dst, N, K, SCALE=OUT_KINDS[scale.dtype], OUT=kind)
    elif quant.startswith("gptq-"):
        bits, _, v2 = published.gptq_params(quant)
        zeros = pieces["qzeros"] if v2 else published.v1_zeros_as_v2(pieces["qzeros"], bits)
        _run(jit.gptq_kernel, tile_key(quant), N, K, pieces["qweight"], zeros, pieces["scales"], pieces["g_idx"], dst, N, K,
             BITS=bits, OUT=kind)
    elif quant.startswith("ct-"):
        bits, _, asym, _ = published.ct_params(quant)
        scales = pieces["weight_scale"]
        zeros = pieces["weight_zero_point"] if asym else scales       # not read when symmetric
        _run(jit.ct_kernel, tile_key(quant), N, K, pieces["weight_packed"], scales, zeros, dst, N, K, K // scales.shape[1],
             BITS=bits, ASYM=asym, SCALE=OUT_KINDS[scales.dtype], OUT=kind)
    else:
        _run(jit.awq_kernel, tile_key(quant), N, K, pieces["qweight"], pieces["qzeros"], pieces["scales"], dst, N, K,
             published.awq_group(quant), OUT=kind)


def _run(kernel, tile: str, N: int, K: int, *args, **constants) -> None:
    """One launch over the (N, K) output in TILES[tile]'s tiles (tile_key); float32 operations are not fused
    (exactness)."""
    BN, BK, warps = TILES[tile]
    grid = (_cdiv(N, BN), _cdiv(K, BK))
    kernel[grid](*args, **constants, BN=BN, BK=BK, num_warps=warps, enable_fp_fusion=False)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
