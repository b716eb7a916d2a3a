"""The fused dequantization kernels in Triton: one program a tile of the output, each weight computed from its
packed pieces in one pass, bit for bit the torch transcriptions (published.py, gguf_blocks.py, quant.py).

Every kernel writes out[n, k] of an (N, K) row-major output tile [BN, BK]; program (i, j) covers rows
i·BN .. and columns j·BK ... Every element finds its own word, byte and shift (the neighbours' loads of one word
hit the cache), so one kernel serves every group size, act-order and odd shape.

Exactness. The transcriptions compute in float16 (AWQ, GPTQ), the scale dtype (compressed-tensors) or float32
(GGUF, int8 in the compute dtype). A product of two float16 (or bfloat16, or an 8-bit integer and either) is
exact in float32, so each kernel computes in float32 and rounds once, to nearest even, to the dtype the
transcription rounds to: the same value. The rounding to bfloat16 is done on the bits (_bf16_round), since
Triton's interpreter truncates where the GPU rounds. float32 sums and products are launched with
enable_fp_fusion=False, so no multiply-add is fused into one rounding the torch path does not make.

OUT (the output's kind): 0 float32, 1 float16, 2 bfloat16 (written as its uint16 bits).
"""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _bf16_round(x):
    """float32 x (finite) -> the float32 value of x rounded to the nearest bfloat16, ties to even."""
    b = x.to(tl.uint32, bitcast=True)
    b = (b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000
    return b.to(tl.float32, bitcast=True)


@triton.jit
def _round_to(x, KIND: tl.constexpr):
    """float32 x -> x rounded to a dtype's precision (0 float32, 1 float16, 2 bfloat16), as float32."""
    if KIND == 1:
        x = x.to(tl.float16).to(tl.float32)
    elif KIND == 2:
        x = _bf16_round(x)
    return x


@triton.jit
def _store(out, offs, x, mask, OUT: tl.constexpr):
    """out[offs] <- float32 x rounded to the output's dtype (OUT)."""
    if OUT == 0:
        tl.store(out + offs, x, mask=mask)
    elif OUT == 1:
        tl.store(out + offs, x.to(tl.float16), mask=mask)
    else:
        tl.store(out + offs, (_bf16_round(x).to(tl.uint32, bitcast=True) >> 16).to(tl.uint16), mask=mask)


@triton.jit
def _tile(N, K, BN: tl.constexpr, BK: tl.constexpr):
    """This program's rows n (BN, 1) and columns k (1, BK) of the output, and which of them exist."""
    n = tl.program_id(0) * BN + tl.arange(0, BN)[:, None]
    k = tl.program_id(1) * BK + tl.arange(0, BK)[None, :]
    return n, k, (n < N) & (k < K)


@triton.jit
def awq_kernel(qweight, qzeros, scales, out, N, K, G, OUT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """AWQ: W[n, k] = (q[k, n] - z[k // G, n]) * s[k // G, n] in float16; nibble i of word c holds column
    8c + AWQ_ORDER[i], so column n is nibble (o >> 1) + 4 (o & 1) of word n // 8, o = n % 8."""
    n, k, m = _tile(N, K, BN, BK)
    o = n % 8
    shift = 4 * ((o >> 1) + 4 * (o & 1))
    g = k // G
    q = (tl.load(qweight + k * (N // 8) + n // 8, mask=m, other=0) >> shift) & 0xF
    z = (tl.load(qzeros + g * (N // 8) + n // 8, mask=m, other=0) >> shift) & 0xF
    s = tl.load(scales + g * N + n, mask=m, other=0).to(tl.float32)
    _store(out, n.to(tl.int64) * K + k, _round_to((q - z).to(tl.float32) * s, 1), m, OUT)


@triton.jit
def gptq_kernel(qweight, qzeros, scales, g_idx, out, N, K, BITS: tl.constexpr, OUT: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr):
    """GPTQ: W[n, k] = (q[k, n] - z[g, n]) * s[g, n] in float16, g = g_idx[k]; q in bits BITS·(k % P) of
    qweight[k // P, n], z in bits BITS·(n % P) of qzeros[g, n // P] (v2 zeros: the launcher adds v1's ones)."""
    P: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    n, k, m = _tile(N, K, BN, BK)
    g = tl.load(g_idx + k, mask=k < K, other=0)
    q = (tl.load(qweight + (k // P) * N + n, mask=m, other=0) >> (BITS * (k % P))) & MASK
    z = (tl.load(qzeros + g * (N // P) + n // P, mask=m, other=0) >> (BITS * (n % P))) & MASK
    s = tl.load(scales + g * N + n, mask=m, other=0).to(tl.float32)
    _store(out, n.to(tl.int64) * K + k, _round_to((q - z).to(tl.float32) * s, 1), m, OUT)


@triton.jit
def ct_kernel(packed, scales, zeros, out, N, K, G, BITS: tl.constexpr, ASYM: tl.constexpr, SCALE: tl.constexpr,
              OUT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """compressed-tensors: W[n, k] = (v[n, k] - z[n, k // G]) * s[n, k // G] in the scale's dtype (SCALE, as OUT);
    v + 2^(BITS-1) in bits BITS·(k % P) of packed[n, k // P], z + 2^(BITS-1) in bits BITS·(n % P) of
    zeros[n // P, k // G] (asymmetric only)."""
    P: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    OFFSET: tl.constexpr = 1 << (BITS - 1)
    n, k, m = _tile(N, K, BN, BK)
    groups = K // G
    g = k // G
    v = ((tl.load(packed + n * (K // P) + k // P, mask=m, other=0) >> (BITS * (k % P))) & MASK) - OFFSET
    if ASYM:
        z = ((tl.load(zeros + (n // P) * groups + g, mask=m, other=0) >> (BITS * (n % P))) & MASK) - OFFSET
        v = v - z
    s = tl.load(scales + n * groups + g, mask=m, other=0).to(tl.float32)
    _store(out, n.to(tl.int64) * K + k, _round_to(v.to(tl.float32) * s, SCALE), m, OUT)


@triton.jit
def int8_kernel(q, scale, out, N, K, SCALE: tl.constexpr, OUT: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr):
    """The int8 target: W[n, k] = q[n, k] * s[n] in the compute dtype (SCALE, as OUT)."""
    n, k, m = _tile(N, K, BN, BK)
    offs = n.to(tl.int64) * K + k
    x = tl.load(q + offs, mask=m, other=0).to(tl.float32) * tl.load(scale + n, mask=n < N, other=0).to(tl.float32)
    _store(out, offs, _round_to(x, SCALE), m, OUT)


# ---------------------------------------------------------------- GGUF

@triton.jit
def _f16_at(raw16, byte):
    """The float16 at an even byte offset of the blocks (raw16: the same bytes as int16), as float32."""
    return tl.load(raw16 + byte // 2).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _byte(raw, at):
    return tl.load(raw + at).to(tl.int32)


@triton.jit
def _k_scale_min(raw, at, s):
    """Q4_K / Q5_K: sub-block s's six-bit scale and min from the 12 bytes at `at` (gguf_blocks._k_scales)."""
    lo = s < 4
    a = _byte(raw, at + tl.where(lo, s, s + 4))        # s < 4: scales[s]; else the low/high nibbles' byte
    b = _byte(raw, at + tl.where(lo, s + 4, s - 4))    # s < 4: mins[s]; else the scale's top-bits byte
    c = _byte(raw, at + s)                             # s >= 4: the min's top-bits byte
    sc = tl.where(lo, a & 0x3F, (a & 0x0F) | ((b >> 2) & 0x30))
    mn = tl.where(lo, b & 0x3F, (a >> 4) | ((c >> 2) & 0x30))
    return sc, mn


@triton.jit
def gguf_kernel(raw, raw16, out, N, K, ROW, TYPE: tl.constexpr, B: tl.constexpr, SIZE: tl.constexpr,
                OUT: tl.constexpr, BN: tl.constexpr, NB: tl.constexpr):
    """One GGML type's blocks (gguf_blocks' docstring and formulas). Program (i, j) covers rows i·BN .. and, of
    each, blocks j·NB ..; row n's block b starts at byte n·ROW + b·SIZE. A tile is (rows, blocks, sub-blocks,
    weights of a sub-block), so each block's and sub-block's scales are loaded once, not once a weight.
    TYPE: 0 F32, 1 F16, 2 BF16, 3 Q8_0, 4 Q4_0, 5 Q4_1, 6 Q5_0, 7 Q5_1, 8 Q4_K, 9 Q5_K, 10 Q6_K."""
    SUBS: tl.constexpr = 16 if TYPE == 10 else (8 if TYPE >= 8 else 1)    # sub-blocks of a block
    L: tl.constexpr = B // SUBS                                          # weights of a sub-block
    n = tl.program_id(0) * BN + tl.arange(0, BN)[:, None, None, None]    # (BN, 1, 1, 1)
    b = tl.program_id(1) * NB + tl.arange(0, NB)[None, :, None, None]    # (1, NB, 1, 1)
    s = tl.arange(0, SUBS)[None, None, :, None]                          # (1, 1, SUBS, 1)
    j = s * L + tl.arange(0, L)[None, None, None, :]                     # (1, 1, SUBS, L) weight of the block
    m = (n < N) & (b < K // B)
    at = tl.where(m, n.to(tl.int64) * ROW + b * SIZE, 0)   # the block's first byte (masked: block 0, dropped)
    if TYPE == 0:
        w = tl.load(raw16 + at // 2 + 1).to(tl.int32).to(tl.uint32) << 16
        w = (w | tl.load(raw16 + at // 2).to(tl.int32).to(tl.uint32) & 0xFFFF).to(tl.float32, bitcast=True)
    elif TYPE == 1:
        w = _f16_at(raw16, at)
    elif TYPE == 2:
        w = (tl.load(raw16 + at // 2).to(tl.int32) << 16).to(tl.float32, bitcast=True)
    elif TYPE == 3:                                                       # Q8_0: q · d
        w = tl.load(raw + at + 2 + j).to(tl.int8, bitcast=True).to(tl.float32) * _f16_at(raw16, at)
    elif TYPE <= 7:                                                       # Q4_0 Q4_1 Q5_0 Q5_1
        QS: tl.constexpr = 2 if TYPE == 4 else (4 if TYPE == 5 else (6 if TYPE == 6 else 8))
        q = (_byte(raw, at + QS + j % 16) >> (4 * (j // 16))) & 0x0F
        if TYPE >= 6:                                                     # the fifth bit: bit j of qh
            q = q | (((_byte(raw, at + QS - 4 + j // 8) >> (j % 8)) & 1) << 4)
        d = _f16_at(raw16, at)
        if TYPE == 4:
            w = (q - 8).to(tl.float32) * d
        elif TYPE == 6:
            w = (q - 16).to(tl.float32) * d
        else:
            w = q.to(tl.float32) * d + _f16_at(raw16, at + 2)
    elif TYPE <= 9:                                                       # Q4_K Q5_K: (d·sc)·q − dmin·m
        QS: tl.constexpr = 16 if TYPE == 8 else 48
        l = j % 32
        q = (_byte(raw, at + QS + 32 * (s // 2) + l) >> (4 * (s % 2))) & 0x0F
        if TYPE == 9:
            q = q | (((_byte(raw, at + 16 + l) >> s) & 1) << 4)
        sc, mn = _k_scale_min(raw, at + 4, s)                             # (BN, NB, 8, 1)
        w = q.to(tl.float32) * (_f16_at(raw16, at) * sc.to(tl.float32)) \
            - _f16_at(raw16, at + 2) * mn.to(tl.float32)
    else:                                                                 # Q6_K: (d·sc)·(q − 32)
        h = j // 128
        r = j % 128
        lo = (_byte(raw, at + 64 * h + r % 64) >> (4 * (r // 64))) & 0x0F
        hi = (_byte(raw, at + 128 + 32 * h + r % 32) >> (2 * (r // 32))) & 3
        sc = tl.load(raw + at + 192 + s).to(tl.int8, bitcast=True).to(tl.float32)    # (BN, NB, 16, 1)
        w = ((lo | (hi << 4)) - 32).to(tl.float32) * (_f16_at(raw16, at + 208) * sc)
    _store(out, n.to(tl.int64) * K + b * B + j, w, m & (j < B), OUT)
