#!/usr/bin/env python
"""Milliseconds per scaled_dot_product_attention call as offspec's attend makes them (a boolean tree mask, GQA),
per SDPA backend, dtype and head shape, with the key length changing every call (a tree pass after a growing
prefix: every call a new shape) or fixed (the same shape repeated). Answers: which backend does PyTorch pick for
these calls on this GPU, and what does a new shape cost it.

  python scripts/devtools/sdpa_backends.py --device cuda --json OUT.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))   # offspec
from offspec.model.forward import SDPA_BACKENDS  # noqa: E402

HEADS = {"tiny": (4, 2, 16), "70B": (64, 8, 128)}     # (query heads, KV heads, head dim)
BACKENDS = {"default": None, "no-cudnn": SDPA_BACKENDS,   # offspec's own choice (model.attend)
            "cudnn": [SDPBackend.CUDNN_ATTENTION], "efficient": [SDPBackend.EFFICIENT_ATTENTION],
            "math": [SDPBackend.MATH]}


def call(H: int, Hk: int, hd: int, t: int, S: int, dtype, device) -> None:
    q = torch.randn(1, H, t, hd, dtype=dtype, device=device)
    k, v = (torch.randn(1, Hk, S, hd, dtype=dtype, device=device) for _ in range(2))
    mask = torch.ones(t, S, dtype=torch.bool, device=device).tril(S - t)
    F.scaled_dot_product_attention(q, k, v, attn_mask=mask[None, None], enable_gqa=H != Hk)


def ms_per_call(backend, shapes, H, Hk, hd, dtype, device) -> float:
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    ctx = sdpa_kernel(backend) if backend else contextlib.nullcontext()
    with ctx, torch.no_grad():
        call(H, Hk, hd, *shapes[0], dtype, device)                 # warm-up: the first shape only
        sync()
        start = time.perf_counter()
        for t, S in shapes:
            call(H, Hk, hd, t, S, dtype, device)
        sync()
    return 1e3 * (time.perf_counter() - start) / len(shapes)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--calls", type=int, default=40)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    device, rows = torch.device(args.device), []
    changing = [(t, 200 + 7 * i) for i in range(args.calls) for t in (1, 33)]
    fixed = [(33, 300)] * (2 * args.calls)
    for heads, (H, Hk, hd) in HEADS.items():
        for dtype in (torch.bfloat16, torch.float32):
            for name, backend in BACKENDS.items():
                for shapes_name, shapes in (("changing", changing), ("fixed", fixed)):
                    try:
                        ms = round(ms_per_call(backend, shapes, H, Hk, hd, dtype, device), 3)
                    except RuntimeError as err:
                        ms = f"refused: {str(err).splitlines()[0][:80]}"
                    rows.append({"heads": heads, "dtype": str(dtype)[6:], "backend": name, "shapes": shapes_name,
                                 "ms_per_call": ms})
                    print(rows[-1], flush=True)
                    if args.json:
                        with open(args.json, "w") as f:
                            json.dump({"torch": torch.__version__, "device": torch.cuda.get_device_name()
                                       if device.type == "cuda" else "cpu", "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
