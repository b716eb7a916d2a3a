#!/usr/bin/env python
"""One batch job on the demo pair with the auto planner's every round logged: what the planner was shown
(rows, rows that grew a tree, nodes, growth / catch-up / pass seconds, tokens fed, tokens yielded) and what it
chose after (plain decoding or trees, its miss ratio, the budgets it gave). For diagnosing the planner, not a
benchmark: one run, no repeats (scripts/bench_batch.py measures; its cpu and disk regimes have the same settings
as --offload none and disk).

  python scripts/devtools/planner_trace.py --concurrency 16 --prompts 32 --prompt-set chat --out trace.jsonl
  python scripts/devtools/planner_trace.py --concurrency 8 --prompts 16 --tree none      # the plain baseline's wall time

Per line of --out: rows, grown, nodes, draft_s (growth), catch_up (tokens fed), catch_up_s, target_s, pass_tokens,
timed (False: a round that prefilled), yielded, then plain (plain decoding chosen for the next round), miss,
budgets (their sum). The summary splits the job's seconds and tokens into tree rounds, plain rounds and prefill
rounds, and again into rounds with every row in flight and the drain (fewer rows: no prompt left to refill them).
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]   # offspec, scripts/
import _common  # noqa: E402

from offspec.engine import controller  # noqa: E402
from offspec.bench.prompt_sets import load_prompt_set  # noqa: E402
from offspec.config import OffloadConfig, RunLimits, RuntimeConfig, TreeConfig  # noqa: E402
from offspec.engine.generate import GenerationRequest  # noqa: E402
from offspec.engine.load import Models  # noqa: E402
from offspec.engine.prompt import encode_prompt  # noqa: E402
from offspec.formats.demo import ensure_demo_models  # noqa: E402
from offspec.spec.grow import POLICIES  # noqa: E402


def traced(log: list):
    """Controller.observe, recording each round into `log`."""
    observe = controller.Controller.observe

    def record(self, r: controller.RoundRecord):
        grown = [t.size for t in r.trees.values() if t.size > 0]
        fed, catch_up_s = r.catch_up or (0, 0.0)
        entry = dict(rows=len(r.trees), grown=len(grown), nodes=sum(grown), draft_s=round(r.draft_seconds, 4),
                     catch_up=fed, catch_up_s=round(catch_up_s, 4), target_s=round(r.target_seconds, 4),
                     pass_tokens=r.pass_tokens, timed=r.timed, yielded=r.yielded or 0)
        observe(self, r)
        log.append({**entry, "plain": self.plain_wins, "miss": round(self.miss(), 3),
                    "budgets": sum(self.alloc.values())})
    return record


def summary(log: list) -> str:
    """The job's seconds and tokens by kind of round, then by whether every row was in flight: the drain (fewer
    rows, once no prompt is left to refill them) is where a short job's passes carry less."""
    def part(name, rounds):
        seconds = sum(r["draft_s"] + r["catch_up_s"] + r["target_s"] for r in rounds)
        tokens = sum(r["yielded"] for r in rounds)
        rate = f"{tokens / seconds:.1f} tokens/s" if seconds else "–"
        return f"{name}: {len(rounds)} rounds, {tokens} tokens in {seconds:.1f} s ({rate})"
    most = max(r["rows"] for r in log)
    return "\n".join(["; ".join([part("tree rounds", [r for r in log if r["grown"] and r["timed"]]),
                                  part("plain rounds", [r for r in log if not r["grown"] and r["timed"]]),
                                  part("prefill rounds", [r for r in log if not r["timed"]])]),
                       "; ".join([part(f"all {most} rows in flight", [r for r in log if r["rows"] == most]),
                                  part("fewer (the drain)", [r for r in log if r["rows"] < most])])])


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--concurrency", type=int, default=8, help="prompts in flight")
    p.add_argument("--prompts", type=int, default=16, help="the first N prompts of the set")
    p.add_argument("--prompt-set", default="chat", choices=["code", "chat"])
    p.add_argument("--new-tokens", type=int, default=64, help="tokens a prompt (EOS ignored)")
    p.add_argument("--tree", default="dyspec", choices=POLICIES,
                   help="growth policy (none: plain batched decoding, no planner)")
    p.add_argument("--offload", default="none", choices=["none", "disk"],
                   help="none: both models resident (a pass is compute); disk: the target's layers streamed "
                        "from a packed store in a temporary folder, every read cold (bench_batch's disk regime)")
    p.add_argument("--slots", type=int, default=2, help="ring slots with --offload disk (layers read ahead)")
    p.add_argument("--auto-rows", action="store_true",
                   help="--concurrency is the most rows in flight and the costs may keep fewer (what `offspec batch "
                        "--concurrency auto` does with the memory plan's most)")
    p.add_argument("--out", default=None, help="JSONL file for the per-round log")
    args = p.parse_args(argv)
    for name in ("concurrency", "prompts", "new_tokens"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.slots < 2:
        p.error("--slots must be at least 2 (one slot is read while another is computed)")
    log: list = []
    controller.Controller.observe = traced(log)
    target, draft = ensure_demo_models()
    models = Models.open(target, draft)
    ids = [encode_prompt(models.tokenizer, text) for _, text in load_prompt_set(args.prompt_set, args.prompts)]
    requests = [GenerationRequest(prompt_ids=tuple(x), max_new_tokens=args.new_tokens, ignore_eos=True,
                                  tree=TreeConfig(policy=args.tree)) for x in ids]
    longest = max(map(len, ids)) + args.new_tokens
    with tempfile.TemporaryDirectory(prefix="offspec-trace-") as store_dir:      # the disk store, built per run
        offload = OffloadConfig(mode=args.offload, store_dir=store_dir if args.offload == "disk" else None,
                                n_slots=args.slots)
        loaded = models.load(offload, RuntimeConfig(dtype=torch.bfloat16, draft_quant="int8"),
                             RunLimits(context=longest + 1026, sampling=False, concurrency=args.concurrency),
                             progress=False)
        started, tokens = time.perf_counter(), 0
        try:
            for event in loaded.engine.run_batch(requests, concurrency=args.concurrency, adapt_rows=args.auto_rows):
                if event.error is not None:
                    raise SystemExit(f"planner_trace: {event.error}")
                tokens += len(event.step.tokens)
            wall = time.perf_counter() - started
        finally:
            loaded.engine.close()               # its reader threads hold the store's file open
    print(f"B={args.concurrency} {args.tree} ({args.offload}), {args.prompts} {args.prompt_set} prompts: "
          f"{tokens} tokens in {wall:.1f} s, {tokens / wall:.2f} tokens/s")
    if log:
        print(summary(log))
    if args.out:
        Path(args.out).write_text("".join(json.dumps(r) + "\n" for r in log))
    return 0


if __name__ == "__main__":
    _common.run_main(main)
