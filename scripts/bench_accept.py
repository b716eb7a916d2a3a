#!/usr/bin/env python3
"""Tokens per target pass against tree budget, per growth policy: one engine, one tree setting changed.

Each system is offspec.bench.runner's `<policy>-<N>` (chain-8: an 8-token chain, classic speculative decoding;
dyspec-64: a dyspec tree of at most 64 nodes), run by offspec.bench.runner.measure on an engine loaded as
`offspec generate --offload OFFLOAD` loads it (Models and the memory plan), every system on every prompt,
interleaved per prompt, at each temperature (T > 0 with seed --seed). The prompts are the peer grid's
(scripts/bench_peers.py): HumanEval (after "Complete this Python function:") or MT-Bench first turns, chat
template applied. EOS is ignored, so every run makes --new-tokens tokens, and a pass's tokens are counted up to
that cut.

  tokens/pass   each prompt's tokens / target passes; a cell is the median over prompts with its bootstrap 95%
                interval (offspec.bench.runner.median_ci)
  tree          the mean over prompts of each run's mean nodes a round (near the end of a run a tree stops short
                of its budget: no deeper than the tokens left need)
  vs chain      the system's median tokens/pass over the best chain's (the chain length with the highest
                median), with a paired bootstrap interval: prompts resampled with both (offspec.bench.runner.ratio_ci)

Tokens per pass do not depend on the machine's speed or load (greedy: the tokens; T > 0: the seed); each cell's
seconds are kept in its row but not tabled: what a budget costs on a machine is the peer grid's question
(scripts/bench_peers.py, timed systems interleaved on an idle machine).

sequoia-N (Sequoia's DP tree for the pair's acceptance by rank, offspec.spec.sequoia) starts each prompt from the
vector cached for the pair under $OFFSPEC_HOME/sequoia (offspec.engine.pair_cache) and adds what its runs observed
when the engine closes; once the cache holds 2000 observations the vector is frozen. --calibrate on does the same
with dyspec's acceptance by depth and draft probability ($OFFSPEC_HOME/calibration, frozen from 20000). So compare
them after a calibration run into a throwaway rows file (one engine, a few prompts), or the first prompts measure
the prior. Each row records what the pair's caches held when its engine started (learned_from), and each cell
what its run started from (its own learned_from: for a greedy run also what the engine's earlier runs observed;
for a sampled sequoia run whose vector is still learning, the greedy vector's seed of at most 32 observations).

Acceptance does not depend on where the target's weights live, so --offload none is the default (the fastest).
One rows file per prompt set; rerunning a command resumes it (rows of other settings are refused).

  python scripts/bench_accept.py --prompt-set code --rows docs/bench_accept/code.jsonl
  python scripts/bench_accept.py --rows docs/bench_accept/code.jsonl docs/bench_accept/chat.jsonl --report-only \\
      --write-docs
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]   # this checkout's offspec, not an installed one

import _common  # noqa: E402
import peer_hf  # noqa: E402

from offspec.bench import runner as bench  # noqa: E402
from offspec.cli.options import DRAFT_QUANT_CHOICES  # noqa: E402
from offspec.config import FIXED_BUDGET_DEPTH, OffloadConfig, SamplingConfig, TreeConfig  # noqa: E402
from offspec.errors import InputError  # noqa: E402

SECTION = "bench_accept"
SYSTEMS = ("dyspec-16", "dyspec-32", "dyspec-64", "dyspec-128", "chain-4", "chain-8", "chain-16")
SET_NAMES = {"code": "HumanEval", "chat": "MT-Bench first turns"}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--prompt-set", choices=peer_hf.PROMPT_SETS, default="code")
    p.add_argument("--prompts", type=int, default=16, help="the first N prompts of the set")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run, EOS ignored")
    p.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated <policy>-<N> (offspec.bench.runner)")
    p.add_argument("--temperatures", default="0,0.6", help="comma-separated, repeats dropped; 0 = greedy")
    p.add_argument("--seed", type=int, default=0, help="sampling seed at T > 0")
    p.add_argument("--offload", default="none", choices=("none", "cpu", "disk"), help="where the target's layers live")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu or cuda[:N]")
    p.add_argument("--target", default=None, help="target model folder [default: the demo target]")
    p.add_argument("--draft", default=None, help="draft model folder, or self: the target's twin [default: the demo "
                   "draft]")
    p.add_argument("--draft-quant", default="auto", choices=DRAFT_QUANT_CHOICES,
                   help="how the draft's matrices are held (offspec generate --draft-quant); each row records the "
                        "one the plan held")
    p.add_argument("--calibrate", default="off", choices=("on", "off"),
                   help="every system's node values from the acceptance it observes (offspec generate --calibrate)")
    p.add_argument("--max-depth", type=int, default=FIXED_BUDGET_DEPTH,
                   help="deepest tree level every system may grow (offspec generate --max-depth)")
    p.add_argument("--rows", nargs="+", required=True,
                   help="the rows file to measure into (one), or the files to render (--report-only)")
    p.add_argument("--report-only", action="store_true", help="measure nothing: print (and write) the table")
    p.add_argument("--write-docs", action="store_true", help=f"write the {SECTION} section of docs/benchmarks.md")
    args = p.parse_args(argv)
    args.systems = list(dict.fromkeys(x.strip() for x in args.systems.split(",") if x.strip()))
    args.temperatures = bench.parse_temperatures(args.temperatures)
    for name in args.systems:
        if bench.system_tree(name, TreeConfig()).budget is None:
            p.error(f"--systems: {name} is not a fixed <policy>-<N> (e.g. dyspec-64, chain-8)")
    if not args.report_only:
        if len(args.rows) != 1:
            p.error("a measuring run appends to ONE --rows file")
        bench.check_appendable(args.rows[0])
    if args.prompts < 1 or args.new_tokens < 1 or args.max_depth < 1:
        p.error("--prompts, --new-tokens and --max-depth must be >= 1")
    if (args.target is None) != (args.draft is None):
        p.error("give both --target and --draft, or neither (the demo pair)")
    args.device = _common.compute_device(args.device, here=not args.report_only)
    return p, args


def main(argv=None) -> int:
    p, args = parse_args(argv)
    if not args.report_only:
        measure(args)
    rows = merged_rows([r for f in args.rows for r in bench.read_rows(f) if "systems" in r])
    if not rows:
        p.error(f"{', '.join(args.rows)} hold no rows")
    table = render_table(rows)
    print(_common.text_table(HEADERS, table))
    if args.write_docs:
        _common.write_doc_section(SECTION, section(rows, table))
        print(f"wrote section {SECTION} of {_common.BENCHMARKS_MD}", file=sys.stderr)
    return 0


def measure(args) -> None:
    """Load the engine as `offspec generate` does and measure every (prompt, temperature) the rows file lacks."""
    from offspec.engine.load import Models, parse_dtype, runtime_config
    from offspec.formats import int4
    from offspec.formats.demo import ensure_demo_models

    target_dir, draft_dir = (args.target, args.draft) if args.target else ensure_demo_models()
    models = Models.open(target_dir, draft_dir)
    settings = {"prompt_set": args.prompt_set, "new_tokens": args.new_tokens, "dtype": args.dtype,
                "offload": args.offload, "device": args.device.type, "seed": args.seed,
                "models": [Path(target_dir).name, Path(draft_dir).name]}
    if args.draft_quant != "auto":              # rows measured before this option were all auto
        settings["draft_quant"] = args.draft_quant
    if args.calibrate == "on":                  # likewise: rows measured before it were all off
        settings["calibrate"] = True
    if args.max_depth != FIXED_BUDGET_DEPTH:   # likewise: rows measured before it had the default
        settings["max_depth"] = args.max_depth
    if models.twin or args.draft_quant == "int4":   # rows without it: a dense target's twin in groups of 64
        settings["int4_group"] = int4.GROUP
    prompts = peer_hf.encoded_prompts(args.prompt_set, args.prompts, 0, models.tokenizer)
    done = {bench.row_key(r) for r in bench.resumed_rows(args.rows[0], prompts, args.systems, args.temperatures,
                                                            args.seed, settings)}
    if len(done) == len(prompts) * len(args.temperatures):
        return
    tree = TreeConfig(calibrate=args.calibrate == "on", max_depth=args.max_depth)
    trees = {name: bench.system_tree(name, tree) for name in args.systems}
    limits = bench.bench_limits(trees.values(), max(len(ids) for _, ids in prompts) + args.new_tokens,
                                sampling=any(t > 0 for t in args.temperatures))
    runtime = runtime_config(args.device, parse_dtype(args.dtype), args.draft_quant, twin=models.twin)
    loaded = models.load(OffloadConfig(mode=args.offload), runtime, limits)
    extra = {"prompt_set": args.prompt_set, "settings": settings, "command": _common.command_line(),
             "draft_quant": loaded.plan.draft_quant}

    def on_row(row):
        bench.append_row(args.rows[0], row)
        print(f"{row['id']} T={row['temperature']:g}: " + ", ".join(
            f"{name} {c['tokens_per_pass']:.2f}" for name, c in row["systems"].items()), file=sys.stderr)

    try:
        for t in args.temperatures:
            sampling = SamplingConfig(temperature=t)
            runners = {name: bench.offspec_runner(loaded.engine, tree, sampling, ignore_eos=True)
                       for name, tree in trees.items()}
            learned = {"learned_from": loaded.engine.learned.observations(sampling.greedy)}   # the pair's caches
            bench.measure(prompts, runners, args.new_tokens, temperature=t, seeds=(None,) if t == 0 else (args.seed,),
                          done=done, extra={**extra, **learned}, on_row=on_row)
    finally:
        loaded.engine.close()


# ------------------------------------------------------------------ the table

HEADERS = ["prompts, T", "system", "tokens/pass [95% CI]", "tree", "vs best chain [95% CI]"]


def merged_rows(rows: list[dict]) -> list[dict]:
    """One row per (prompt set, prompt, seed, temperature): a later row's cells replace an earlier one's system
    by system, so a run that added systems keeps the others. InputError where the rows' settings (besides the
    prompt set) differ: their cells are not one table."""
    kinds = {json.dumps({k: v for k, v in r.get("settings", {}).items() if k != "prompt_set"}, sort_keys=True)
             for r in rows}
    if len(kinds) > 1:
        raise InputError(f"the rows were measured with {len(kinds)} different settings; render one setting at a time")
    merged: dict[tuple, dict] = {}
    for r in rows:
        key = (r["prompt_set"], *bench.row_key(r))
        merged[key] = {**r, "systems": {**merged.get(key, {}).get("systems", {}), **r["systems"]}}
    return list(merged.values())


def render_table(rows: list[dict]) -> list[list[str]]:
    """One line per (prompt set, temperature, system), the systems in the order they were measured."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["prompt_set"], r["temperature"]), []).append(r)
    table = []
    for (pset, t), group in groups.items():
        systems = list(dict.fromkeys(name for r in group for name in r["systems"]))

        def tpp(s):
            return [r["systems"][s]["tokens_per_pass"] if s in r["systems"] else None for r in group]

        chains = [s for s in systems if s.startswith("chain-")]
        best = max(chains, key=lambda s: bench.median_ci(tpp(s))["median"]) if chains else None
        for s in systems:
            cells = [r["systems"][s] for r in group if s in r["systems"]]
            vs = bench.ratio_ci(tpp(s), tpp(best)) if best and s != best else None
            table.append([f"{SET_NAMES.get(pset, pset)}, T = {t:g}", s, bench.fmt_ci(bench.median_ci(tpp(s)), 2),
                          f"{statistics.fmean(c['mean_tree_size'] for c in cells):.1f}",
                          "best chain" if s == best else bench.fmt_ci(vs, 2, "ratio", "x")])
    return table


