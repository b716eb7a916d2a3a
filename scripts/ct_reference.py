#!/usr/bin/env python3
"""Pin compressed-tensors' own decompression for the tests: tests/data/ct_reference.safetensors.

compressed-tensors (the format llm-compressor publishes, which transformers and vLLM load) keeps an int4 or int8
weight-only linear as `pack-quantized`: weight_packed (values packed along the input), weight_scale, and for
asymmetric schemes weight_zero_point (packed along the output). This script packs seeded random values with the
package's own `pack_to_int32` and decompresses them with its own `PackedQuantizationCompressor.decompress`, for
4 and 8 bits, grouped and per channel, symmetric and not, with bfloat16 and float16 scales, and writes the pieces
with the reference's weights. tests/test_published.py checks offspec against them bit for bit.

The package needs pydantic and loguru besides torch; a throwaway environment does:

    python3 -m venv --system-site-packages /tmp/ct
    /tmp/ct/bin/pip install --no-deps compressed-tensors==0.20.0 loguru
    /tmp/ct/bin/python scripts/ct_reference.py
"""
from __future__ import annotations

import argparse
from pathlib import Path

import torch
from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "ct_reference.safetensors"
CASES = [(4, 32, True, torch.bfloat16), (4, 32, False, torch.bfloat16), (8, 64, True, torch.float16),
         (4, 0, True, torch.float16), (8, 32, False, torch.bfloat16)]     # (bits, group (0: per channel), sym, scale)
N, K = 64, 256
SCALE_NAMES = {torch.bfloat16: "bf16", torch.float16: "f16"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for bits, group, symmetric, scale_dtype in CASES:
        strategy = dict(strategy="group", group_size=group) if group else dict(strategy="channel")
        scheme = QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
            num_bits=bits, type="int", symmetric=symmetric, **strategy))
        groups = K // group if group else 1
        lo, hi = -2 ** (bits - 1), 2 ** (bits - 1)
        values = torch.randint(lo, hi, (N, K), generator=g, dtype=torch.int64).to(torch.int8)
        scale = (torch.rand(N, groups, generator=g) * 0.02 + 1e-3).to(scale_dtype)
        state = {"weight_packed": pack_to_int32(values, bits), "weight_scale": scale,
                 "weight_shape": torch.tensor([N, K])}
        if not symmetric:
            zero = torch.randint(lo, hi, (N, groups), generator=g, dtype=torch.int64).to(torch.int8)
            state["weight_zero_point"] = pack_to_int32(zero, bits, packed_dim=0).contiguous()
        weight = PackedQuantizationCompressor.decompress(dict(state), scheme)["weight"]     # (N, K)
        key = f"b{bits}_g{group}_{'sym' if symmetric else 'asym'}_{SCALE_NAMES[scale_dtype]}"
        tensors.update({f"{key}.{name}": t for name, t in state.items() if name != "weight_shape"})
        tensors[f"{key}.weight"] = weight.contiguous()
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, args.out, metadata={"source": "compressed-tensors 0.20.0 PackedQuantizationCompressor"})
    print(f"wrote {args.out}: {len(CASES)} cases")


if __name__ == "__main__":
    main()
