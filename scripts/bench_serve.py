#!/usr/bin/env python
"""`offspec serve` under a fixed concurrent load: tokens/s for all clients together against the same prompts sent
one at a time, through the same server (the demo pair unless --target/--draft, greedy, a fixed tree budget, the
`openai` client streaming).

The two ways alternate (one at a time, then all at once, --repeats times), so a machine that changes speed slows
both alike. Each row: wall seconds, tokens, tokens/s, the target passes the engine ran (each pass counted once,
however many requests shared it), and whether every answer equals the one-at-a-time answer of its prompt.

Examples:
  python scripts/bench_serve.py --clients 8 --new-tokens 32 --repeats 2 --rows docs/bench_serve_rows.jsonl --write-docs
  python scripts/bench_serve.py --clients 8 --new-tokens 32 --repeats 2 --rows docs/bench_serve_rows.jsonl \
      --report-only --write-docs     # the table from the rows, no model loaded
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))
import _common  # noqa: E402
import _stats  # noqa: E402

from offspec.bench import runner as bench  # noqa: E402
from offspec.config import OffloadConfig, RunLimits, RuntimeConfig, SamplingConfig, TreeConfig  # noqa: E402
from offspec.engine.load import load_engine, parse_dtype  # noqa: E402

SECTION = "bench_serve"
CPU = torch.device("cpu")
SETTINGS = ("clients", "new_tokens", "tree_budget", "dtype", "offload", "context")   # kept in every row


def settings_of(args) -> dict:
    """The options a run's rows were measured with (each row keeps them as row["settings"])."""
    return {k: getattr(args, k) for k in SETTINGS}


def matching(rows: list[dict], args) -> list[dict]:
    """The rows measured with these options. A row that keeps its settings must equal them; an older row (from
    before rows kept them) must have --clients answers and at most --new-tokens tokens each, and is taken as run with
    the rest of the options, which it does not record (report() says so)."""
    want = settings_of(args)
    return [r for r in rows if r.get("settings") == want or ("settings" not in r and len(r["texts"]) == args.clients
                                                           and r["tokens"] <= args.clients * args.new_tokens)]


def start(args):
    """The demo pair (or --target/--draft) behind an in-process server -> (service, server, thread, url)."""
    from offspec.formats.demo import ensure_demo_models
    from offspec.serve.app import EngineService, ServeConfig, make_app, run_in_thread

    target, draft = (args.target, args.draft) if args.target else ensure_demo_models()
    tree = TreeConfig(policy="dyspec", budget=args.tree_budget)
    loaded = load_engine(target, draft, OffloadConfig(mode=args.offload),
                         RuntimeConfig(device=CPU, dtype=parse_dtype(args.dtype)),
                         limits=RunLimits(context=args.context, tree_budget=args.tree_budget,
                                          concurrency=args.clients, sampling=False))
    service = EngineService(loaded.engine, loaded.plan.concurrency, max_waiting=args.clients)
    cfg = ServeConfig(model="bench", tree=tree, sampling=SamplingConfig(), max_tokens=args.new_tokens,
                      max_waiting=args.clients, context=loaded.plan.context)
    server, thread, url = run_in_thread(make_app(service, cfg, loaded.engine.tokenizer))
    return loaded, service, server, thread, url


def ask(url: str, prompt: str, new_tokens: int) -> tuple[str, int, int]:
    """One streaming chat request -> (its text, its completion tokens, the passes it took part in)."""
    import openai
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=3600)
    chunks = list(client.chat.completions.create(model="bench", messages=[{"role": "user", "content": prompt}],
                                                 max_tokens=new_tokens, temperature=0, stream=True))
    return ("".join(c.choices[0].delta.content or "" for c in chunks if c.choices), chunks[-1].usage.completion_tokens,
            chunks[-1].model_extra["offspec"]["passes"])


def measure(args, service, url, prompts, way: str) -> dict:
    passes, t0 = service.passes, time.perf_counter()
    if way == "one at a time":
        answers = [ask(url, p, args.new_tokens) for p in prompts]
    else:
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(pool.map(lambda p: ask(url, p, args.new_tokens), prompts))
    seconds = time.perf_counter() - t0
    tokens = sum(n for _, n, _ in answers)
    return dict(way=way, seconds=seconds, tokens=tokens, tokens_per_s=tokens / seconds,
                passes=round(service.passes - passes), request_passes=sum(k for _, _, k in answers),
                texts=[t for t, _, _ in answers])


