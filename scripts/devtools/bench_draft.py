#!/usr/bin/env python
"""What one draft call costs, by the number of tree nodes it runs, with and without the draft's int8 copy, and
held quantized (int8-held, nf4, int4); with --twin, also the demo target's twin (--draft self) beside it.

A round grows its tree with one draft call per depth, so the time of one call decides how deep a tree can pay
for itself. On a CPU a call over a few rows is memory-bound (it reads every draft weight once), which is what
the int8 copy of the draft's matrices (offspec/formats/quant.py, `--draft-quant int8`) halves. For each setting this
times Model.forward of the resident demo draft (0.5B) over R rows after a --context-token prefix in its KV
cache, R in --rows, median of --calls calls:

  bf16            the draft as loaded
  int8            the same draft with the int8 copy (a sequence of <= weights.FUSED_MAX_ROWS rows reads it)
  int8-held       the draft's layer matrices held only as per-row int8 (narrow calls read it, wider ones
                  dequantize each matrix first)
  nf4             the draft's layer matrices held only as bitsandbytes nf4 (every call dequantizes each matrix)
  int4            the draft's layer matrices and lm_head held in 4-bit groups, read by PyTorch's int4 matmul
  self int8       (--twin) the 1.5B demo target's twin: int8 copies of its resident matrices, lm_head too
  self int4       (--twin) the same target's twin held in 4-bit groups (formats/int4.py)
  ... +streamer   the same while the target's layer streamer is alive (--offload cpu, 8 slots, idle after
                  its prefetch), as during generation
  ... +torch-copy the same with the streamer's copy worker using Tensor.copy_, as before this benchmark: its
                  OpenMP thread team kept competing with the draft's (transfer.CpuBackend.copy_bytes)

Example:
  python scripts/devtools/bench_draft.py --write-docs      # the table into its block of its notes entry (NOTES)
  python scripts/devtools/bench_draft.py --twin --no-streamer --rows 1,4,16,64 --calls 5 --write-docs
                                                           # both drafts of the demo target (TWIN_NOTES)
"""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]   # this checkout's offspec, scripts/
import _common  # noqa: E402

from offspec.config import OffloadConfig, RuntimeConfig  # noqa: E402
from offspec.engine.load import load_target, parse_dtype  # noqa: E402
from offspec.formats.checkpoint import Checkpoint  # noqa: E402
from offspec.formats.demo import ensure_demo_models  # noqa: E402
from offspec.formats.draft_quant import draft_lm_head  # noqa: E402
from offspec.model.draft import load_resident, load_twin  # noqa: E402
from offspec.model.forward import RowSpan  # noqa: E402
from offspec.model.kv_cache import KVCache  # noqa: E402
from offspec.plan.placement import LayerPlan  # noqa: E402
from offspec.plan.sizes import ModelSpec, draft_weights_nbytes, int8_copy_nbytes  # noqa: E402
from offspec.stream.transfer import CpuBackend  # noqa: E402

SECTION = "bench_draft"
NOTES = _common.REPO / "docs" / "notes" / "2026-11-26-draft-int8-copy.md"   # where --write-docs writes
TWIN_NOTES = _common.REPO / "docs" / "notes" / "2026-11-28-int4-twin.md"     # ... with --twin
CPU = torch.device("cpu")


def time_calls(model, rows: int, context: int, calls: int, sequences: int = 1) -> float:
    """Median seconds of one draft forward over `rows` new tokens after `context` cached ones, the rows split
    evenly among `sequences` sequences (each its own cache row, as prompts in flight share a growth call)."""
    cache = KVCache.for_model(model.cfg, context + rows, model.dtype, CPU, batch=sequences)
    tokens = torch.randint(0, model.cfg.vocab_size, (rows,), generator=torch.Generator().manual_seed(rows))
    split = widths(rows, sequences)
    positions = torch.cat([torch.arange(context, context + width) for width in split])    # (R,)
    spans, start = [], 0
    for row, width in enumerate(split):
        cache.set_length(context, row)
        slots = torch.arange(context, context + width)                                     # (w,)
        spans.append(RowSpan(start, start + width, row, slots, torch.ones(width, context + width, dtype=torch.bool)))
        start += width
    times = []
    for _ in range(calls + 1):                 # the first call warms up
        start = time.perf_counter()
        model.forward(tokens, positions, spans, cache)
        times.append(time.perf_counter() - start)
    return statistics.median(times[1:])


def widths(rows: int, sequences: int) -> list[int]:
    """`rows` split among `sequences` as evenly as whole rows allow (the first ones get the remainder)."""
    base, extra = divmod(rows, sequences)
    return [w for w in (base + (i < extra) for i in range(sequences)) if w > 0]


@contextlib.contextmanager
def live_streamer(target_dir, dtype, torch_copy: bool):
    """The target's layers streamed from host RAM through 8 slots, alive (and idle after its prefetch)."""
    original = CpuBackend.copy_bytes
    if torch_copy:
        CpuBackend.copy_bytes = lambda self, dst, src: dst.copy_(src)
    ckpt = Checkpoint(target_dir)
    layers = LayerPlan.of(ckpt.config, OffloadConfig(mode="cpu", n_slots=8), dtype)
    target = load_target(ckpt, layers, RuntimeConfig(device=CPU, dtype=dtype), False)
    ckpt.close()
    try:
        time.sleep(2.0)                        # let the first pass's prefetch finish
        yield
    finally:
        target.layers.close()
        CpuBackend.copy_bytes = original


