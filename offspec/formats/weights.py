"""The forms a layer's matrix takes in the forward, and `linear`, the one matmul that reads every form.

The draft's int8 copies for narrow calls. A draft call over a few tree nodes is memory-bound: on a CPU it reads
every weight once per call, so its time is the model's bytes over the memory bandwidth. An int8 copy of each matrix
with one scale per output row (quant.int8_rows) halves those bytes:

    W (N, K)  ~=  Q (N, K) int8  *  s (N,)[:, None],   s = max_k |W[n, k]| / 127   (symmetric, per row)

Over more rows (a prompt, a wide tree level) the call is compute-bound, and there the fused int8 kernel loses
to the full-precision matmul (docs/notes/2026-11-26-draft-int8-copy.md), so an Int8Weight keeps the
full-precision weight as well. Which one a row reads is decided per SEQUENCE of a packed call, never per call:
a sequence that feeds at most FUSED_MAX_ROWS rows reads the int8 copy, a wider one the weight (narrow_rows).
Both kernels compute each row on its own, so a sequence's draft distributions do not depend on which other
sequences share its calls (a call mixing both runs the two kernels over their own rows). This changes the
draft's distribution p a little and nothing else: the target verifies every token, so output stays exactly
the target's, greedy and sampled.

A draft held quantized (`--draft-quant int8-held | nf4 | int4`): to free device memory, each matrix of the draft's
layers is kept ONLY quantized. int8-held and nf4 are HeldWeights, in the pieces a target block stores (quant.py:
per-row int8, bitsandbytes' nf4: 0.50x / 0.28x of bf16); a call dequantizes the matrix into a temporary with the
target's dequantization (quant.dequantize_matrix), but a held int8 matrix on a CPU serves narrow rows straight,
like the copy. lm_head and the embedding stay dense: dequantizing lm_head each call would cost a (V, D) temporary.
int4 (0.31x, formats/int4.py) is read in 4 bits by PyTorch's int4 matmul on a CPU and a GPU alike, lm_head
included. Like the int8 copy, this changes p only: the output stays the target's.

`linear` accepts a plain tensor, an Int8Weight, a HeldWeight or an Int4Weight, so the one layer forward serves both
models; RowKernels says which kernel each row of a packed call reads.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, fields, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from offspec.formats import cpu_bf16, int4
from offspec.formats.quant import dequantize_matrix, int8_rows, matrix_pieces, quantize_matrix

HELD_DRAFT_QUANTS = {"int8-held": "int8", "nf4": "nf4"}  # --draft-quant held quantized -> the matrices' quantization

FUSED_MAX_ROWS = 12     # a sequence feeding at most this many rows to a call reads int8 matrices straight (on a CPU)


@dataclass(frozen=True)
class Int8Weight:
    full: torch.Tensor     # (N, K) the weight in the compute dtype, for wide calls
    q: torch.Tensor        # (N, K) int8
    scale: torch.Tensor    # (N,) in the compute dtype

    @staticmethod
    def quantize(w: torch.Tensor) -> "Int8Weight":
        """w (N, K) floating -> itself plus its per-row symmetric int8 copy."""
        q, scale = int8_rows(w)
        return Int8Weight(full=w, q=q, scale=scale.to(w.dtype))

    def dequantize(self) -> torch.Tensor:
        return self.q.to(self.scale.dtype) * self.scale[:, None]


@dataclass(frozen=True)
class HeldWeight:
    """A matrix held only quantized (the draft's --draft-quant int8-held | nf4), in the pieces a target block
    stores it as (quant.quantize_matrix); each call dequantizes it into a temporary (the module's docstring)."""
    quant: str                          # "int8" | "nf4"
    shape: tuple[int, int]              # (N, K)
    dtype: torch.dtype                  # the compute dtype it dequantizes into
    pieces: dict[str, torch.Tensor]     # by suffix: "int8" (N, K) + "scale" (N,) | "nf4" packed + "absmax"

    @staticmethod
    def quantize(w: torch.Tensor, quant: str) -> "HeldWeight":
        """w (N, K) in the compute dtype, on its device -> held as `quant` there (w itself is not kept)."""
        return HeldWeight(quant, tuple(w.shape), w.dtype, quantize_matrix(quant, w, w.dtype))

    @property
    def device(self) -> torch.device:
        return next(iter(self.pieces.values())).device

    @property
    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.pieces.values())

    def dequantize(self) -> torch.Tensor:
        """(N, K) in the compute dtype, a fresh temporary."""
        out = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dequantize_matrix(self.quant, self.pieces, out)
        return out


def narrow_rows(widths: Sequence[int], device: torch.device) -> Optional[torch.Tensor]:
    """The rows of a packed call that read int8 matrices straight: (N,) bool, N = sum(widths), True for every row
    of a sequence feeding at most FUSED_MAX_ROWS rows (widths: each sequence's rows, in packing order). None where
    no row does: on a GPU every call dequantizes or reads the dense weight (the fused kernel is a CPU one)."""
    if device.type != "cpu" or not any(w <= FUSED_MAX_ROWS for w in widths):
        return None
    return torch.cat([torch.full((w,), w <= FUSED_MAX_ROWS, dtype=torch.bool) for w in widths])


@dataclass(frozen=True)
class RowKernels:
    """Which kernel each row of a packed call reads (linear), chosen by its sequence's rows in the pass, never by
    the call's, so a sequence's numbers do not depend on what shares its calls. None: no row."""
    narrow: Optional[torch.Tensor] = None    # (N,) bool: int8 matrices read straight (narrow_rows)
    wide: Optional[torch.Tensor] = None      # (N,) bool: bfloat16 dense matmuls in float32 (cpu_bf16.wide_rows)

    @staticmethod
    def of(widths: Sequence[int], device: torch.device, dtype: torch.dtype) -> "RowKernels":
        widths = list(widths)
        return RowKernels(narrow_rows(widths, device), cpu_bf16.wide_rows(widths, device, dtype))

    def cut(self, a: int, b: int) -> "RowKernels":
        """The rows [a, b) of the call."""
        return RowKernels(*(None if m is None else m[a:b] for m in (self.narrow, self.wide)))

    def take(self, rows: torch.Tensor) -> "RowKernels":
        """The rows `rows` (R,) of the call, in that order."""
        return RowKernels(*(None if m is None else m[rows.cpu()] for m in (self.narrow, self.wide)))


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None, kernels: RowKernels = RowKernels()) -> torch.Tensor:
    """F.linear for a plain weight, an Int8Weight, a HeldWeight or an Int4Weight. x (..., K) -> (..., N), each row
    by the kernel `kernels` gives it: narrow rows read an int8 matrix straight (an Int8Weight's copy, a held int8
    matrix); the others read the full-precision weight (an Int8Weight's own, a HeldWeight's dequantized), in float32
    where they are wide (cpu_bf16.float32_linear). Each row's result is the same whatever the other rows are. An int4
    weight reads its own kernel."""
    if isinstance(w, int4.Int4Weight):
        return w.matmul(x, bias)
    rows = x.reshape(-1, x.shape[-1])                                                  # (M, K)
    if isinstance(w, torch.Tensor):
        return _dense(rows, w, bias, kernels.wide).view(*x.shape[:-1], -1)
    int8 = ((w.q, w.scale) if isinstance(w, Int8Weight) else
            (w.pieces["int8"], w.pieces["scale"]) if w.quant == "int8" else None)
    dense = (lambda: w.full) if isinstance(w, Int8Weight) else w.dequantize   # a HeldWeight's only when needed
    narrow = kernels.narrow
    if narrow is None or int8 is None or not bool(narrow.any()):
        out = _dense(rows, dense(), bias, kernels.wide)
    elif bool(narrow.all()):
        out = _int8_matmul(rows, *int8, bias)
    else:
        out = rows.new_empty(rows.shape[0], int8[0].shape[0])                           # (M, N)
        out[narrow] = _int8_matmul(rows[narrow], *int8, bias)
        out[~narrow] = _dense(rows[~narrow], dense(), bias, None if kernels.wide is None else kernels.wide[~narrow])
    return out.view(*x.shape[:-1], -1)