def report(args, rows: list[dict], started: float, load_at_start: str) -> str:
    """The section, from rows that matching() kept for these options: the prose states the rows' settings (with
    what older rows that do not keep them were taken as), the table their medians."""
    table = []
    clients = len(rows[0]["texts"])
    solo = [r for r in rows if r["way"] == "one at a time"]
    for way in ("one at a time", "all at once"):
        mine = [r for r in rows if r["way"] == way]
        if not mine:
            continue
        same = sum(a == b for r, s in zip(mine, solo) for a, b in zip(r["texts"], s["texts"]))
        ratio = "–" if way == "one at a time" else _stats.fmt_ci(
            _stats.ratio_ci([r["tokens_per_s"] for r in mine], [s["tokens_per_s"] for s in solo]), 2, key="ratio",
            suffix="x")
        table.append([way, f"{clients}", _stats.fmt_ci(_stats.median_ci([r["tokens_per_s"] for r in mine]), 2),
                      ratio, f"{statistics.median(r['seconds'] for r in mine):.1f}",
                      f"{statistics.median(r['tokens'] for r in mine):.0f}",
                      f"{statistics.median(r['passes'] for r in mine):.0f}",
                      f"{statistics.median(r['tokens'] / r['request_passes'] for r in mine):.2f}",
                      f"{same}/{len(mine) * clients}", f"{len(mine)}"])
    head = ["requests sent", "prompts", "tokens/s (all clients)", "vs one at a time", "wall s", "tokens",
            "target passes", "tokens a request's pass", "answers = one at a time's", "runs"]
    unrecorded = sum("settings" not in r for r in rows)
    setting = next((r["settings"] for r in rows if "settings" in r), None) or {      # matching(): all alike
        k: getattr(args, k) for k in ("new_tokens", "tree_budget", "dtype")}
    which = "All" if unrecorded == len(rows) else f"{unrecorded} of the"
    older = (f" {which} {len(rows)} runs keep no settings (measured before rows kept them) and are taken "
             f"as run with the command's options: their {clients} answers of at most {setting['new_tokens']} tokens "
             "each are checked, the tree budget, dtype, offload and context are not recorded." if unrecorded else "")
    return "\n".join([
        "## `offspec serve` under concurrent load: tokens/s for all clients against one at a time",
        _common.run_header(CPU, started, load_at_start, rows),
        f"The demo pair behind `offspec serve` (in process, loopback), {setting['dtype']}, dyspec at a tree budget of "
        f"{setting['tree_budget']}, greedy, {setting['new_tokens']} new tokens per HumanEval prompt, streamed with the `openai` "
        f"client: the {clients} prompts sent one after another, then all at once (every pass shared by the "
        "requests in flight), alternated. Cells: medians with a bootstrap 95% interval over the runs; 'vs one at a "
        "time' pairs each concurrent run with the sequential run before it; 'target passes' counts a shared pass "
        "once. In float32 every answer equals its run alone (tests/test_serve.py); in bfloat16 a pass over several "
        "rows rounds differently, so answers may part at a near-tie." + older, "",
        _common.markdown_table(head, table)])


def main() -> int:
    from offspec.formats.demo import humaneval_prompts

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--clients", type=int, default=8, help="prompts sent, and requests in flight at once")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--tree-budget", type=int, default=16)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--offload", default="none", help="the target's layers: none (resident) | cpu | disk")
    p.add_argument("--context", type=int, default=1024)
    p.add_argument("--target", default=None)
    p.add_argument("--draft", default=None)
    p.add_argument("--rows", default=None, help="append each run to this JSONL file (a .jsonl.gz is read only: "
                                                "--report-only)")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: the table (and with --write-docs the section) from the rows in --rows that "
                        "were measured with these options")
    p.add_argument("--write-docs", action="store_true", help=f"replace the {SECTION} section of docs/benchmarks.md")
    args = p.parse_args()
    if not args.report_only:
        bench.check_appendable(args.rows)      # before anything is measured: a .gz rows file is an archive
    started, load_at_start = time.time(), _common.load_average()
    if args.report_only:
        if not args.rows or not bench.rows_file(args.rows).exists():
            p.error("--report-only needs the --rows file the runs were appended to")
        stored = bench.read_rows(args.rows)
        rows = matching(stored, args)
        if not rows:
            options = " ".join(f"--{k.replace('_', '-')} {v}" for k, v in settings_of(args).items())
            p.error(f"none of the {len(stored)} rows in {args.rows} was measured with these options ({options})")
        text = report(args, rows, started, load_at_start)
        print(text)
        if args.write_docs:
            _common.write_doc_section(SECTION, text)
        return 0
    prompts = [t["prompt"] for t in humaneval_prompts(args.clients)]
    loaded, service, server, thread, url = start(args)
    rows = []
    try:
        ask(url, prompts[0], 4)                                            # warm-up, not counted
        for repeat in range(args.repeats):
            for way in ("one at a time", "all at once"):
                row = dict(measure(args, service, url, prompts, way), repeat=repeat, settings=settings_of(args),
                           stamp=_stats.stamp())
                rows.append(row)
                if args.rows:
                    bench.append_row(args.rows, row)
                print(f"  #{repeat} {way}: {row['tokens_per_s']:.2f} tokens/s, {row['passes']} passes",
                      file=sys.stderr)
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        service.close()
        loaded.engine.close()
    text = report(args, rows, started, load_at_start)
    print(text)
    if args.write_docs:
        _common.write_doc_section(SECTION, text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