def twins(target_dir, dtype) -> dict:
    """The demo target, resident, and its twins (--draft self) by setting label."""
    ckpt = Checkpoint(target_dir)
    target = load_resident(ckpt, CPU, dtype)
    out = {f"self {quant}": load_twin(ckpt, target, quant, draft_lm_head(quant, "cpu", dtype, twin=True))
           for quant in ("int8", "int4")}
    ckpt.close()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--rows", default="1,2,4,8,16,32,64", help="tree nodes per call (comma-separated)")
    p.add_argument("--context", type=int, default=300, help="tokens already in the draft's KV cache")
    p.add_argument("--calls", type=int, default=9, help="timed calls per cell (median)")
    p.add_argument("--sequences", type=int, default=1,
                   help="split each call's rows among this many sequences (prompts in flight sharing the call): "
                        "with the int8 copy, each sequence of at most weights.FUSED_MAX_ROWS rows reads it")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--no-streamer", dest="streamer", action="store_false",
                   help="skip the settings with a live target streamer (they load the 1.5B target)")
    p.add_argument("--no-held", dest="held", action="store_false",
                   help="skip the drafts held quantized (int8-held, nf4: --draft-quant)")
    p.add_argument("--twin", action="store_true",
                   help="also time the demo target's twin (--draft self, int8 and int4; loads the 1.5B target)")
    p.add_argument("--write-docs", action="store_true", help="replace the table's block (bench_draft) in its notes entry (NOTES)")
    args = p.parse_args()
    if args.sequences < 1:
        p.error("--sequences must be at least 1")
    started, load_at_start = time.time(), _common.load_average()
    rows = [int(r) for r in args.rows.split(",")]
    dtype = parse_dtype(args.dtype)
    target_dir, draft_dir = ensure_demo_models()

    ckpt = Checkpoint(draft_dir)
    quants = ("none", "int8", "int8-held", "nf4", "int4") if args.held else ("none", "int8")
    drafts = {quant: load_resident(ckpt, CPU, dtype, quant, head=draft_lm_head(quant, "cpu", dtype))
              for quant in quants}
    ckpt.close()
    settings = [("bf16", "none", None), ("int8", "int8", None)]
    if args.held:
        settings += [("int8-held", "int8-held", None), ("nf4", "nf4", None), ("int4", "int4", None)]
    if args.twin:
        drafts.update(twins(target_dir, dtype))
        settings += [("self int8", "self int8", None), ("self int4", "self int4", None)]
    if args.streamer:
        settings += [("int8 +streamer", "int8", False), ("int8 +streamer +torch-copy", "int8", True),
                     ("bf16 +streamer +torch-copy", "none", True)]
    results = {}
    for label, quant, torch_copy in settings:
        streamer = live_streamer(target_dir, dtype, torch_copy) if torch_copy is not None else contextlib.nullcontext()
        with streamer:
            results[label] = [time_calls(drafts[quant], r, args.context, args.calls, args.sequences) for r in rows]
        print(f"{label:28s} " + "  ".join(f"{r}:{t:.3f}" for r, t in zip(rows, results[label])), file=sys.stderr)

    spec = ModelSpec.of(Checkpoint(draft_dir, headers_only=True))
    weight_mb = {quant: (draft_weights_nbytes(spec, dtype, quant, draft_lm_head(quant, CPU.type, dtype))
                         + (int8_copy_nbytes(spec.cfg, dtype) if quant == "int8" else 0)) / 1e6 for quant in quants}
    if args.twin:           # what the twin adds to the target's own bytes
        twin = ModelSpec.of(Checkpoint(target_dir, headers_only=True)).as_twin()
        weight_mb["self int8"] = int8_copy_nbytes(twin.cfg, dtype) / 1e6
        head = draft_lm_head("int4", CPU.type, dtype, twin=True)
        weight_mb["self int4"] = draft_weights_nbytes(twin, dtype, "int4", head) / 1e6
    headers = ["draft setting", "weights MB", *[f"{r} row{'s' if r > 1 else ''}" for r in rows]]
    table_rows = [[label, f"{weight_mb[quant]:.0f}", *[_common.fmt(t) for t in results[label]]]
                  for label, quant, _ in settings]
    print(_common.text_table(headers, table_rows))
    if args.write_docs:
        body = "\n".join([
            "## One draft call, by rows (`scripts/devtools/bench_draft.py`)",
            _common.run_header(CPU, started, load_at_start),
            f"Seconds per call of the demo draft (Qwen2.5-Coder-0.5B, {args.dtype})"
            + (" and of the demo target's twin (Qwen2.5-Coder-1.5B, --draft self; its weights MB are what it adds "
               "to the target's)" if args.twin else "") + f", median of {args.calls}, "
            f"after {args.context} cached tokens"
            + (f", each call's rows split among {args.sequences} sequences" if args.sequences > 1 else "")
            + ". A tree round makes one such call per depth.", "",
            _common.markdown_table(headers, table_rows)])
        _common.write_doc_section(SECTION, body, path=TWIN_NOTES if args.twin else NOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