def _dense(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, wide: Optional[torch.Tensor]) -> torch.Tensor:
    """x (M, K) @ w.T (+ bias) -> (M, N): the rows `wide` (M,) marks in float32, the others by F.linear."""
    if wide is None or not bool(wide.any()):
        return F.linear(x, w, bias)
    if bool(wide.all()):
        return cpu_bf16.float32_linear(x, w, bias)
    out = x.new_empty(x.shape[0], w.shape[0])                                             # (M, N)
    out[wide] = cpu_bf16.float32_linear(x[wide], w, bias)
    out[~wide] = F.linear(x[~wide], w, bias)
    return out


def _int8_matmul(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x (M, K) @ (q * scale[:, None]).T (+ bias) -> (M, N), by aten::_weight_int8pack_mm (a CPU kernel)."""
    out = torch._weight_int8pack_mm(x, q, scale)
    return out if bias is None else out + bias


def matrix_names(weights) -> list[str]:
    """The fields of a weights dataclass (LayerWeights, ...) that hold a dense 2-D matrix."""
    return [f.name for f in fields(weights)
            if isinstance(getattr(weights, f.name), torch.Tensor) and getattr(weights, f.name).dim() == 2]


def with_quantized_matrices(weights, draft_quant: str, source_group: Optional[int] = None):
    """A copy of the weights dataclass with every 2-D matrix as --draft-quant says: "int8" an Int8Weight (the
    weight plus its int8 copy), "int8-held" | "nf4" a HeldWeight, "int4" an int4.Int4Weight (quantized only);
    norms and biases as they are. source_group: int4's groups where they can be the checkpoint's (int4.source_group)."""
    matrices = matrix_names(weights)
    make = (Int8Weight.quantize if draft_quant == "int8" else
            functools.partial(int4.Int4Weight.quantize, source=source_group) if draft_quant == "int4" else
            functools.partial(HeldWeight.quantize, quant=HELD_DRAFT_QUANTS[draft_quant]))
    return replace(weights, **{name: make(getattr(weights, name)) for name in matrices})


def held_matrix_nbytes(quant: str, shape: tuple[int, int], dtype: torch.dtype) -> int:
    """Device bytes of a HeldWeight of this (N, K) shape (the memory plan counts the held draft with it)."""
    return sum(math.prod(piece_shape) * piece_dtype.itemsize for _, piece_shape, piece_dtype in
               matrix_pieces(quant, shape, dtype))
