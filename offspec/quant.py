"""Weight-only int8 for the resident draft's narrow calls.

A draft call over a few tree nodes is memory-bound: on a CPU it reads every weight once per call, so its
time is the model's bytes over the memory bandwidth. An int8 copy of each matrix with one scale per output
row halves those bytes:

    W (N, K)  ~=  Q (N, K) int8  *  s (N,)[:, None],   s = max_k |W[n, k]| / 127   (symmetric, per row)

Calls with more rows (the prompt, wide tree levels) are compute-bound, and there the fused int8 kernel loses
to the full-precision matmul (measured on the 0.5B draft, 2-core EPYC, bf16: 1 row 0.068 vs 0.157 s per
call, 4 rows 0.093 vs 0.160, 8 rows even, 16 rows 0.36 vs 0.21), so an Int8Weight keeps the full-precision
weight as well and each call picks by its row count. This changes the draft's distribution p a little and
nothing else: the target verifies every token, so output stays exactly the target's, greedy and sampled.

`linear` accepts a plain tensor or an Int8Weight, so the one layer forward serves both models.
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch
import torch.nn.functional as F

QUANT_MODES = ("none", "int8")

FUSED_MAX_ROWS = 4      # calls with at most this many rows read the int8 copy (see the table above)


@dataclass(frozen=True)
class Int8Weight:
    full: torch.Tensor     # (N, K) the weight in the compute dtype, for wide calls
    q: torch.Tensor        # (N, K) int8
    scale: torch.Tensor    # (N,) in the compute dtype

    @staticmethod
    def quantize(w: torch.Tensor) -> "Int8Weight":
        """w (N, K) floating -> itself plus its per-row symmetric int8 copy."""
        wf = w.float()
        scale = wf.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127.0   # (N,)
        q = torch.round(wf / scale[:, None]).clamp_(-127, 127).to(torch.int8)
        return Int8Weight(full=w, q=q, scale=scale.to(w.dtype))

    def dequantize(self) -> torch.Tensor:
        return self.q.to(self.scale.dtype) * self.scale[:, None]


def linear(x: torch.Tensor, w, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear for a plain weight or an Int8Weight. x (..., K) -> (..., N)."""
    if not isinstance(w, Int8Weight):
        return F.linear(x, w, bias)
    rows = x.numel() // x.shape[-1]
    if x.device.type != "cpu" or rows > FUSED_MAX_ROWS:
        return F.linear(x, w.full, bias)
    # aten::_weight_int8pack_mm(x (M, K), Q (N, K) int8, s (N,)) = x @ (Q * s[:, None]).T, a CPU kernel.
    out = torch._weight_int8pack_mm(x.reshape(rows, x.shape[-1]), w.q, w.scale).view(*x.shape[:-1], -1)
    return out if bias is None else out + bias


def with_int8_copies(weights):
    """A copy of the weights dataclass with every 2-D matrix as an Int8Weight (norms and biases stay as they are)."""
    matrices = [f.name for f in fields(weights)
                if isinstance(getattr(weights, f.name), torch.Tensor) and getattr(weights, f.name).dim() == 2]
    return replace(weights, **{name: Int8Weight.quantize(getattr(weights, name)) for name in matrices})
