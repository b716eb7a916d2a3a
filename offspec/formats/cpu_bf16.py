"""bfloat16 matmuls on a CPU without bfloat16 instructions: the rows of wide sequences computed in float32.

PyTorch's bfloat16 matmul on a CPU is fast where the CPU has bfloat16 instructions (x86 AVX512_BF16 or AMX-BF16,
Arm's BF16). Without them (AVX2 desktops, Zen 1-3, most laptops) it converts as it goes, and its time grows with
the rows of a call almost in proportion; a float32 matmul does not
(docs/notes/2026-11-29-float32-for-wide-bf16-calls.md). So on such a CPU a call's rows that belong to a
wide sequence (at least WIDE_MIN_ROWS rows in the pass: a prompt, a tree) are computed in float32:

    y = round_bf16( float32(x) @ float32(W).T + float32(bias) ),   W upcast UPCAST_BYTES at a time

a block of W's rows converted at a time, so the float32 copy stays in cache and never holds a whole matrix.
The rows of a narrow sequence (a one-token step) keep the bfloat16 kernel, which is faster there. Like the int8
copies' choice (weights.narrow_rows), it is made per SEQUENCE from its own rows in the pass, so a sequence's numbers
do not depend on what shares its calls. Both compute with float32 sums; they differ only in summation order and
the rounding of the bias, as two bfloat16 kernels may (docs/exactness.md: bfloat16's promise).

$OFFSPEC_CPU_BF16 = "native" (never float32) or "float32" (always, on a CPU in bfloat16) overrides the CPU's flags,
for A/B runs of one engine.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import functools
import logging
import os
from typing import Optional

import torch
import torch.nn.functional as F

log = logging.getLogger("offspec")

WIDE_MIN_ROWS = 4          # a sequence with at least this many rows in a pass computes them in float32
UPCAST_BYTES = 4 << 20     # float32 bytes of W converted at a time
NATIVE_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")   # /proc/cpuinfo flags (x86) / Features (Arm) of bf16 matmuls
CPUINFO = "/proc/cpuinfo"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3            # glibc's mallopt parameters (malloc.h)
HEAP_MMAP_BYTES, HEAP_TRIM_BYTES = 32 << 20, 1 << 30    # blocks under 32 MB come from the heap, which keeps 1 GB


def cpu_info(path: str = CPUINFO) -> dict[str, str]:
    """The first processor's block of /proc/cpuinfo (key -> value); {} where there is none."""
    info: dict[str, str] = {}
    try:
        with open(path) as f:
            for line in f:
                if not line.strip() and info:
                    break
                key, _, value = line.partition(":")
                info.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return info


def cpu_flags(info: dict[str, str]) -> set[str]:
    """The instruction-set flags of a cpu_info block (x86 "flags", Arm "Features")."""
    return set((info.get("flags") or info.get("Features") or "").split())


@functools.lru_cache(maxsize=1)
def native_bf16() -> bool:
    """Whether this CPU has bfloat16 matmul instructions ($OFFSPEC_CPU_BF16 overrides; another value is named
    in one warning line and the flags decide)."""
    forced = os.environ.get("OFFSPEC_CPU_BF16", "").strip().lower()
    if forced in ("native", "float32"):
        return forced == "native"
    if forced:
        log.warning(f"OFFSPEC_CPU_BF16={forced!r} is neither 'native' nor 'float32': ignored, the CPU's flags decide")
    return bool(cpu_flags(cpu_info()) & set(NATIVE_FLAGS))


def wide_in_float32(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether wide sequences' rows compute in float32: bfloat16 on a CPU without bfloat16 instructions."""
    return device.type == "cpu" and dtype == torch.bfloat16 and not native_bf16()


def wide_rows(widths: list[int], device: torch.device, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """The rows of a packed call computed in float32: (N,) bool, N = sum(widths), True for every row of a sequence
    with at least WIDE_MIN_ROWS rows (widths: each sequence's rows, in packing order). None where no row is."""
    if not wide_in_float32(device, dtype) or not any(w >= WIDE_MIN_ROWS for w in widths):
        return None
    keep_heap()
    return torch.cat([torch.full((w,), w >= WIDE_MIN_ROWS, dtype=torch.bool) for w in widths])


def float32_linear(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """x (M, K) @ w (N, K).T (+ bias) computed in float32, w upcast a block of rows at a time -> (M, N) in x's
    dtype, rounded once."""
    xf = x.float()                                                                   # (M, K)
    out = x.new_empty(x.shape[0], w.shape[0])                                        # (M, N)
    step = max(1, UPCAST_BYTES // (4 * w.shape[1]))
    for a in range(0, w.shape[0], step):
        b = None if bias is None else bias[a:a + step].float()
        out[:, a:a + step] = F.linear(xf, w[a:a + step].float(), b)
    return out


@functools.lru_cache(maxsize=1)
def keep_heap() -> bool:
    """Once, where the float32 path runs: glibc hands freed blocks over its mmap threshold, and the heap's free top
    over its trim threshold, back to the system, so every block float32_linear upcasts into would be fresh pages,
    faulted in and zeroed (what that cost: docs/notes/2026-11-29-the-cpu-users-row-measured.md). Raise both
    thresholds (mallopt; the process's peak memory is what it was, freed blocks are reused rather than returned).
    -> whether glibc took them (False elsewhere)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, HEAP_MMAP_BYTES)) and bool(libc.mallopt(M_TRIM_THRESHOLD,
                                                                                            HEAP_TRIM_BYTES))
    except (OSError, AttributeError):
        return False
