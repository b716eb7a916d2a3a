"""4-bit weights with group scales, read as 4 bits by PyTorch's own int4 matmul (the draft's --draft-quant int4).

Each row of a matrix W (N, K) is cut into groups of G consecutive weights (GROUP, 32; or the groups a 4-bit checkpoint
was published in, where the twin then lands on the target's own levels: source_group); each group has its own scale
and zero (asymmetric min-max):

    W[n, k]  ~=  (q[n, k] - 8) * s[g, n] + z[g, n],     g = k // G,   q[n, k] in 0..15
    s = (max - min) / 15,   z = min + 8 s                over the G weights of group g of row n

PyTorch ships the kernels (the "tinygemm" int4 matmul gpt-fast and torchao use): aten::_weight_int4pack_mm on
CUDA (compute capability 8.0 and later, bfloat16) and aten::_weight_int4pack_mm_for_cpu (any float dtype). Both
read the packed 4-bit matrix and the (K / G, N, 2) scales and zeros as they are, never a dequantized matrix: a
call over a few rows reads 0.625 bytes a weight (G = 32; 0.5625 at 64) where bf16 reads 2 and a held nf4 matrix,
dequantized for the call, writes and reads 2 more. The packed layout differs by device, so a matrix is packed on
the device it will run on, when it is built.

The kernels' shape rules, met here: K a multiple of 32 (CUDA packs 16-wide k-tiles two or more at a time) and of
G; N a multiple of 16 (the CPU packing's; CUDA's is 8), met by padding rows with zeros and dropping their outputs.
A matrix with K not a multiple of 32 cannot be held this way (check_shapes says so in one line).

This changes the draft's distribution p only, like every draft quantization: the target verifies every token.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from offspec.errors import InputError

GROUP = 32                  # the group size, unless the source's (below); K is a multiple of it (K_MULTIPLE)
KERNEL_GROUPS = (32, 64, 128, 256)   # the group sizes PyTorch's kernels take
K_MULTIPLE = 32
N_MULTIPLE = 16
ROWS_AT_ONCE = 512          # rows quantized at a time (their float32 copy, not the matrix's)


def group_size(K: int, source: Optional[int] = None) -> int:
    """G for a matrix of input width K (a multiple of K_MULTIPLE): the source's group (source_group) where the
    kernels take it and it divides K, else GROUP."""
    if source in KERNEL_GROUPS and K % source == 0:
        return source
    return GROUP


def source_group(quant: str) -> Optional[int]:
    """The groups a 4-bit published or GGUF checkpoint (its ModelSpec.quant) quantized its matrices in, along K:
    a matrix dequantized from them lies on 16 levels a group, so min-max int4 in the SAME groups lands on those
    levels again, up to the rounding of the scales and zeros to the compute dtype (measured on a GGUF target:
    docs/notes/2026-11-28-int4-twin.md). GGUF: 32 (the blocks and K-quant sub-blocks). None for anything else
    (8 bits, per channel, dense)."""
    if quant.startswith("gguf:"):
        return 32
    found = re.fullmatch(r"(?:awq|gptq-b4|ct-b4)-g(\d+)(?:-.*)?", quant)
    return int(found.group(1)) if found and int(found.group(1)) in KERNEL_GROUPS else None


def held_group(quant: str) -> int:
    """The groups an int4 copy of a checkpoint (its ModelSpec.quant) is held in: its own (source_group), else
    GROUP; a matrix whose K the source's groups do not divide takes GROUP (group_size). The caches of what an int4
    copy does (the twin's file, the pair's acceptance) are named by it."""
    return source_group(quant) or GROUP


def fits(shape: tuple[int, int]) -> bool:
    return shape[1] % K_MULTIPLE == 0


def nbytes(shape: tuple[int, int], dtype: torch.dtype, source: Optional[int] = None) -> int:
    """Device bytes of an Int4Weight of this (N, K) shape: the packed matrix and its scales and zeros."""
    N, K = -(-shape[0] // N_MULTIPLE) * N_MULTIPLE, shape[1]
    return N * K // 2 + (K // group_size(K, source)) * N * 2 * dtype.itemsize


def quantize_groups(w: torch.Tensor, G: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w (N, K) floating -> q (N, K) int32 in 0..15, scales_zeros (K / G, N, 2) in w's dtype, with
    w ~= (q - 8) * s + z per group (the module's formula). Twins kept on disk hold its output: a change to it
    bumps model.twin_store.VERSION."""
    N, K = w.shape
    q = torch.empty(N, K, dtype=torch.int32, device=w.device)                           # (N, K)
    sz = torch.empty(K // G, N, 2, dtype=w.dtype, device=w.device)                      # (K/G, N, 2)
    for a in range(0, N, ROWS_AT_ONCE):
        b = min(a + ROWS_AT_ONCE, N)
        wf = w[a:b].to(torch.float32, copy=True).view(b - a, K // G, G)                 # (n, K/G, G): a copy
        lo, hi = torch.aminmax(wf, dim=2)                                               # (n, K/G) each
        s = ((hi - lo) / 15).clamp_min(torch.finfo(torch.float32).tiny)
        q[a:b] = wf.sub_(lo[..., None]).div_(s[..., None]).round_().clamp_(0, 15).view(b - a, K)
        sz[:, a:b, 0] = s.t().to(w.dtype)
        sz[:, a:b, 1] = (lo + 8 * s).t().to(w.dtype)
    return q, sz


def dequantize_groups(q: torch.Tensor, sz: torch.Tensor, G: int) -> torch.Tensor:
    """The reference: q (N, K) int32, scales_zeros (K / G, N, 2) -> (N, K) float32 (the module's formula, from the
    stored scales and zeros)."""
    N, K = q.shape
    s, z = sz.float().permute(1, 0, 2).unbind(-1)                                       # (N, K/G) each
    return ((q.float().view(N, K // G, G) - 8) * s[..., None] + z[..., None]).view(N, K)


def reference(w: torch.Tensor, source: Optional[int] = None) -> torch.Tensor:
    """w (N, K) -> what an Int4Weight of it holds, dequantized: (N, K) float32 (quantize_groups, then
    dequantize_groups, in Int4Weight.quantize's groups). The kernels' output is checked against x @ this.T."""
    G = group_size(w.shape[1], source)
    return dequantize_groups(*quantize_groups(w, G), G)


def _pack(q: torch.Tensor) -> torch.Tensor:
    """q (N, K) int32 in 0..15 -> the layout its device's kernel reads."""
    if q.device.type == "cpu":
        return torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
    pairs = (q[:, 0::2] << 4 | q[:, 1::2]).to(torch.uint8).contiguous()                # (N, K/2): even k high
    tiles = next(t for t in (8, 4, 2) if q.shape[1] % (16 * t) == 0)
    return torch.ops.aten._convert_weight_to_int4pack(pairs, tiles)


@dataclass(frozen=True)
class Int4Weight:
    packed: torch.Tensor           # the padded (N', K) matrix's 4-bit values, in its device's kernel layout
    scales_zeros: torch.Tensor     # (K / G, N', 2) in the compute dtype
    group: int                     # G
    shape: tuple[int, int]         # (N, K), before padding

    @staticmethod
    def quantize(w: torch.Tensor, source: Optional[int] = None,
                 device: Optional[torch.device] = None) -> "Int4Weight":
        """w (N, K) in the compute dtype -> held in 4 bits on `device` (default: w's), w not kept. source: the
        groups its checkpoint was quantized in (source_group), used where the kernels take them. Quantized where
        w lies, ROWS_AT_ONCE rows at a time, each chunk packed on `device`: both kernels pack rows in tiles that
        divide ROWS_AT_ONCE (CUDA 8, CPU 32), so the chunks' packs laid end to end are the matrix's, and an
        lm_head in host memory crosses only as 4 bits."""
        N, K = w.shape
        device = w.device if device is None else torch.device(device)
        G, n_pad = group_size(K, source), -(-N // N_MULTIPLE) * N_MULTIPLE
        packed, sz = None, torch.empty(K // G, n_pad, 2, dtype=w.dtype, device=device)     # (K/G, N', 2)
        for a in range(0, n_pad, ROWS_AT_ONCE):
            b = min(a + ROWS_AT_ONCE, n_pad)
            rows = w[a:b]
            if rows.shape[0] < b - a:                                                   # the zero rows of N'
                rows = torch.cat([rows, rows.new_zeros(b - a - rows.shape[0], K)])
            q, chunk_sz = quantize_groups(rows, G)
            chunk = _pack(q.to(device))                                                 # ((b - a) / r, ...)
            if packed is None:
                r = (b - a) // chunk.shape[0]                   # rows an entry of the pack holds: CPU 1, CUDA 8
                packed = chunk.new_empty((n_pad // r, *chunk.shape[1:]))
            packed[a // r:b // r] = chunk
            sz[:, a:b] = chunk_sz.to(device)
        return Int4Weight(packed, sz, G, (N, K))

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scales_zeros))

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x (..., K) -> (..., N): x @ W.T (+ bias), W read in 4 bits."""
        rows = x.reshape(-1, x.shape[-1]).contiguous()                                  # (M, K)
        mm = (torch.ops.aten._weight_int4pack_mm_for_cpu if rows.device.type == "cpu" else
              torch.ops.aten._weight_int4pack_mm)
        out = mm(rows, self.packed, self.group, self.scales_zeros)[:, :self.shape[0]]    # (M, N)
        if bias is not None:
            out = out + bias
        return out.reshape(*x.shape[:-1], self.shape[0])


def check_shapes(shapes, option: str) -> None:
    """Refuse, in one line, a model with a matrix the int4 kernels cannot hold (K not a multiple of 32)."""
    bad = [s for s in shapes if not fits(s)]
    if bad:
        raise InputError(f"{option} holds matrices in 4-bit groups, which needs each matrix's input width to be a "
                         f"multiple of {K_MULTIPLE}; this model has {bad[0][1]}: use --draft-quant nf4 or int8-held")


def check_device(device: torch.device, dtype: torch.dtype, option: str) -> None:
    """Refuse, in one line, a device or dtype the int4 kernel cannot run: try one small matrix against the
    reference dequantization now, not after building a twin."""
    if device.type == "cuda" and dtype != torch.bfloat16:
        raise InputError(f"{option} runs PyTorch's CUDA int4 kernel, which takes bfloat16 only: use --dtype bfloat16, "
                         f"or --draft-quant nf4")
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 128, generator=gen).to(device=device, dtype=dtype)             # (N, K), N padded to 64
    x = torch.randn(3, 128, generator=gen).to(device=device, dtype=dtype)
    try:
        got = Int4Weight.quantize(w).matmul(x).float()                                  # (3, 48)
    except Exception as err:   # no kernel for this device / build / GPU generation
        first = str(err).splitlines()[0] if str(err) else ""
        raise InputError(f"{option}: PyTorch's int4 matmul cannot run here ({type(err).__name__}: {first}); "
                         f"use --draft-quant nf4 or int8-held") from None
    want = x.float() @ reference(w).t()                                                  # (3, 48)
    if not torch.allclose(got, want, rtol=0.05, atol=0.05 * float(want.abs().max())):
        raise InputError(f"{option}: PyTorch's int4 matmul disagrees with its reference on this device "
                         f"(max error {float((got - want).abs().max()):.3g}); use --draft-quant nf4 or int8-held")
