#!/usr/bin/env python
"""Tokens accepted per target pass against tree budget, for each growth policy, on the demo pair.

Each run is one offspec generation (Engine.generate, the loop the CLI uses): a prompt of --prompt-set (code:
HumanEval; chat: MT-Bench first turns; offspec/prompt_sets.py) with the chat template applied (--raw: as it is),
--new-tokens tokens with EOS ignored (so every run makes the same count), a tree
policy and budget (TreeConfig(policy, budget); threshold, depth and branching at their defaults), at each
temperature. A run is recorded as one raw row (per-round accepted lengths, tree sizes and depths, draft
and target seconds).

  tokens/pass   tokens emitted per target pass, counted only up to the --new-tokens cut (the last round's
                accepted tokens past it do not count): each prompt's generated / passes, then the median over
                prompts with a bootstrap 95% interval over prompts (scripts/_stats.py).
  draft s, target s   mean seconds per round (the first round, which also prefills the prompt, excluded)
  s/token       (draft s + target s) / tokens/pass: what the budget costs on this machine.

`chain` (classic speculative decoding) has no tree: its budget is the chain length. It runs at
--chain-lengths, never beyond 32 (TreeConfig.max_depth): acceptance along a chain decays geometrically, so a
longer chain only adds draft calls. "The best chain" is the best of those lengths.
`static` uses TreeConfig's default widths (4, 2, 2, 1, 1, 1): at most 76 nodes, so at budgets above that
its trees stay at 76 (see the tree column).

Acceptance does not depend on where the target's weights live, so --offload none (resident) is the
default: it is the fastest. Goal (issue 3): dyspec beats every other policy at equal budget, and at
budget 64 accepts at least 1.5x the tokens per pass of the best chain; the script says whether it is met.

Resumable: every finished run is appended to --rows (jsonl) at once; rerunning the same command skips the
runs already there (a run is identified by the models, dtype, device, new tokens, seed, policy, budget,
temperature, prompt set and prompt), so an interrupted grid continues where it stopped and a larger grid reuses a
smaller one. Outer loop: prompts, so a cut-short run has every cell for its first prompts. Every row stores the
commit, time and load average it was measured at (row["stamp"]). A gzip-compressed --rows (.jsonl.gz; a path naming
x.jsonl finds x.jsonl.gz where only that exists) is a read-only archive: --report-only renders it, a measuring run
refuses it before measuring anything (gunzip it to add rows).

Examples:
  python scripts/bench_accept.py --quick                                             # smoke, ~1-2 min
  python scripts/bench_accept.py --prompts 32 --max-budget heap=256 --write-docs    # full grid (many hours)
  python scripts/bench_accept.py --prompt-set chat --prompts 32 --max-budget heap=256 --write-docs
  python scripts/bench_accept.py --prompts 32 --report-only --write-docs             # tables from --rows
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))   # this checkout's offspec, not an installed one
import _common  # noqa: E402
import _stats

SECTION = "bench_accept"
SET_NAMES = {"code": "HumanEval", "chat": "MT-Bench (first turn)"}
DOCS = _common.REPO / "docs"
CHAIN_CAP = 32                      # TreeConfig.max_depth: a chain never grows deeper in one round
GOAL_BUDGET, GOAL_RATIO = 64, 1.5   # issue 3: dyspec at budget 64 >= 1.5x the best chain's tokens/pass
POLICY_ORDER = ("dyspec", "heap", "static", "chain")


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def float_list(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--target", default=None, help="target HF folder (default: the demo target)")
    p.add_argument("--draft", default=None, help="draft HF folder (default: the demo draft)")
    p.add_argument("--budgets", default=None, help="tree budgets (nodes besides the root), comma separated "
                                                   "[default 16,32,64,128,256,512,1024; 16 with --quick]")
    p.add_argument("--policies", default=None, help="growth policies: dyspec, heap, chain, static "
                                                    "[default dyspec,heap,chain,static; dyspec,chain with --quick]")
    p.add_argument("--chain-lengths", default=None,
                   help=f"chain lengths for `chain` (<= {CHAIN_CAP}) [default: 4, 8 and the budgets <= "
                        f"{CHAIN_CAP}; with --quick only the budgets <= {CHAIN_CAP}]")
    p.add_argument("--temperatures", default=None, help="sampling temperatures (0 = greedy) [default 0,0.6; "
                                                        "0 with --quick]")
    p.add_argument("--prompt-set", choices=("code", "chat"), default="code",
                   help="code: HumanEval; chat: MT-Bench first turns (its docs section, JSON and plot get a _chat "
                        "suffix)")
    p.add_argument("--raw", action="store_true",
                   help="the prompts as they are, without the chat template (a HumanEval prompt is code to complete; "
                        "issue 15's baseline table ran code this way); its docs section, JSON and plot get a _raw "
                        "suffix")
    p.add_argument("--ngram", choices=("on", "off"), default="off",
                   help="n-gram branches (TreeConfig.ngram); off, as in offspec (issue 15's grid) and in the rows "
                        "measured before the levers existed. A lever turned on gets its own docs section, JSON and "
                        "plot (suffix _ngram-on, _calibrate-on)")
    p.add_argument("--calibrate", choices=("on", "off"), default="off",
                   help="calibrated node values (TreeConfig.calibrate); each row also records predicted vs observed "
                        "acceptance (scripts/devtools/calibration_plot.py plots it)")
    p.add_argument("--prompts", type=int, default=None, help="the first N prompts of the set [default 32; 1 with "
                                                             "--quick]")
    p.add_argument("--new-tokens", type=int, default=None, help="tokens generated per run, EOS ignored "
                                                                "[default 128; 16 with --quick]")
    p.add_argument("--dtype", default="bfloat16", help="weight and compute dtype of both models")
    p.add_argument("--device", default="cpu", help="compute device (cpu or cuda[:N])")
    p.add_argument("--offload", default="none", choices=("none", "cpu", "disk"), help="where the target's layers live")
    p.add_argument("--seed", type=int, default=0, help="sampling seed (T > 0)")
    p.add_argument("--max-budget", action="append", default=[], metavar="POLICY=N",
                   help="skip POLICY's budgets above N (repeatable), e.g. heap=256: heap makes about one draft "
                        "call per node, so heap at 1024 costs ~1000 draft calls per round")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--rows", default=None, help="raw rows, one JSON line per finished run, appended as they "
                                                "finish and read back to resume [default docs/bench_accept.jsonl; "
                                                "a temporary file with --quick]")
    p.add_argument("--fresh", action="store_true", help="ignore (and truncate) the rows file: measure everything again")
    p.add_argument("--report-only", action="store_true", help="run nothing: tables, plot and docs from the rows file")
    p.add_argument("--json", default=None, help="write this grid's rows and summary here "
                                                "[default docs/bench_accept.json when --write-docs]")
    p.add_argument("--plot", default=None, help="save the tokens/pass vs budget plot (PNG) here "
                                                "[default docs/accept.png when --write-docs]")
    p.add_argument("--write-docs", action="store_true", help=f"write the tables into docs/benchmarks.md (section "
                                                             f"{SECTION}), the JSON and the plot under docs/")
    p.add_argument("--quick", action="store_true", help="smoke-test sizes: 1 prompt, 16 new tokens, budget 16, "
                                                        "dyspec and chain, T=0 (explicit flags win)")
    args = p.parse_args(argv)
    q = args.quick
    args.budgets = int_list(args.budgets or ("16" if q else "16,32,64,128,256,512,1024"))
    args.policies = [x.strip() for x in (args.policies or ("dyspec,chain" if q else "dyspec,heap,chain,static")).split(",")
                     if x.strip()]
    args.temperatures = float_list(args.temperatures or ("0" if q else "0,0.6"))
    args.prompts = args.prompts if args.prompts is not None else (1 if q else 32)
    args.new_tokens = args.new_tokens if args.new_tokens is not None else (16 if q else 128)
    if args.chain_lengths is not None:
        args.chain_lengths = int_list(args.chain_lengths)
    else:
        args.chain_lengths = sorted(({4, 8} if not q else set()) | {b for b in args.budgets if b <= CHAIN_CAP})
    bad = [x for x in args.policies if x not in POLICY_ORDER]
    if bad:
        p.error(f"--policies: unknown {', '.join(bad)} (choose from {', '.join(POLICY_ORDER)})")
    if any(b < 1 for b in args.budgets) or any(not 1 <= c <= CHAIN_CAP for c in args.chain_lengths):
        p.error(f"budgets must be >= 1 and chain lengths in 1..{CHAIN_CAP}")
    if args.prompts < 1 or args.new_tokens < 1 or any(t < 0 for t in args.temperatures):
        p.error("--prompts and --new-tokens must be >= 1, temperatures >= 0")
    args.max_budget = dict(_parse_cap(p, x) for x in args.max_budget)
    if args.rows is None:
        if q and not args.report_only:
            import tempfile
            args.rows = os.path.join(tempfile.mkdtemp(prefix="bench_accept-"), "rows.jsonl")
        else:
            args.rows = str(DOCS / "bench_accept.jsonl")
    if not args.report_only:
        _common.check_appendable(args.rows)       # before anything is measured: a .gz rows file is an archive
    suffix = ("" if args.prompt_set == "code" else f"_{args.prompt_set}") + ("_raw" if args.raw else "")
    suffix += "".join(f"_{lever}-on" for lever in ("ngram", "calibrate") if getattr(args, lever) == "on")
    args.section = SECTION + suffix
    if args.write_docs:
        args.json = args.json or str(DOCS / f"bench_accept{suffix}.json")
        args.plot = args.plot or str(DOCS / f"accept{suffix}.png")
    return args


def _parse_cap(p: argparse.ArgumentParser, text: str) -> tuple[str, int]:
    policy, _, n = text.partition("=")
    if policy not in POLICY_ORDER or not n.isdigit():
        p.error(f"--max-budget {text!r}: expected POLICY=N with POLICY one of {', '.join(POLICY_ORDER)}")
    return policy, int(n)


# ---------------------------------------------------------------- the grid and its rows

def grid(args, prompt_ids: list[str]) -> list[dict]:
    """Every run to make, in order: prompts outermost, then temperature, policy, budget."""
    runs = []
    for pid in prompt_ids:
        for t in args.temperatures:
            for policy in [p for p in POLICY_ORDER if p in args.policies]:
                for budget in (args.chain_lengths if policy == "chain" else args.budgets):
                    if budget > args.max_budget.get(policy, budget):
                        continue
                    runs.append({"prompt_id": pid, "temperature": t, "policy": policy, "budget": budget})
    return runs


def setup_key(args, target: Path, draft: Path) -> dict:
    """What, besides the grid cell, identifies a run: rows made under another setup are not reused."""
    return {"target": target.name, "draft": draft.name, "dtype": args.dtype, "device": args.device,
            "new_tokens": args.new_tokens, "seed": args.seed, "prompt_set": args.prompt_set,
            "raw": args.raw, "ngram": args.ngram == "on", "calibrate": args.calibrate == "on"}


def run_key(setup: dict, run: dict) -> str:
    return json.dumps({**setup, **run}, sort_keys=True)


def read_rows(path: str) -> list[dict]:
    """The rows recorded so far (a .jsonl file, or .jsonl.gz: _common.read_jsonl); a torn last line (a run killed
    while writing) is skipped."""
    rows = _common.read_jsonl(path, torn="ignored (it will be measured again)")
    for row in rows:
        row.setdefault("prompt_set", "code")   # rows from before prompt sets were all HumanEval
        row.setdefault("raw", False)           # ... with the chat template (before --raw)
        row.setdefault("ngram", False)         # ... and from before n-gram branches and calibration, raw trees
        row.setdefault("calibrate", False)
    return rows


def append_row(path: str, row: dict) -> None:
    """One line, fsynced before the next run starts: a crash loses at most the run in progress (_common.append_jsonl;
    a .gz rows file is refused)."""
    _common.append_jsonl(path, json.dumps(row))


def measure(engine, tokenizer, prompt: str, run: dict, new_tokens: int, seed: int, ngram: bool = False,
            calibrate: bool = False, raw: bool = False) -> dict:
    """One generation -> its raw row (per-round lists plus a few totals)."""
    from offspec.config import SamplingConfig, TreeConfig
    from offspec.generate import GenerationRequest
    from offspec.metrics import acceptance_report
    from offspec.prompt import encode_prompt

    ids = tuple(encode_prompt(tokenizer, prompt, raw=raw))
    request = GenerationRequest(prompt_ids=ids, max_new_tokens=new_tokens,
                                tree=TreeConfig(policy=run["policy"], budget=run["budget"], ngram=ngram,
                                                calibrate=calibrate),
                                sampling=SamplingConfig(temperature=run["temperature"], seed=seed),
                                ignore_eos=True)
    start = time.perf_counter()
    steps = list(engine.generate(request))
    return {
        "prompt_tokens": len(ids),
        "generated": sum(len(s.tokens) for s in steps),
        "passes": len(steps),
        "accepted": [s.accepted for s in steps],          # draft tokens accepted per round (bonus not counted)
        "tree_size": [s.tree_size for s in steps],
        "tree_depth": [s.tree_depth for s in steps],
        "draft_s": [round(s.draft_seconds, 5) for s in steps],
        "target_s": [round(s.target_seconds, 5) for s in steps],
        "seconds": round(time.perf_counter() - start, 3),
        "calibration": acceptance_report(steps),          # predicted vs observed acceptance of the tree nodes
    }


# ---------------------------------------------------------------- summary

def estimate_seconds(rows, runs: list[dict]) -> float:
    """Seconds the runs left should take: each cell's mean so far (from other prompts), else the mean run."""
    seen: dict[tuple, list[float]] = defaultdict(list)
    for r in rows:
        seen[(r["temperature"], r["policy"], r["budget"])].append(r["seconds"])
    every = [x for xs in seen.values() for x in xs]
    mean_run = sum(every) / len(every) if every else 0.0
    total = 0.0
    for run in runs:
        xs = seen.get((run["temperature"], run["policy"], run["budget"]))
        total += sum(xs) / len(xs) if xs else mean_run
    return total


