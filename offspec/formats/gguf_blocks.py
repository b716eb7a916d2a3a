"""GGUF's tensor types: their block layouts, an exact torch dequantization of each, and the quantization string
a GGUF target's layer blocks carry.

A GGML-quantized matrix W (N out, K in) is stored row by row, each row as K / B blocks of `size` bytes, each
block encoding B consecutive weights of the row. The blocks (ggml-quants.c; gguf-py's quants.py, our test oracle):

    F32, F16, BF16   B = 1: the value itself
    Q8_0   34 B / 32   d f16, q[32] int8                          w = q · d
    Q4_0   18 B / 32   d f16, qs[16]                               w = (q − 8) · d
    Q4_1   20 B / 32   d f16, m f16, qs[16]                        w = d · q + m
    Q5_0   22 B / 32   d f16, qh[4], qs[16]                        w = (q − 16) · d
    Q5_1   24 B / 32   d f16, m f16, qh[4], qs[16]                 w = d · q + m
           32-weight blocks: q[j] = nibble of qs[j mod 16] (low for j < 16, high after) | bit j of qh << 4
    Q4_K  144 B / 256  d f16, dmin f16, scales[12], qs[128]        w = (d · sc_s) · q − dmin · m_s
    Q5_K  176 B / 256  d f16, dmin f16, scales[12], qh[32], qs[128]  as Q4_K, q |= bit s of qh << 4
           eight sub-blocks s of 32: sc_s, m_s six bits each from `scales`; sub-block 2c is the low nibbles of
           qs[32c .. 32c + 31], 2c + 1 their high nibbles
    Q6_K  210 B / 256  ql[128], qh[64], sc[16] int8, d f16         w = (d · sc_s) · (q − 32)
           sixteen sub-blocks of 16; q = four bits of ql | two bits of qh << 4

Every float operation below is the reference's, in its order, in float32: the weights come out bit for bit.

The quantization string of a GGUF target (RuntimeConfig.target_quant) names each decoder matrix's type:
'gguf:' then, for q, k, v, o, gate, up, down in that order, one type for every layer ('q4_k') or one a layer
joined by '/' (a Q4_K_M file gives attn_v and ffn_down more bits in some layers). A layer block reserves for a
matrix the bytes of its largest type over the layers, so every block has one size.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import torch

from offspec.errors import CheckpointError

QK_K = 256                          # weights in a K-quant super-block
# Weights dequantized at a time: bounds the float32 temporaries. A CPU is fastest with a chunk its caches hold; a
# GPU, with fewer, larger chunks (each one launches a dozen kernels).
DEQUANT_ELEMENTS = {"cpu": 1 << 20, "cuda": 1 << 22}


@dataclass(frozen=True)
class GGMLType:
    name: str       # as llama.cpp names it
    block: int      # weights per block
    size: int       # bytes per block


GGML_TYPES = {t_id: GGMLType(name, block, size) for t_id, name, block, size in (
    (0, "F32", 1, 4), (1, "F16", 1, 2), (30, "BF16", 1, 2), (8, "Q8_0", 32, 34), (2, "Q4_0", 32, 18),
    (3, "Q4_1", 32, 20), (6, "Q5_0", 32, 22), (7, "Q5_1", 32, 24), (12, "Q4_K", 256, 144), (13, "Q5_K", 256, 176),
    (14, "Q6_K", 256, 210))}
BY_NAME = {t.name: t for t in GGML_TYPES.values()}
OTHER_TYPES = {10: "Q2_K", 11: "Q3_K", 15: "Q8_K", 16: "IQ2_XXS", 17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S",
               20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S", 23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64",
               28: "F64", 29: "IQ1_M", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4"}   # named in refusals
MATRICES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")   # the string's order


def supported() -> str:
    return ", ".join(t.name for t in GGML_TYPES.values())


def row_nbytes(type_name: str, K: int) -> int:
    """Bytes of one row of K weights (K a multiple of the type's block)."""
    t = BY_NAME[type_name]
    return K // t.block * t.size


# ---------------------------------------------------------------- the quantization string

def is_gguf(quant: str) -> bool:
    return quant.startswith("gguf:")


def quant_string(types: dict[str, list[str]]) -> str:
    """{matrix field: its type in each layer} -> 'gguf:q4_k,q4_k,q4_k/q6_k/...,...' (see the module docstring)."""
    def entry(names: list[str]) -> str:
        return names[0].lower() if len(set(names)) == 1 else "/".join(n.lower() for n in names)
    return "gguf:" + ",".join(entry(types[field]) for field in MATRICES)


@functools.lru_cache(maxsize=64)
def field_types(quant: str) -> dict[str, tuple[str, ...]]:
    """The string's types: {field: (one type for every layer,) or (the type of layer 0, 1, ...)}."""
    entries = quant.removeprefix("gguf:").split(",")
    return {field: tuple(name.upper() for name in entry.split("/")) for field, entry in zip(MATRICES, entries)}


def type_of(quant: str, field: str, layer: Optional[int]) -> str:
    names = field_types(quant)[field]
    if len(names) == 1:
        return names[0]
    if layer is None:
        raise ValueError(f"{field}'s GGUF type differs between layers: the layer must be given")
    return names[layer]


def matrix_nbytes(quant: str, field: str, shape: tuple[int, int]) -> int:
    """Bytes a layer block reserves for this (N, K) matrix: its largest type's."""
    N, K = shape
    return max(N * row_nbytes(name, K) for name in field_types(quant)[field])


def describe(quant: str) -> str:
    """For reports: 'GGUF: Q4_K (q, k, o, gate, up), Q4_K/Q6_K by layer (v, down)'."""
    groups: dict[str, list[str]] = {}
    for field, names in field_types(quant).items():
        kinds = sorted(set(names))
        groups.setdefault("/".join(kinds) + (" by layer" if len(kinds) > 1 else ""), []).append(
            field.removesuffix("_proj"))
    return "GGUF: " + ", ".join(f"{kind} ({', '.join(fields)})" for kind, fields in groups.items())


def short(quant: str) -> str:
    """For file names and tables: 'gguf-q4_k+q6_k', its types."""
    names = sorted({name for names in field_types(quant).values() for name in names})
    return "gguf-" + "+".join(name.lower() for name in names)


# ---------------------------------------------------------------- exact dequantization

def dequantize(type_name: str, raw: torch.Tensor, out: torch.Tensor) -> None:
    """out (N, K) in any float dtype <- the matrix whose rows `raw` ((≥ N · row bytes,) uint8, same device)
    holds in this type, a chunk of rows at a time, computed in float32 as the reference does."""
    N, K = out.shape
    t = BY_NAME[type_name]
    per_row = row_nbytes(type_name, K)
    rows = raw[: N * per_row].view(N, per_row)
    step = max(1, min(N, DEQUANT_ELEMENTS.get(out.device.type, 1 << 22) // K))
    for a in range(0, N, step):
        b = min(N, a + step)
        blocks = rows[a:b].reshape(-1, t.size)                 # ((b - a) · K / B, size) uint8
        out[a:b] = _KERNELS[type_name](blocks).view(b - a, K)


def _f16(blocks: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block, as float32 (n, 1)."""
    return blocks[:, at: at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 16) bytes -> (n, 32): the low nibbles, then the high ones (a 32-weight block's order)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=1)


def _fields(x: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """uint8 x -> its 8 / bits fields of `bits` bits, lowest first, stacked at `dim` (shifts by a number: a shift
    by a broadcast tensor of shifts runs many times slower on a CPU)."""
    return torch.stack([(x >> shift) & ((1 << bits) - 1) for shift in range(0, 8, bits)], dim=dim)


def _five_bits(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    """(n, 4) qh, (n, 16) qs -> (n, 32) uint8: weight j's low four bits from qs, bit 4 is bit j of qh (little
    endian: bit j % 8 of byte j // 8)."""
    return _nibbles(qs) | (_fields(qh, 1, dim=2).reshape(-1, 32) << 4)


# Each kernel: (n, size) uint8 blocks -> (n, B) float32, in place on one float32 temporary (the reference's
# operations, in its order: multiplication first, then the offset).

def _q8_0(b: torch.Tensor) -> torch.Tensor:
    return b[:, 2:].view(torch.int8).float().mul_(_f16(b, 0))


def _q4_0(b: torch.Tensor) -> torch.Tensor:
    return (_nibbles(b[:, 2:]).to(torch.int8) - 8).float().mul_(_f16(b, 0))


def _q4_1(b: torch.Tensor) -> torch.Tensor:
    return _nibbles(b[:, 4:]).float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _q5_0(b: torch.Tensor) -> torch.Tensor:
    return (_five_bits(b[:, 2:6], b[:, 6:]).to(torch.int8) - 16).float().mul_(_f16(b, 0))


def _q5_1(b: torch.Tensor) -> torch.Tensor:
    return _five_bits(b[:, 4:8], b[:, 8:]).float().mul_(_f16(b, 0)).add_(_f16(b, 2))


def _k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 bytes -> the eight sub-blocks' scales and mins, (n, 8) each, six bits: bytes 0-3 hold
    scales 0-3, 4-7 mins 0-3, 8-11 the low four bits of scales 4-7 and (high nibble) of mins 4-7, whose top two
    bits are the top two of bytes 0-3 and 4-7."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=1)
    return sc, mn


def _k_quant(b: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """Q4_K / Q5_K: (d · sc) · q − dmin · m per sub-block; q (n, 8, 32)."""
    sc, mn = _k_scales(b[:, 4:16])
    d = (_f16(b, 0) * sc.float())[:, :, None]               # (n, 8, 1)
    dm = (_f16(b, 2) * mn.float())[:, :, None]
    return q.float().mul_(d).sub_(dm).view(-1, QK_K)


def _k_nibbles(qs: torch.Tensor) -> torch.Tensor:
    """(n, 128) -> (n, 8, 32): sub-block 2c the low nibbles of bytes 32c.., 2c + 1 their high nibbles."""
    qs = qs.reshape(-1, 4, 1, 32)
    return torch.cat([qs & 0x0F, qs >> 4], dim=2).reshape(-1, 8, 32)


def _q4_k(b: torch.Tensor) -> torch.Tensor:
    return _k_quant(b, _k_nibbles(b[:, 16:]))


def _q5_k(b: torch.Tensor) -> torch.Tensor:
    high = _fields(b[:, 16:48], 1, dim=1)                     # (n, 8, 32): sub-block s takes bit s
    return _k_quant(b, _k_nibbles(b[:, 48:]) | (high << 4))


def _q6_k(b: torch.Tensor) -> torch.Tensor:
    ql = b[:, :128].reshape(-1, 2, 1, 64)
    ql = torch.cat([ql & 0x0F, ql >> 4], dim=2).reshape(-1, 8, 32)
    qh = _fields(b[:, 128:192].reshape(-1, 2, 32), 2, dim=2).reshape(-1, 8, 32)   # (n, 2, 4, 32): 2 bits each
    q = ((ql | (qh << 4)).to(torch.int8) - 32).view(-1, 16, 16)
    d = (_f16(b, 208) * b[:, 192:208].view(torch.int8).float())[:, :, None]     # (n, 16, 1)
    return q.float().mul_(d).view(-1, QK_K)


_KERNELS = {
    "F32": lambda b: b.view(torch.float32), "F16": lambda b: b.view(torch.float16).float(),
    "BF16": lambda b: b.view(torch.bfloat16).float(), "Q8_0": _q8_0, "Q4_0": _q4_0, "Q4_1": _q4_1,
    "Q5_0": _q5_0, "Q5_1": _q5_1, "Q4_K": _q4_k, "Q5_K": _q5_k, "Q6_K": _q6_k,
}


def check_type(type_id: int, name: str, where: str) -> str:
    """A tensor's GGML type id -> its name, or CheckpointError naming the tensor and what is supported."""
    if type_id not in GGML_TYPES:
        raise CheckpointError(f"{where}: tensor {name} has GGML type {OTHER_TYPES.get(type_id, type_id)}, which "
                              f"offspec does not read "
                              f"(supported: {supported()})")
    return GGML_TYPES[type_id].name
