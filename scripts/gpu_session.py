#!/usr/bin/env python
"""One command for a GPU lent for minutes: the first-GPU checklist, then a 70B-shaped pass, every result
written under OUT as it comes (a kill at the time limit still leaves what was measured).

Parts, in order, each in its own process with its own time limit (a hang or a crash ends that part alone):
  check    scripts/gpu_check.py --quick --out OUT/gpu_check.json (its log in OUT/gpu_check.log)
  pass70b  random bf16 decoder layers of Llama-3.1-70B's shape (hidden 8192, intermediate 28672, 64 heads,
           8 KV heads; 1.71 GB a layer), as many as --layers (at least 16), first all resident (compute of a
           pass at each width), then all streamed from the pinned host arena through the ring's slots: per
           width (1, 64, 256, 1024 tree tokens after a --context prefix) the pass, the copies' own time, the
           compute stall, the host->device GB/s, overlap efficiency = max(transfer, compute) / pass, and the
           streamed logits against the resident ones (bitwise)
  drafts   one call of a 1B-shaped (Llama-3.2-1B) and an 8B-shaped (Llama-3.1-8B) draft, resident, at the
           same widths, after the same prefix
  dequant  the dequantization of one 70B layer on the GPU, for every layer format offspec streams: int8 and nf4
           (nf4 where bitsandbytes imports), and the published ones read as they are: AWQ g128, GPTQ 4-bit g128,
           compressed-tensors int4 g128 and GGUF Q4_K_M (Q4_K, Q6_K for v and down; random blocks); the block's
           bytes against the dense layer's (costmodel.dequant_s_per_gb takes these). The published ones also at
           larger chunks than offspec's (CHUNKS), with the host's time to issue a call beside the device's: where
           they are close, per-kernel dispatch sets the pace
OUT/gpu_70b.json holds the parts' results (rewritten after every row); OUT/gpu_70b.md renders them.

Examples:
  PYTHONUNBUFFERED=1 python3 scripts/gpu_session.py --out $OUT           # ~3.5 min on an H100
  python scripts/gpu_session.py --tiny --device cpu --out /tmp/s         # a smoke test of the code, any machine

nf4 (the dequant part, and the nf4 GPU tests of the check) needs bitsandbytes, which a machine with no package
registry lacks: carry it, e.g. its manylinux wheel unzipped into a git-ignored folder of the checkout with only
the libbitsandbytes_cuda1*.so matching the machine's CUDA kept (about 8 MB), that folder on PYTHONPATH. Without
it those are skipped, with the reason. $OFFSPEC_COMMIT names the commit where the copied tree has no .git.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

import _common  # noqa: E402
from bench_stream import forward_at, make_inputs, prefill  # noqa: E402
from gpu_check import measure_overlap, random_globals, random_layers, write_text  # noqa: E402

from offspec.config import ModelConfig, OffloadConfig  # noqa: E402
from offspec.engine.load import open_target_layers  # noqa: E402
from offspec.engine.metrics import Timer  # noqa: E402
from offspec.model.forward import Model  # noqa: E402
from offspec.plan.placement import LayerPlan  # noqa: E402
from offspec.plan.sizes import layer_nbytes  # noqa: E402

PARTS = ("check", "pass70b", "drafts", "dequant")
CHUNKS = (None, 1 << 24, 1 << 26)   # the published formats' dequantization, timed at offspec's chunk and larger ones
PART_LIMIT_S = {"check": 260, "pass70b": 150, "drafts": 60, "dequant": 90}   # 560 s in all
WIDTHS = (1, 64, 256, 1024)

LLAMA_70B = ModelConfig(arch="llama", vocab_size=128256, hidden_size=8192, intermediate_size=28672, n_layers=16,
                        n_heads=64, n_kv_heads=8, head_dim=128, rms_norm_eps=1e-5)
DRAFTS = {
    "1B": ModelConfig(arch="llama", vocab_size=128256, hidden_size=2048, intermediate_size=8192, n_layers=16,
                      n_heads=32, n_kv_heads=8, head_dim=64, rms_norm_eps=1e-5),
    "8B": ModelConfig(arch="llama", vocab_size=128256, hidden_size=4096, intermediate_size=14336, n_layers=32,
                      n_heads=32, n_kv_heads=8, head_dim=128, rms_norm_eps=1e-5),
}
# --tiny: the same code on shapes a CPU runs in seconds (a smoke test; its figures mean nothing)
TINY = dict(vocab_size=512, hidden_size=256, intermediate_size=512, n_heads=4, n_kv_heads=2, head_dim=64)   # (K-quant rows)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--out", required=True, help="folder for every result file")
    p.add_argument("--parts", default=",".join(PARTS), help="comma separated, in order: " + ", ".join(PARTS))
    p.add_argument("--layers", type=int, default=16, help="70B-shaped layers streamed (1.71 GB each, pinned)")
    p.add_argument("--slots", type=int, default=2, help="ring slots for the streamed pass")
    p.add_argument("--context", type=int, default=256, help="tokens in the cache before each timed pass")
    p.add_argument("--passes", type=int, default=3, help="timed passes per width (after one warm-up)")
    p.add_argument("--device", default="cuda")
    p.add_argument("--tiny", action="store_true", help="tiny shapes: check the code on a CPU")
    p.add_argument("--part", default=None, help=argparse.SUPPRESS)   # the child process's one part
    args = p.parse_args(argv)
    args.parts = [s.strip() for s in args.parts.split(",") if s.strip()]
    if unknown := [s for s in args.parts if s not in PARTS]:
        p.error(f"--parts: unknown {', '.join(unknown)}")
    args.out = Path(args.out)
    return args


def shape(cfg: ModelConfig, args, n_layers: int | None = None) -> ModelConfig:
    cfg = dataclasses.replace(cfg, **TINY) if args.tiny else cfg
    return dataclasses.replace(cfg, n_layers=n_layers) if n_layers else cfg


# ---------------------------------------------------------------- results, written as they come

class Results:
    """OUT/gpu_70b.json: {part: {...}}; every update rewrites it (and the markdown) atomically."""

    def __init__(self, out: Path):
        self.path = out / "gpu_70b.json"
        self.data = json.loads(self.path.read_text()) if self.path.exists() else {}

    def update(self, part: str, **fields) -> None:
        self.data.setdefault(part, {}).update(fields)
        write_text(self.path, json.dumps(self.data, indent=2) + "\n")
        write_text(self.path.with_suffix(".md"), render(self.data))

    def add_row(self, part: str, row: dict) -> None:
        self.update(part, rows=[*self.data.get(part, {}).get("rows", []), row])


# ---------------------------------------------------------------- the parts (run in a child process)

def pass70b_part(args, device: torch.device, results: Results) -> None:
    cfg = shape(LLAMA_70B, args, args.layers)
    layer_bytes = layer_nbytes(cfg, torch.bfloat16)
    results.update("pass70b", model=dataclasses.asdict(cfg), layer_bytes=layer_bytes, slots=args.slots,
                   context=args.context, passes=args.passes, widths=list(WIDTHS))
    out = measure_overlap(device, cfg, torch.bfloat16, n_slots=args.slots, tokens=list(WIDTHS),
                          passes=args.passes, context=args.context)
    for r in out["rows"]:
        r["compute_per_layer_s"] = r["compute_s"] / cfg.n_layers
        r["transfer_per_layer_s"] = r["transfer_s"] / out["streamed_layers"]
    results.update("pass70b", streamed_layers=out["streamed_layers"], host=out["host"], rows=out["rows"])


def drafts_part(args, device: torch.device, results: Results) -> None:
    for name, base in DRAFTS.items():
        cfg = shape(base, args)
        model = Model(cfg, random_globals(cfg, device, torch.bfloat16),
                      open_target_layers(random_layers(cfg, device, torch.bfloat16), cfg,
                                         LayerPlan.of(cfg, OffloadConfig(mode="none"), torch.bfloat16), device,
                                         torch.bfloat16, progress=False))
        inputs = make_inputs(cfg.vocab_size, args.context, list(WIDTHS), device)
        cache = prefill(model, inputs, args.context + max(WIDTHS))
        for T in WIDTHS:
            forward_at(model, cache, args.context, inputs.new[T])                       # warm-up
            with Timer(device) as timer:
                for _ in range(args.passes):
                    forward_at(model, cache, args.context, inputs.new[T])
            results.add_row("drafts", {"draft": name, "tokens": T, "call_s": timer.seconds / args.passes,
                                       "layers": cfg.n_layers, "hidden": cfg.hidden_size})
        del model, cache
        if device.type == "cuda":
            torch.cuda.empty_cache()


def dequant_quants(cfg: ModelConfig) -> tuple[str, ...]:
    """The layer formats timed: offspec's own, and the published ones at the group size the shape divides into
    (128 for the 70B; a --tiny shape's is smaller), GGUF where rows are whole 256-weight K-quant blocks."""
    group = next(g for g in (128, 32, 16, 8) if cfg.hidden_size % g == 0 and cfg.intermediate_size % g == 0)
    gguf = ("gguf:q4_k,q4_k,q6_k,q4_k,q4_k,q4_k,q6_k",) if cfg.hidden_size % 256 == 0 == cfg.intermediate_size % 256 \
        else ()
    return ("int8", "nf4", f"awq-g{group}", f"gptq-b4-g{group}-v2", f"ct-b4-g{group}-bf16") + gguf


@contextlib.contextmanager
def chunk_elements(n: Optional[int]):
    """The published and GGUF formats dequantize `n` weights a chunk on a GPU (None: as offspec does)."""
    from offspec.formats import gguf_blocks, published
    before = published.DEQUANT_ELEMENTS, dict(gguf_blocks.DEQUANT_ELEMENTS)
    if n is not None:
        published.DEQUANT_ELEMENTS, gguf_blocks.DEQUANT_ELEMENTS["cuda"] = n, n
    try:
        yield
    finally:
        published.DEQUANT_ELEMENTS, gguf_blocks.DEQUANT_ELEMENTS = before


def time_dequant(layout, block: torch.Tensor, dense: torch.Tensor, device: torch.device, calls: int) -> dict:
    """Seconds a call on the device (Timer) and to issue it from the host (before the device finishes): where
    the two are close, the host's per-kernel dispatch sets the pace, not the device."""
    layout.dequantize(block, dense)                                               # warm-up
    with Timer(device) as timer:
        start = time.perf_counter()
        for _ in range(calls):
            layout.dequantize(block, dense)
        issued = time.perf_counter() - start
    return {"seconds": timer.seconds / calls, "issue_seconds": issued / calls}


def dequant_part(args, device: torch.device, results: Results) -> None:
    from offspec.errors import InputError
    from offspec.formats.published import is_published, short
    from offspec.formats.quant import QuantizedLayout
    cfg = shape(LLAMA_70B, args, 1)
    weights = random_layers(cfg, device, torch.bfloat16)(0)
    for quant in dequant_quants(cfg):
        try:
            layout = QuantizedLayout.of(cfg, torch.bfloat16, quant)
            block = torch.empty(layout.nbytes, dtype=torch.uint8, device=device)     # (nbytes,) the moved block
            if quant.startswith("gguf:"):          # GGML blocks, random (timing only: the values do not matter)
                block.copy_(torch.randint(0, 256, (layout.nbytes,), dtype=torch.uint8, device=device))
            else:
                layout.pack(weights, block)
        except InputError as err:                  # nf4 without bitsandbytes
            results.add_row("dequant", {"quant": quant, "skipped": str(err)})
            continue
        chunks = CHUNKS if is_published(quant) else (None,)
        quant = short(quant) if is_published(quant) else quant
        dense = torch.empty(layout.dense.nbytes, dtype=torch.uint8, device=device)   # (dense nbytes,)
        for chunk in chunks:
            with chunk_elements(chunk):
                timed = time_dequant(layout, block, dense, device, args.passes * 3)
            results.add_row("dequant", {"quant": quant, **timed, "chunk": chunk, "block_bytes": layout.nbytes,
                                        "dense_bytes": layout.dense.nbytes})
        del block, dense


PART_FNS = {"pass70b": pass70b_part, "drafts": drafts_part, "dequant": dequant_part}


def child(args) -> int:
    results = Results(args.out)
    device = torch.device(args.device)
    started = time.perf_counter()
    results.update(args.part, status="running")
    try:
        PART_FNS[args.part](args, device, results)
        results.update(args.part, status="passed", seconds=round(time.perf_counter() - started, 1))
        return 0
    except Exception as err:
        results.update(args.part, status="failed", error=f"{type(err).__name__}: {err}",
                       traceback=traceback.format_exc(limit=8).splitlines()[-10:],
                       seconds=round(time.perf_counter() - started, 1))
        return 1


# ---------------------------------------------------------------- the parent: one process per part

def run_part(part: str, args, argv: list[str]) -> None:
    if part == "check":
        command = [sys.executable, str(REPO / "scripts" / "gpu_check.py"), "--quick", "--out",
                   str(args.out / "gpu_check.json")]
        log = args.out / "gpu_check.log"
    else:
        command = [sys.executable, __file__, *argv, "--part", part]
        log = args.out / "gpu_70b.log"
    print(f"[{part}] running (limit {PART_LIMIT_S[part]} s)", flush=True)
    start = time.perf_counter()
    with open(log, "a") as sink:
        try:
            rc = subprocess.run(command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT,
                                timeout=PART_LIMIT_S[part]).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
    seconds = time.perf_counter() - start
    if part != "check" and rc == "timeout":
        Results(args.out).update(part, status="timeout", seconds=round(seconds, 1))
    print(f"[{part}] exit {rc} in {seconds:.0f} s", flush=True)


def summary_lines(out: Path) -> list[str]:
    lines = []
    check = out / "gpu_check.json"
    if check.exists():
        c = json.loads(check.read_text())
        lines.append(f"check: {c.get('status')}; " + ", ".join(f"{k} {v.get('status')}"
                                                               for k, v in c.get("sections", {}).items()))
    data = json.loads((out / "gpu_70b.json").read_text()) if (out / "gpu_70b.json").exists() else {}
    for part, d in data.items():
        if part == "environment":
            continue
        lines.append(f"{part}: {d.get('status')}" + (f" ({d['error']})" if "error" in d else ""))
        for r in d.get("rows", []):
            lines.append("  " + ", ".join(f"{k}={_common.fmt(v, 4) if isinstance(v, float) else v}"
                                          for k, v in r.items() if not isinstance(v, (dict, list))))
    return lines


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part:
        return child(args)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: nothing to measure (use --tiny --device cpu to smoke-test the code)")
        return 0
    Results(args.out).update("environment", command=_common.command_line(), torch=torch.__version__,
                             commit=_common.git_commit(),
                             gpu=torch.cuda.get_device_name() if args.device == "cuda" else args.device,
                             started=time.strftime("%Y-%m-%d %H:%M:%S %Z"), tiny=args.tiny)
    for part in args.parts:
        run_part(part, args, argv)
    print("\n".join(summary_lines(args.out)))
    return 0


# ---------------------------------------------------------------- rendering

def render(data: dict) -> str:
    f = _common.fmt
    env = data.get("environment", {})
    lines = ["# A 70B-shaped pass on one GPU (`scripts/gpu_session.py`)", "",
             f"`{env.get('command', '')}` on {env.get('gpu', '?')}, torch {env.get('torch', '?')}, commit "
             f"{env.get('commit') or 'unknown'}, {env.get('started', '')}" + (" (--tiny: figures mean nothing)"
                                                                              if env.get("tiny") else ""), ""]
    p = data.get("pass70b")
    if p:
        lines += ["## pass70b", "", f"status {p.get('status')}" + (f": `{p['error']}`" if "error" in p else ""), ""]
        if p.get("rows"):
            lines += [f"{p.get('streamed_layers')} layers of {p['layer_bytes'] / 1e9:.2f} GB (bf16) streamed through "
                      f"{p['slots']} slots from the host arena ({'pinned' if p['host']['pinned'] else 'PAGEABLE'}), "
                      f"{p['passes']} passes per width after a {p['context']}-token prefix.", "",
                      _common.markdown_table(
                          ["tokens", "pass s", "transfer s", "wait s", "compute s", "compute/layer ms",
                           "copy GB/s", "efficiency", "logits == resident"],
                          [[r["tokens"], f(r["pass_s"]), f(r["transfer_s"]), f(r["wait_s"]), f(r["compute_s"]),
                            f(r["compute_per_layer_s"] * 1e3, 2), f(r["copy_gbps"], 1), f(r["efficiency"], 2),
                            "yes" if r["logits_equal"] else "**no**"] for r in p["rows"]]), ""]
    for part, heads, cells in (
            ("drafts", ["draft", "tokens", "call ms"], lambda r: [r["draft"], r["tokens"], f(r["call_s"] * 1e3, 2)]),
            ("dequant", ["quant", "chunk (weights)", "ms per layer", "ms to issue", "block GB", "dense GB"],
             lambda r: [r["quant"], r.get("chunk") or "offspec's", r.get("skipped") or f(r["seconds"] * 1e3, 2),
                        f(r["issue_seconds"] * 1e3, 2) if "issue_seconds" in r else "–",
                        f(r.get("block_bytes", 0) / 1e9, 3), f(r.get("dense_bytes", 0) / 1e9, 3)])):
        d = data.get(part)
        if d:
            lines += [f"## {part}", "", f"status {d.get('status')}" + (f": `{d['error']}`" if "error" in d else ""),
                      ""]
            if d.get("rows"):
                lines += [_common.markdown_table(heads, [cells(r) for r in d["rows"]]), ""]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