def summarize(rows: list[dict]) -> dict[tuple, dict]:
    """(temperature, policy, budget) -> numbers over the prompts measured. tokens/pass: each prompt's tokens up to
    the cut over its passes, the median over prompts with its bootstrap 95% interval (tokens_per_pass_ci)."""
    cells: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        cells[(r["temperature"], r["policy"], r["budget"])].append(r)
    out = {}
    for key, rs in cells.items():
        rounds = sum(len(r["accepted"]) for r in rs)
        later = [(d, t) for r in rs for d, t in zip(r["draft_s"][1:], r["target_s"][1:])]   # first round excluded
        draft_s = sum(d for d, _ in later) / len(later) if later else float("nan")
        target_s = sum(t for _, t in later) / len(later) if later else float("nan")
        ci = _stats.median_ci([r["generated"] / r["passes"] for r in rs])
        out[key] = {
            "prompts": len(rs),
            "tokens_per_pass": ci["median"],
            "tokens_per_pass_ci": ci,
            "tree_size": sum(x for r in rs for x in r["tree_size"]) / rounds,
            "tree_depth": sum(x for r in rs for x in r["tree_depth"]) / rounds,
            "draft_s": draft_s,
            "target_s": target_s,
            "seconds_per_token": (draft_s + target_s) / ci["median"],
        }
    return out