def section(rows: list[dict], table: list[list[str]]) -> str:
    """The page's section: what a row is, the commands and where they ran, the table."""
    settings = rows[0]["settings"]
    counts: dict[tuple, set] = {}
    for r in rows:
        counts.setdefault((r["prompt_set"], r["temperature"]), set()).add(r["id"])
    groups = "; ".join(f"{SET_NAMES.get(s, s)} at T = {t:g}: {len(ids)} prompts" for (s, t), ids in counts.items())
    return "\n".join([
        f"## Tokens per target pass vs tree budget (`scripts/{Path(__file__).name}`)",
        "",
        "Each row: one fixed tree policy and budget over the group's prompts, the same engine and draft for every "
        f"row (`<policy>-<N>`: at most N nodes a round; a chain's N is its length), {settings['new_tokens']} new "
        f"tokens with EOS ignored, {settings['dtype']}, target `{settings['models'][0]}`, draft "
        f"`{settings['models'][1]}`, systems interleaved per prompt; T > 0 with seed {settings['seed']}. {groups}. "
        "tokens/pass is what a tree buys wherever a target pass costs its transfer whatever it computes (a "
        "streamed target on a GPU); it does not depend on the machine's speed, so the table gives no seconds "
        "(what a budget costs on this CPU: the peer comparison below).",
        "",
        "Measured by:",
        "```",
        *sorted({_common.relative_command(r["command"]) for r in rows if r.get("command")}),
        "```",
        _common.measured_line(rows),
        "",
        _common.markdown_table(HEADERS, table),
    ])


if __name__ == "__main__":
    _common.run_main(main)
