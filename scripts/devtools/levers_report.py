#!/usr/bin/env python
"""Issue 15's table from the archived rows of the old bench_accept (one row a run): tokens per pass with the tree
levers (--ngram, --calibrate) on and off.

For each prompt set and budget (dyspec; T = 0, and each T > 0 as a set of its own), one line per lever setting:
the prompts measured, the median over prompts of tokens/pass (each prompt's tokens up to the --new-tokens cut
over its passes) with its bootstrap 95% interval, the mean tree size, and, where the setting shares prompts with
"both off", the paired ratio of medians (setting / both off, over the prompts both have) with its paired
bootstrap interval and the prompts on which the setting made fewer, more or the same tokens a pass. Then the
goals (chat: budget 64 >= 5.8, 256 >= 7.5, 1024 >= 8.5 tokens/pass; code "not below today's figures": the issue's
own table, HumanEval/0-5 without the chat template: rows of its --raw runs, the set "code, no template"), for both levers on
(the issue's) and both off (offspec's default); a goal is met when the median reaches it, and the interval says
how sure that is. The code figures' lines say how those figures were counted (GOAL_NOTES).

Example (the archived rows, docs/notes/2026-11-25-tree-levers.md says how they were run):
  python scripts/devtools/levers_report.py --rows docs/bench_accept_levers.jsonl.gz docs/bench_accept_raw.jsonl.gz --write-docs

--write-docs writes what it prints into the levers_report block of its notes entry, NOTES (the first time, a block
appended at the end: the entry's dated text, the report as it stood on 2026-11-25 included, stays as it is).
"""
from __future__ import annotations

import argparse
import sys
from collections import defaultdict
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]   # offspec, scripts/
import _common  # noqa: E402
import _stats  # noqa: E402
from offspec.bench import runner as bench  # noqa: E402

NOTES = _common.REPO / "docs" / "notes" / "2026-11-25-tree-levers.md"     # where --write-docs writes
RAW_CODE = "code, no template"
GOALS = {("chat", 64): 5.8, ("chat", 256): 7.5, ("chat", 1024): 8.5,    # issue 15, chat set, both levers on
         (RAW_CODE, 64): 15.76, (RAW_CODE, 256): 18.76}                 # its table of the code set before the levers
# Said beside a goal's line: the code figures count what bench_accept no longer counts.
GOAL_NOTES = {RAW_CODE: "the issue's figure counted the last round's tokens past the cut; the engine before the "
                        "levers gives these prompts the same rounds as today's "
                        "(docs/notes/2026-11-25-code-against-issue-15-figures.md)"}


def read_rows(path: str) -> list[dict]:
    """Rows of the bench_accept runs this report was made from (one row a run; .jsonl or .jsonl.gz), with the
    fields older rows lack set as those rows were run: HumanEval with the chat template, no levers."""
    rows = bench.read_rows(path)
    for row in rows:
        for key, value in (("prompt_set", "code"), ("raw", False), ("ngram", False), ("calibrate", False)):
            row.setdefault(key, value)
    return rows


SETTINGS = ((True, True, "both on"), (False, False, "both off"), (True, False, "n-gram only"),
            (False, True, "calibration only"))
HEADERS = ["set", "budget", "levers", "prompts", "tokens/pass [95% CI]", "tree", "vs both off [95% CI]",
           "prompts fewer / more / same"]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--rows", required=True, nargs="+", help="bench_accept rows (jsonl files)")
    p.add_argument("--new-tokens", type=int, default=96, help="only rows of runs that made this many tokens")
    p.add_argument("--write-docs", action="store_true",
                   help="also write the report into its block of its notes entry (NOTES)")
    return p.parse_args(argv)


def per_prompt(rows: list[dict], new_tokens: int) -> dict[tuple, dict[str, dict]]:
    """(prompt set, budget, ngram, calibrate) -> {prompt id: row}, dyspec only; a set run without the chat
    template (--raw) is a set of its own, and so is each temperature above 0 ("chat, T = 0.7": one seeded run a
    prompt, so its per-prompt differences include the draws')."""
    cells: dict[tuple, dict[str, dict]] = defaultdict(dict)
    for r in rows:
        if r["policy"] == "dyspec" and r["new_tokens"] == new_tokens:
            raw = bool(r.get("raw"))
            pset = RAW_CODE if (r["prompt_set"], raw) == ("code", True) else r["prompt_set"] + " (raw)" * raw
            pset += f", T = {r['temperature']:g}" * (r["temperature"] > 0)
            cells[(pset, r["budget"], bool(r["ngram"]), bool(r["calibrate"]))][r["prompt_id"]] = r
    return cells


def report(rows: list[dict], new_tokens: int) -> tuple[list[list[str]], list[str]]:
    """-> (table rows, goal lines)."""
    cells = per_prompt(rows, new_tokens)
    table, goals = [], []
    for pset, budget in sorted({(k[0], k[1]) for k in cells}):
        off = cells.get((pset, budget, False, False), {})
        for ngram, calibrate, name in SETTINGS:
            cell = cells.get((pset, budget, ngram, calibrate))
            if not cell:
                continue
            tpp = {pid: r["generated"] / r["passes"] for pid, r in cell.items()}
            ci = _stats.median_ci(list(tpp.values()))
            tree = sum(sum(r["tree_size"]) for r in cell.values()) / sum(len(r["tree_size"]) for r in cell.values())
            shared = sorted(set(tpp) & set(off))
            ratio, counts = "–", "–"
            if shared and (ngram or calibrate):
                base = {p: off[p]["generated"] / off[p]["passes"] for p in shared}
                rc = _stats.ratio_ci([tpp[p] for p in shared], [base[p] for p in shared])
                ratio = f"{_stats.fmt_ci(rc, 2, key='ratio')} ({len(shared)} prompt{'s' * (len(shared) != 1)})"
                counts = " / ".join(str(sum(compare(tpp[p], base[p]) for p in shared)) for compare in
                                    (lambda x, y: x < y, lambda x, y: x > y, lambda x, y: x == y))
            table.append([pset, str(budget), name, str(ci["n"]), _stats.fmt_ci(ci, 2), f"{tree:.0f}", ratio, counts])
            if ngram == calibrate and (pset, budget) in GOALS:
                goal = GOALS[pset, budget]
                verdict = "met" if ci["median"] >= goal else "MISSED"
                goals.append(f"{pset}, budget {budget}, {name}: median {ci['median']:.2f} tokens/pass [{ci['low']:.2f}, "
                             f"{ci['high']:.2f}] over {ci['n']} prompts vs goal {goal}: {verdict} "
                             f"({ci['median'] - goal:+.2f}, {ci['median'] / goal:.0%} of the goal)"
                             + (f"; {GOAL_NOTES[pset]}" if pset in GOAL_NOTES else ""))
    return table, goals


def main(argv=None) -> int:
    args = parse_args(argv)
    rows = [row for path in args.rows for row in read_rows(path)]
    table, goals = report(rows, args.new_tokens)
    if not table:
        print(f"no dyspec rows with {args.new_tokens} new tokens in {args.rows}", file=sys.stderr)
        return 1
    text = "\n".join([f"`{_common.command_line()}`:", "", _common.markdown_table(HEADERS, table), "",
                      *(f"- {line}" for line in goals), "", _common.measured_line(rows)])
    print(text)
    if args.write_docs:
        _common.write_doc_section("levers_report", text, path=NOTES)
    return 0


if __name__ == "__main__":
    sys.exit(main())