def goal_check(summary: dict[tuple, dict], temperatures: list[float], budgets: list[int]) -> tuple[bool, list[str]]:
    """-> (met, one line per finding). Part 1: dyspec > every other policy at each budget where both ran.
    Part 2: dyspec at budget 64 >= 1.5x the best chain length measured."""
    lines, met = [], True
    for t in temperatures:
        losses, ties, wins = [], [], 0
        for b in budgets:
            d = summary.get((t, "dyspec", b))
            if d is None:
                continue
            for (t2, policy, b2), cell in summary.items():
                if t2 != t or b2 != b or policy == "dyspec":
                    continue
                other = cell["tokens_per_pass"]
                if d["tokens_per_pass"] > other + 1e-9:
                    wins += 1
                elif abs(d["tokens_per_pass"] - other) <= 1e-9:
                    ties.append(f"{policy}@{b}")
                else:
                    losses.append(f"{policy}@{b} ({other:.2f} > {d['tokens_per_pass']:.2f})")
        if wins + len(ties) + len(losses) == 0:
            lines.append(f"T={t:g}: dyspec vs others at equal budget: nothing to compare")
        else:
            ok = not losses and not ties      # "beats": a tie is not a win
            met &= ok
            detail = "".join([f"; loses to {', '.join(losses)}" if losses else "",
                              f"; ties with {', '.join(ties)}" if ties else ""])
            lines.append(f"T={t:g}: dyspec beats every other policy at equal budget: {'yes' if ok else 'NO'} "
                         f"({wins} of {wins + len(ties) + len(losses)} comparisons won{detail})")
        d64 = summary.get((t, "dyspec", GOAL_BUDGET))
        chains = {b: c["tokens_per_pass"] for (t2, p, b), c in summary.items() if t2 == t and p == "chain"}
        if d64 is None or not chains:
            lines.append(f"T={t:g}: dyspec@{GOAL_BUDGET} vs best chain: not measured")
            met = False
            continue
        best_len = max(chains, key=chains.get)
        ratio = d64["tokens_per_pass"] / chains[best_len]
        ok = ratio >= GOAL_RATIO
        met &= ok
        lines.append(f"T={t:g}: dyspec@{GOAL_BUDGET} {d64['tokens_per_pass']:.2f} tokens/pass vs best chain "
                     f"(length {best_len}) {chains[best_len]:.2f}: {ratio:.2f}x, goal >= {GOAL_RATIO}x: "
                     f"{'yes' if ok else 'NO'}")
    return met, lines


