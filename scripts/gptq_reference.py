#!/usr/bin/env python3
"""Pin GPTQModel's own dequantization for the tests: tests/data/gptq_reference.safetensors.

GPTQModel (the maintained successor of AutoGPTQ, which transformers loads GPTQ checkpoints with) dequantizes a GPTQ
linear in `BaseQuantLinear.dequantize_weight` (nn_modules/qlinear/__init__.py) and reads AutoGPTQ's v1 checkpoint
format by `convert_gptq_v1_to_v2_format_module` (utils/model.py). The package imports far more than torch, so this
script takes those functions' own source text from its sdist (by name, with ast), runs them on a minimal stand-in
for the module (the attributes they read; the unpacking buffers as `_init_wf_unsqueeze_buffers` builds them for 4 and
8 bits), and writes seeded random pieces (act-order g_idx, 4 and 8 bits, grouped and one group, v1 and v2 zeros)
with the reference's float16 weights. tests/test_published.py checks offspec against them bit for bit.

    pip download --no-deps gptqmodel==7.7.0 -d /tmp/gptq && tar xzf /tmp/gptq/gptqmodel-7.7.0.tar.gz -C /tmp/gptq
    python3 scripts/gptq_reference.py --source /tmp/gptq/gptqmodel-7.7.0/gptqmodel
"""
from __future__ import annotations

import argparse
import ast
import logging
import textwrap
import types
from pathlib import Path

import torch
from safetensors.torch import save_file

OUT = Path(__file__).resolve().parent.parent / "tests" / "data" / "gptq_reference.safetensors"
CASES = [(4, 32, "v1"), (4, 32, "v2"), (8, 64, "v2"), (4, -1, "v1"), (8, 32, "v1")]   # (bits, group size, zeros)
N, K = 64, 256


def functions(path: Path, names: set[str]) -> dict[str, str]:
    """The source of each named function (or method) in the file."""
    tree = ast.parse(path.read_text())
    source = path.read_text()
    found = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in names:
            found[node.name] = ast.get_source_segment(source, node)
    missing = names - set(found)
    if missing:
        raise SystemExit(f"{path}: no {', '.join(sorted(missing))}")
    return found


def reference(source: Path):
    qlinear = functions(source / "nn_modules" / "qlinear" / "__init__.py",
                        {"dequantize_weight", "_dequantize_from_codes", "_torch_right_shift"})
    convert = functions(source / "utils" / "model.py", {"convert_gptq_v1_to_v2_format_module"})
    namespace = {"t": torch, "torch": torch, "nn": torch.nn, "BaseQuantLinear": object,
                 "log": types.SimpleNamespace(info=types.SimpleNamespace(once=logging.info))}
    for text in (qlinear["_torch_right_shift"], convert["convert_gptq_v1_to_v2_format_module"]):
        exec(compile(text, str(source), "exec"), namespace)
    methods = {}
    for name in ("dequantize_weight", "_dequantize_from_codes"):
        exec(compile(textwrap.dedent(qlinear[name]), str(source), "exec"), namespace)
        methods[name] = namespace[name]
    return namespace, methods


def module(bits: int, qweight, qzeros, scales, g_idx, methods):
    """The attributes dequantize_weight reads, and the unpacking buffers _init_wf_unsqueeze_buffers makes."""
    m = types.SimpleNamespace(planar=False, bits=bits, pack_factor=32 // bits, maxq=2 ** bits - 1,
                              dequant_dtype=torch.int16 if bits == 8 else torch.int8, in_features=K,
                              qweight=qweight, qzeros=qzeros, scales=scales, g_idx=g_idx)
    wf = torch.tensor(list(range(0, 32, bits)), dtype=torch.int32).unsqueeze(0)
    m.wf_unsqueeze_zero, m.wf_unsqueeze_neg_one = wf.unsqueeze(0), wf.unsqueeze(-1)
    m._init_wf_unsqueeze_buffers = lambda: None
    m.qzero_format = lambda format: None            # (the v1 -> v2 conversion records the format it made)
    m._dequantize_from_codes = types.MethodType(methods["_dequantize_from_codes"], m)
    m.dequantize_weight = types.MethodType(methods["dequantize_weight"], m)
    return m


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--source", required=True, help="GPTQModel's package folder (…/gptqmodel-7.7.0/gptqmodel)")
    parser.add_argument("--out", default=str(OUT))
    args = parser.parse_args()
    namespace, methods = reference(Path(args.source))
    g = torch.Generator().manual_seed(0)
    tensors = {}
    for bits, group, zeros in CASES:
        P = 32 // bits
        groups = K // group if group > 0 else 1
        words = lambda *shape: torch.randint(-2**31, 2**31 - 1, shape, generator=g, dtype=torch.int64  # noqa: E731
                                             ).to(torch.int32)
        qweight, qzeros = words(K // P, N), words(groups, N // P)
        scales = (torch.rand(groups, N, generator=g) * 0.02 + 1e-3).to(torch.float16)
        order = torch.randperm(K, generator=g)                                     # act-order: rows' groups shuffled
        g_idx = torch.empty(K, dtype=torch.int32)
        g_idx[order] = (torch.arange(K) // (group if group > 0 else K)).to(torch.int32)
        m = module(bits, qweight, qzeros.clone(), scales, g_idx, methods)
        if zeros == "v1":
            namespace["convert_gptq_v1_to_v2_format_module"](m, bits, torch.int32)   # adds one to every zero field
        weight = m.dequantize_weight()                                              # (K, N) float16
        key = f"b{bits}_g{max(group, 0)}_{zeros}"
        tensors.update({f"{key}.qweight": qweight, f"{key}.qzeros": qzeros, f"{key}.scales": scales,
                        f"{key}.g_idx": g_idx, f"{key}.weight": weight.t().contiguous()})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, args.out, metadata={"source": "gptqmodel 7.7.0 BaseQuantLinear.dequantize_weight, "
                                                     "convert_gptq_v1_to_v2_format_module"})
    print(f"wrote {args.out}: {', '.join(f'{b}-bit g{gr} {z}' for b, gr, z in CASES)}")


if __name__ == "__main__":
    main()
