#!/usr/bin/env python3
"""Pin AutoAWQ's own dequantization for the tests: tests/data/awq_reference.safetensors.

AutoAWQ is the AWQ format's reference implementation. Its `awq.utils.packing_utils.dequantize_gemm` turns the
published pieces (qweight, qzeros, scales) into the float16 weight. This script feeds it seeded random pieces of a
few shapes and group sizes (every nibble value, both packings' orders exercised), and writes the pieces with
the reference's output. tests/test_published.py checks offspec's dequantization against that file bit for bit, so
CI needs no AutoAWQ.

AutoAWQ's package pulls CUDA builds on install; the one file read here needs only torch, so it is loaded by path:

    pip download --no-deps autoawq==0.2.9 -d /tmp/awq && tar xzf /tmp/awq/autoawq-0.2.9.tar.gz -C /tmp/awq
    python3 scripts/awq_reference.py --packing-utils /tmp/awq/autoawq-0.2.9/awq/utils/packing_utils.py
"""
from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "awq_reference.safetensors"
CASES = [(64, 256, 32), (48, 256, 128), (128, 128, 64)]      # (N out, K in, group size)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--packing-utils", required=True, help="path to AutoAWQ's awq/utils/packing_utils.py")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    spec = importlib.util.spec_from_file_location("awq_packing_utils", args.packing_utils)
    reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(reference)
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for N, K, G in CASES:
        def words(rows: int) -> torch.Tensor:
            return torch.randint(-2**31, 2**31 - 1, (rows, N // 8), generator=g, dtype=torch.int64).to(torch.int32)
        qweight, qzeros = words(K), words(K // G)
        scales = (torch.rand(K // G, N, generator=g) * 0.02 + 1e-3).to(torch.float16)
        weight = reference.dequantize_gemm(qweight, qzeros, scales, 4, G)            # (K, N) float16
        key = f"n{N}_k{K}_g{G}"
        tensors.update({f"{key}.qweight": qweight, f"{key}.qzeros": qzeros, f"{key}.scales": scales,
                        f"{key}.weight": weight.t().contiguous()})                  # (N, K), as offspec stores W
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, args.out, metadata={"source": "autoawq 0.2.9 awq.utils.packing_utils.dequantize_gemm"})
    print(f"wrote {args.out}: {', '.join(f'{n}x{k} g{gs}' for n, k, gs in CASES)}")


if __name__ == "__main__":
    main()