TABLE_HEADERS = ["T", "policy", "budget", "prompts", "tokens/pass [95% CI]", "tree", "depth", "draft s", "target s",
                 "s/token"]


def summary_rows(summary: dict[tuple, dict]) -> list[list[str]]:
    f = _common.fmt
    out = []
    for (t, policy, b) in sorted(summary, key=lambda k: (k[0], POLICY_ORDER.index(k[1]), k[2])):
        c = summary[(t, policy, b)]
        out.append([f"{t:g}", policy, b, c["prompts"], _stats.fmt_ci(c["tokens_per_pass_ci"], 2), f(c["tree_size"], 1),
                    f(c["tree_depth"], 1), f(c["draft_s"]), f(c["target_s"]), f(c["seconds_per_token"])])
    return out


def pivot(summary: dict[tuple, dict], t: float, budgets: list[int], chain_lengths: list[int]) -> tuple[list[str], list[list[str]]]:
    """Policy x budget -> tokens/pass, one table per temperature (chain under its lengths)."""
    columns = sorted(set(budgets) | set(chain_lengths))
    rows = []
    for policy in POLICY_ORDER:
        cells = [summary.get((t, policy, b)) for b in columns]
        if any(cells):
            rows.append([policy] + [_common.fmt(c["tokens_per_pass"], 2) if c else "" for c in cells])
    return ["policy \\ budget"] + [str(b) for b in columns], rows


