"""Pre-quantized checkpoints as published: their matrices' pieces, read as they are and dequantized exactly.

A published quantization is named by one string, the target quantization a run carries (RuntimeConfig.
target_quant, quant.QuantizedLayout): the stored pieces of every matrix go into the layer's one aligned block as
they are, and quant.py dequantizes them right before the layer runs, as it does its own int8 and nf4 blocks.

    awq-g{G}   AutoAWQ's GEMM layout, 4 bits, zero point, groups of G input rows. A linear W (N out, K in) is
               stored transposed and packed:
                 qweight (K, N/8) int32   eight 4-bit values q[k, n] per int32, nibble i (bits 4i..4i+3) of
                                          qweight[k, c] holding column n = 8c + AWQ_ORDER[i]
                 qzeros  (K/G, N/8) int32 the zero points z[g, n], packed the same way
                 scales  (K/G, N) float16 s[g, n]
               W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n], computed in float16 (as AutoAWQ's
               dequantize_gemm does; the difference is a small integer, so float16 rounds the product once).
"""
from __future__ import annotations

from typing import Optional

import torch

from .errors import CheckpointError

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)     # nibble i of a packed int32 holds column 8c + AWQ_ORDER[i]
AWQ_COLUMN_NIBBLE = tuple(AWQ_ORDER.index(t) for t in range(8))   # column 8c + t sits in nibble AWQ_COLUMN_NIBBLE[t]
DEQUANT_ROWS = 1024                      # input rows dequantized at a time: bounds the float16 temporaries


def is_published(quant: str) -> bool:
    return quant.startswith("awq-")


def awq_group(quant: str) -> int:
    return int(quant.removeprefix("awq-g"))


def describe(quant: str) -> str:
    """For reports: 'AWQ int4, groups of 128'."""
    return f"AWQ int4 (GEMM), groups of {awq_group(quant)}" if quant.startswith("awq-") else quant


def quant_of_config(raw: dict, where: str) -> str:
    """config.json's quantization_config -> the published quantization ("none" without one), or CheckpointError
    naming what is not supported."""
    qc = raw.get("quantization_config")
    if not qc:
        return "none"
    method = str(qc.get("quant_method", "")).lower()
    if method != "awq":
        raise CheckpointError(f"{where}: quantization_config quant_method {method or '(none)'!r} is not supported; "
                              f"offspec reads AWQ 4-bit GEMM checkpoints as published")
    version = str(qc.get("version", "gemm")).lower()
    bits, group, zero = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size")), \
        qc.get("zero_point", True)
    if version != "gemm":
        raise CheckpointError(f"{where}: AWQ version {version!r} is not supported (only the GEMM layout; an "
                              f"exllama or marlin repack needs the original GEMM checkpoint)")
    if bits != 4:
        raise CheckpointError(f"{where}: AWQ with {bits} bits is not supported (only 4)")
    if not zero:
        raise CheckpointError(f"{where}: AWQ without zero points is not supported")
    if not isinstance(group, int) or group <= 0:
        raise CheckpointError(f"{where}: AWQ group_size {group!r} is not supported (a positive group size)")
    return f"awq-g{group}"


def matrix_pieces(quant: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The pieces an (N, K) matrix is published as: (suffix, shape, dtype)."""
    N, K = shape
    G = awq_group(quant)
    return [("qweight", (K, N // 8), torch.int32), ("qzeros", (K // G, N // 8), torch.int32),
            ("scales", (K // G, N), torch.float16)]


def check_matrix(quant: str, shape: tuple[int, ...], name: str) -> Optional[str]:
    """Why an (N, K) matrix cannot be stored this way (None when it can): its sizes must divide."""
    N, K = shape
    G = awq_group(quant)
    if N % 8:
        return f"{name}: {N} output rows are not a multiple of 8 (AWQ packs 8 a word)"
    if K % G:
        return f"{name}: {K} input rows are not a multiple of the group size {G}"
    return None


def _unpack(packed: torch.Tensor) -> torch.Tensor:
    """(R, C) int32 -> (R, 8C) int32 in column order: value n of a row sits in nibble AWQ_COLUMN_NIBBLE[n % 8] of
    word n // 8."""
    # 4 * AWQ_COLUMN_NIBBLE[t] = 4 * (t // 2 + 4 * (t % 2)), made on the device (no host-to-device copy).
    t = torch.arange(8, dtype=torch.int32, device=packed.device)
    shifts = 4 * (t // 2 + 4 * (t % 2))                                                             # (8,)
    return ((packed[:, :, None] >> shifts) & 0xF).reshape(packed.shape[0], -1)


def _pack(values: torch.Tensor) -> torch.Tensor:
    """(R, 8C) values in 0..15 -> (R, C) int32, the inverse of _unpack."""
    R, n = values.shape
    v = values.to(torch.int32).reshape(R, n // 8, 8)
    packed = torch.zeros(R, n // 8, dtype=torch.int32, device=values.device)
    for t in range(8):
        packed |= v[:, :, t] << (4 * AWQ_COLUMN_NIBBLE[t])
    return packed


def dequantize(quant: str, pieces: dict[str, torch.Tensor], out: torch.Tensor) -> None:
    """out (N, K) in the compute dtype <- W = (q - z) * s in float16, DEQUANT_ROWS input rows at a time."""
    G = awq_group(quant)
    qweight, qzeros, scales = pieces["qweight"], pieces["qzeros"], pieces["scales"]    # (K, N/8), (K/G, N/8), (K/G, N)
    K = qweight.shape[0]
    step = max(G, DEQUANT_ROWS // G * G)
    for a in range(0, K, step):
        b = min(K, a + step)
        q = _unpack(qweight[a:b])                                             # (b - a, N)
        z = _unpack(qzeros[a // G: -(-b // G)]).repeat_interleave(G, 0)      # (b - a, N)
        s = scales[a // G: -(-b // G)].repeat_interleave(G, 0)                # (b - a, N) float16
        out[:, a:b] = ((q - z).to(torch.float16) * s).t()


def quantize(quant: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """w (N, K) -> its AWQ pieces by min-max quantization per group (AutoAWQ's pseudo_quantize and GEMM packing,
    without the activation-aware scale search, which only changes w before this step). For tests and the probe;
    a published checkpoint is read as it is."""
    G = awq_group(quant)
    N, K = w.shape
    groups = w.float().t().reshape(K // G, G, N)                              # (K/G, G, N)
    lo, hi = groups.amin(dim=1), groups.amax(dim=1)                           # (K/G, N)
    scales = ((hi - lo).clamp(min=1e-5) / 15).to(torch.float16)
    s = scales.float()
    zeros = (-torch.round(lo / s)).clamp(0, 15)
    q = (torch.round(groups / s[:, None]) + zeros[:, None]).clamp(0, 15).reshape(K, N)
    return {"qweight": _pack(q), "qzeros": _pack(zeros), "scales": scales}