def plot(summary: dict[tuple, dict], temperatures: list[float], path: str, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(temperatures), figsize=(5.5 * len(temperatures), 4.2), squeeze=False,
                             sharey=True)
    styles = {"dyspec": "o-", "heap": "s--", "static": "^:", "chain": "x-."}
    for ax, t in zip(axes[0], temperatures):
        for policy in POLICY_ORDER:
            points = sorted((b, c["tokens_per_pass"]) for (t2, p, b), c in summary.items() if t2 == t and p == policy)
            if points:
                label = "chain (budget = length)" if policy == "chain" else policy
                ax.plot([b for b, _ in points], [y for _, y in points], styles[policy], label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("tree budget (nodes)")
        ax.set_title(f"T = {t:g}")
        ax.set_ylim(bottom=0)
        ax.axhline(1.0, color="grey", lw=0.8, ls=":")      # plain autoregressive decoding: 1 token per pass
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    axes[0][0].set_ylabel("tokens per target pass")
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- main

def main(argv=None) -> int:
    args = parse_args(argv)
    started, load_at_start = time.time(), _common.load_average()
    from offspec.config import OffloadConfig, RuntimeConfig
    from offspec.demo import DEFAULT_DRAFT, DEFAULT_TARGET, ensure_demo_model
    from offspec.prompt_sets import load_prompt_set
    from offspec.load import load_engine, parse_device, parse_dtype

    device, dtype = parse_device(args.device), parse_dtype(args.dtype)
    if args.threads:
        import torch
        torch.set_num_threads(args.threads)
    target = Path(args.target) if args.target else ensure_demo_model(DEFAULT_TARGET)
    draft = Path(args.draft) if args.draft else ensure_demo_model(DEFAULT_DRAFT)
    prompts = [{"id": pid, "prompt": text} for pid, text in load_prompt_set(args.prompt_set, args.prompts)]
    runs = grid(args, [p["id"] for p in prompts])
    setup = setup_key(args, target, draft)

    if args.fresh and _common.rows_path(args.rows).exists() and not args.report_only:
        os.truncate(_common.rows_path(args.rows), 0)
    done = {run_key(setup, {k: r[k] for k in ("prompt_id", "temperature", "policy", "budget")}): r
            for r in read_rows(args.rows) if all(r.get(k) == v for k, v in setup.items())}
    todo = [run for run in runs if run_key(setup, run) not in done]
    print(f"{len(runs)} runs in the grid, {len(runs) - len(todo)} already in {args.rows}, {len(todo)} to go; "
          f"load average {load_at_start}", file=sys.stderr)

    if todo and not args.report_only:
        loaded = load_engine(target, draft, OffloadConfig(mode=args.offload), RuntimeConfig(device=device, dtype=dtype))
        engine, tokenizer = loaded.engine, loaded.tokenizer
        text_of = {p["id"]: p["prompt"] for p in prompts}
        try:
            # One short warm-up generation: first-call overheads stay out of the per-round seconds.
            measure(engine, tokenizer, prompts[0]["prompt"], {"policy": "dyspec", "budget": 8, "temperature": 0.0},
                    new_tokens=4, seed=args.seed)
            for i, run in enumerate(todo, 1):
                row = {**setup, **run, **measure(engine, tokenizer, text_of[run["prompt_id"]], run, args.new_tokens,
                                                 args.seed, ngram=setup["ngram"], calibrate=setup["calibrate"],
                                                 raw=setup["raw"])}
                row["time"] = time.strftime("%Y-%m-%dT%H:%M:%S")
                row["stamp"] = _stats.stamp()
                append_row(args.rows, row)
                done[run_key(setup, run)] = row
                tpp = row["generated"] / row["passes"]
                eta = estimate_seconds(done.values(), todo[i:])
                print(f"[{i}/{len(todo)}] {run['prompt_id']} T={run['temperature']:g} {run['policy']}@{run['budget']}: "
                      f"{tpp:.2f} tokens/pass, {row['passes']} passes, {row['seconds']:.1f} s "
                      f"(rough ETA {eta / 60:.0f} min)", file=sys.stderr)
        except KeyboardInterrupt:
            print(f"\ninterrupted: {len(done)} runs are in {args.rows}; rerun the same command to continue",
                  file=sys.stderr)
            return 130
        finally:
            engine.close()

    rows = [done[run_key(setup, run)] for run in runs if run_key(setup, run) in done]
    if not rows:
        print("no rows for this grid yet", file=sys.stderr)
        return 1
    summary = summarize(rows)
    missing = len(runs) - len(rows)
    met, goal_lines = goal_check(summary, args.temperatures, args.budgets)

    print()
    print(_common.text_table(TABLE_HEADERS, summary_rows(summary)))
    for t in args.temperatures:
        heads, prow = pivot(summary, t, args.budgets, args.chain_lengths)
        if prow:
            print(f"\ntokens per target pass, T={t:g}")
            print(_common.text_table(heads, prow))
    print()
    for line in goal_lines:
        print(line)
    print(f"goal {'met' if met else 'NOT met'}" + (f" (grid incomplete: {missing} of {len(runs)} runs missing)"
                                                   if missing else ""))

    title = (f"target {target.name}, draft {draft.name}\n{args.dtype}, {args.prompts} {SET_NAMES[args.prompt_set]} prompt(s), "
             f"{args.new_tokens} new tokens")
    if args.plot:
        plot(summary, args.temperatures, args.plot, title)
        print(f"plot: {args.plot}", file=sys.stderr)
    if args.json:
        dump = {"setup": setup, "command": _common.command_line(), "budgets": args.budgets,
                "chain_lengths": args.chain_lengths, "temperatures": args.temperatures, "prompts": args.prompts,
                "goal_met": met, "goal": goal_lines,
                "summary": [{"temperature": t, "policy": p, "budget": b, **c} for (t, p, b), c in sorted(
                    summary.items(), key=lambda kv: (kv[0][0], POLICY_ORDER.index(kv[0][1]), kv[0][2]))],
                "rows": rows}
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(dump, f, indent=1)
        os.replace(tmp, args.json)
        print(f"json: {args.json}", file=sys.stderr)
    if args.write_docs:
        write_docs(args, rows, summary, goal_lines, met, missing, len(runs), target, draft, device, started,
                   load_at_start)
    return 0


def write_docs(args, rows, summary, goal_lines, met, missing, n_runs, target, draft, device, started,
               load_at_start) -> None:
    """The section: the command and where and when its rows were measured, the setup in one paragraph, the goal's
    lines, the plot, and tokens per pass by policy and budget at each temperature (every cell's interval, tree,
    depth and seconds: the printed table and --json)."""
    def rel(path: str) -> str:
        return os.path.relpath(os.path.abspath(path), DOCS)

    table = []
    for t in args.temperatures:
        heads, prow = pivot(summary, t, args.budgets, args.chain_lengths)
        table += [[f"{t:g}", *line] for line in prow]
    parts = [
        "## Tokens per target pass vs tree budget (`scripts/bench_accept.py`)\n"
        + _common.run_header(device, started, load_at_start, rows) + "\n"
        f"Target `{target.name}`, draft `{draft.name}`, {args.dtype}, offload `{args.offload}`; {SET_NAMES[args.prompt_set]} "
        f"prompts 1–{args.prompts} ({'as they are, no chat template' if args.raw else 'chat template applied'}), "
        f"{args.new_tokens} new tokens each with EOS ignored, tokens counted up to that cut; temperatures "
        f"{', '.join(f'{t:g}' for t in args.temperatures)} (seed {args.seed}). A cell: the median over prompts of "
        f"each prompt's tokens per target pass. `chain` is classic speculative decoding, its budget its length"
        + "".join(f"; `{p}` stops at budget {n}" for p, n in args.max_budget.items()) + "."
        + (f" **Incomplete grid: {missing} of {n_runs} runs missing.**" if missing else ""),
        f"**Goal** (issue 3): `dyspec` beats every other policy at equal budget, and at budget {GOAL_BUDGET} accepts "
        f"at least {GOAL_RATIO}× the tokens per pass of the best `chain`. **{'Met' if met else 'Not met'}:**\n"
        + "\n".join(f"- {line}" for line in goal_lines),
    ]
    if table:
        parts.append(_common.markdown_table(["T", *heads], table))
    links = [f"![tokens per target pass vs tree budget]({rel(args.plot)})"] if args.plot else []
    if args.json:
        links.append(f"Every cell with its interval, tree size and seconds, and the raw rows: [{rel(args.json)}]({rel(args.json)}).")
    if links:
        parts.append("\n".join(links))
    _common.write_doc_section(args.section, "\n\n".join(parts))
    print(f"wrote section {args.section} of {_common.BENCHMARKS_MD}", file=sys.stderr)


if __name__ == "__main__":
    _common.run_main(main)
