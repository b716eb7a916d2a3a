#!/usr/bin/env python3
"""Drafts and trees compared: one draft's tokens per target pass against another's for the same target (the
target's own twin, `--draft self`, against a separate small draft), Sequoia's tree against dyspec's at an equal
budget; rendered from the rows scripts/bench_accept.py measured (no model is loaded).

A comparison is a ratio of two cells, numerator over denominator, each a system in a rows file: the median over
the prompts both cells measured (paired by prompt, temperature and seed) of each side, and the ratio of those
medians with a paired bootstrap 95% interval (offspec.bench.runner.ratio_ci). The two cells must share the
target, the prompt set, the new tokens and the dtype, or the comparison is refused: their prompts would not be the
same question. A cell whose rows file or system is missing is listed as not measured, so the section shows what
the grid still lacks.

GRID is the published set, each entry what its ratio answers; `--write-docs` writes the bench_drafts section of
docs/benchmarks.md from it:

  python scripts/render_drafts.py --write-docs
  python scripts/render_drafts.py --compare docs/bench_accept/self-chat.jsonl:dyspec-64 \\
      docs/bench_accept/small-chat.jsonl:dyspec-64          # any two cells, printed
"""
from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "scripts")]   # this checkout's offspec, not an installed one

import _common  # noqa: E402
import bench_accept  # noqa: E402

from offspec.bench import runner as bench  # noqa: E402
from offspec.errors import InputError  # noqa: E402

SECTION = "bench_drafts"
ROWS = ROOT / "docs" / "bench_accept"
MUST_MATCH = ("prompt_set", "new_tokens", "dtype")   # settings both cells of a comparison share (and the target)


@dataclass(frozen=True)
class Cell:
    """A system's runs at one temperature in a rows file (a path relative to docs/bench_accept, or any path)."""
    rows: str
    system: str
    temperature: float = 0.0


@dataclass(frozen=True)
class Compare:
    """num / den in tokens per target pass; `what` names the ratio in the table (e.g. "twin / 0.5B")."""
    what: str
    num: Cell
    den: Cell


def _twin(rows: str, system: str, small: str) -> Compare:
    return Compare("twin / 0.5B", Cell(rows, system), Cell(small, system))


def _trees(rows: str, budget: int, what: str = "sequoia / dyspec", den_rows: Optional[str] = None,
           temperature: float = 0.0) -> Compare:
    return Compare(what, Cell(rows, f"sequoia-{budget}", temperature),
                   Cell(den_rows or rows, f"dyspec-{budget}", temperature))


GRID = (
    # The demo target (Qwen2.5-Coder-1.5B-Instruct) drafting for itself (its int4 twin) against the demo's 0.5B draft.
    # 64 new tokens; code also 256 (at 64 the twin finishes most prompts in 2 passes, the measurement's ceiling).
    *(_twin("self-chat.jsonl", f"dyspec-{b}", "small-chat.jsonl") for b in (64, 256)),
    _twin("self-code.jsonl", "dyspec-64", "small-code.jsonl"),
    _twin("self-code-256.jsonl", "dyspec-64", "small-code-256.jsonl"),
    _twin("self-g32-code-256.jsonl", "dyspec-256", "small-code-256.jsonl"),
    *(_twin(f"self{g}-chat-1024.jsonl", "dyspec-1024", "small-chat-1024.jsonl") for g in ("", "-g32")),
    _twin("self-g32-code-1024.jsonl", "dyspec-1024", "small-code-1024.jsonl"),
    # ... and the twin with Sequoia's tree against the 0.5B with dyspec, its default.
    *(Compare("twin with sequoia / 0.5B with dyspec", Cell(rows, f"sequoia-{b}"), Cell(small, f"dyspec-{b}"))
      for rows, small, b in (("sequoia-self-chat.jsonl", "small-chat.jsonl", 64),
                             ("sequoia-self-chat-256.jsonl", "small-chat.jsonl", 256),
                             ("self-code-256.jsonl", "small-code-256.jsonl", 64),
                             ("self-chat-1024.jsonl", "small-chat-1024.jsonl", 1024))),
    # The twin in groups of 32 (the default since 2026-11-29: its own pair's vector, learned on these code prompts
    # and then on chat) with Sequoia against the 0.5B with dyspec.
    *(Compare("twin g32 with sequoia / 0.5B with dyspec", Cell(f"self-g32-{rows}", f"sequoia-{b}"),
              Cell(f"small-{rows}", f"dyspec-{b}"))
      for rows, b in (("chat-256.jsonl", 64), ("code-256.jsonl", 64), ("code-256.jsonl", 256),
                      ("chat-1024.jsonl", 1024), ("code-1024.jsonl", 1024))),
    # ... and on chat at 64 new tokens, both trees at budgets 64 and 256 (Sequoia's vector: the one learned on code
    # at 256 new tokens, frozen).
    *(Compare(f"twin g32{w} / 0.5B with dyspec", Cell("self-g32-chat.jsonl", f"{t}-{b}"),
              Cell("small-chat.jsonl", f"dyspec-{b}")) for t, w in (("dyspec", ""), ("sequoia", " with sequoia"))
      for b in (64, 256)),
    # Sampled (T = 0.6, seed 0), chat at 64 new tokens: each twin (Sequoia's vector learned on these prompts)
    # against the 0.5B with dyspec, measured alike.
    *(Compare(f"twin{g}{w} / 0.5B with dyspec", Cell(rows, f"{t}-64", 0.6),
              Cell("sampled-small-chat.jsonl", "dyspec-64", 0.6))
      for rows, g in (("sampled-self-g32-chat.jsonl", " g32"), ("sampled-self-chat.jsonl", ""))
      for t, w in (("dyspec", ""), ("sequoia", " with sequoia"))),
    # ... and at 256 new tokens (the 64-token cells are counts of passes), the twin with Sequoia alone.
    Compare("twin g32 with sequoia / 0.5B with dyspec", Cell("sampled-self-g32-chat-256.jsonl", "sequoia-64", 0.6),
            Cell("sampled-small-chat-256.jsonl", "dyspec-64", 0.6)),
    # The same rows again from the sampling vector the first run learned (on these prompts), over that first run
    # (from the prior): what a pair's cold start costs.
    Compare("twin g32 with sequoia, vector warm / cold", Cell("sampled-self-g32-chat-warm.jsonl", "sequoia-64", 0.6),
            Cell("sampled-self-g32-chat.jsonl", "sequoia-64", 0.6)),
    # ... and from no sampling vector but seeded by the pair's greedy one (how a new pair's sampled rows start now).
    *(Compare(f"twin g32 with sequoia, no sampling vector: seeded by greedy / the prior{what}",
              Cell(seeded, "sequoia-64", t), Cell(prior, "sequoia-64", t))
      for seeded, prior, what, t in (
          ("sampled-self-g32-chat-seeded.jsonl", "sampled-self-g32-chat.jsonl", "", 0.6),
          ("sampled-self-g32-chat-seed1-seeded.jsonl", "sampled-self-g32-chat-seed1-prior.jsonl", " (seed 1)", 0.6),
          ("sampled-self-g32-chat-t1-seeded.jsonl", "sampled-self-g32-chat-t1-prior.jsonl", "", 1.0),
          ("sampled-self-g32-chat-t1-seed1-seeded.jsonl", "sampled-self-g32-chat-t1-seed1-prior.jsonl", " (seed 1)",
           1.0))),
    # At T = 1, seeded rows over rows starting from a sampling vector (plus the seed): the one learned at T = 0.6,
    # and the one the seeded rows left (learned at T = 1, on these prompts).
    *(Compare(f"twin g32 with sequoia: seeded by greedy / sampling vector learned at {what}",
              Cell(seeded, "sequoia-64", 1.0), Cell(rows, "sequoia-64", 1.0))
      for seeded, rows, what in (
          ("sampled-self-g32-chat-t1-seeded.jsonl", "sampled-self-g32-chat-t1-learned.jsonl", "T = 0.6"),
          ("sampled-self-g32-chat-t1-seed1-seeded.jsonl", "sampled-self-g32-chat-t1-seed1-learned.jsonl",
           "T = 0.6 (seed 1)"),
          ("sampled-self-g32-chat-t1-seeded.jsonl", "sampled-self-g32-chat-t1-warm.jsonl",
           "T = 1 (on these prompts)"))),
    # A new pair's first greedy run (no vector cached): its rows starting from what the engine's earlier rows
    # observed, over every row starting from the prior (how greedy rows started before they learned from earlier ones).
    Compare("twin g32 with sequoia, first run: rows learn / each from the prior",
            Cell("cold-learning-self-g32-chat.jsonl", "sequoia-64"), Cell("cold-self-g32-chat.jsonl", "sequoia-64")),
    # The same system, the twin in groups of 32 over groups of 64 (each with its own pair's vector), at T.
    *(Compare("twin g32 / twin g64", Cell(g32, system, t), Cell(g64, system, t)) for g32, g64, system, t in (
        *(("sampled-self-g32-chat.jsonl", "sampled-self-chat.jsonl", s, 0.6) for s in ("dyspec-64", "sequoia-64")),
        ("self-g32-chat-256.jsonl", "self-chat-256.jsonl", "sequoia-64", 0.0),
        ("self-g32-code-256.jsonl", "self-code-256.jsonl", "sequoia-64", 0.0),
        ("self-g32-chat.jsonl", "self-chat.jsonl", "dyspec-64", 0.0),
        ("self-g32-chat.jsonl", "self-chat.jsonl", "dyspec-256", 0.0),
        ("self-g32-chat.jsonl", "sequoia-self-chat.jsonl", "sequoia-64", 0.0),
        ("self-g32-chat.jsonl", "sequoia-self-chat-256.jsonl", "sequoia-256", 0.0),
        *(("self-g32-chat-1024.jsonl", "self-chat-1024.jsonl", f"{t}-1024", 0.0) for t in ("dyspec", "sequoia")))),
    # The twin's Sequoia tree allowed 64 levels against the default 32: the same budget and frozen vector.
    *(Compare("depth 64 / depth 32 (twin g32 with sequoia)", Cell(f"self-g32-{s}-256-depth64.jsonl", "sequoia-64"),
              Cell(f"self-g32-{s}-256.jsonl", "sequoia-64")) for s in ("chat", "code")),
    # Sequoia's tree against dyspec at an equal budget, each label naming where Sequoia's vector was learned: the
    # demo target's twin (greedy and sampled), the 0.5B, SmolLM2-135M's twin (held int8 in the first line, int4 in
    # the others); and the twin's chain of 32 (classic speculative decoding) against dyspec's 64-node tree.
    *(_trees(rows, b, "sequoia / dyspec (twin g32, vector from code)")
      for rows, b in (("self-g32-chat.jsonl", 64), ("self-g32-chat.jsonl", 256), ("self-g32-chat-1024.jsonl", 1024))),
    *(_trees(rows, b, "sequoia / dyspec (twin g32, vector learned on these prompts)")
      for rows, b in (("self-g32-code-256.jsonl", 256), ("self-g32-code-1024.jsonl", 1024))),
    _trees("sequoia-self-chat.jsonl", 64, "sequoia / dyspec (vector from code)", den_rows="self-chat.jsonl"),
    _trees("sequoia-self-chat-256.jsonl", 256, "sequoia / dyspec (vector from code and these prompts)",
           den_rows="self-chat.jsonl"),
    _trees("self-code-256.jsonl", 64, "sequoia / dyspec (vector from code and chat)"),
    _trees("self-chat-1024.jsonl", 1024, "sequoia / dyspec (vector from code and chat)"),
    _trees("sampled-self-g32-chat.jsonl", 64, "sequoia / dyspec (twin g32, vector learned on these prompts)",
           temperature=0.6),
    _trees("sampled-self-chat.jsonl", 64, "sequoia / dyspec (vector learned on these prompts)", temperature=0.6),
    Compare("chain-32 / dyspec-64", Cell("chain-self-chat.jsonl", "chain-32"), Cell("self-chat.jsonl", "dyspec-64")),
    _trees("sequoia-small-chat.jsonl", 64, "sequoia / dyspec (vector from code)"),
    _trees("sequoia-small-chat-recalibrated.jsonl", 64, "sequoia / dyspec (vector from chat)",
           den_rows="sequoia-small-chat.jsonl"),
    _trees("sequoia-small-chat-256.jsonl", 256, "sequoia / dyspec (vector from chat)", den_rows="small-chat.jsonl"),
    _trees("small-code-256.jsonl", 64, "sequoia / dyspec (vector from chat)"),
    _trees("small-chat-1024.jsonl", 1024, "sequoia / dyspec (vector from the prior, learned on these prompts)"),
    _trees("small-code-1024.jsonl", 1024, "sequoia / dyspec (vector from chat)"),
    _trees("sequoia-smollm2-chat.jsonl", 64, "sequoia / dyspec (int8 twin)"),
    *(_trees("calibrated-smollm2-chat.jsonl", b, "sequoia / dyspec (both calibrated)") for b in (64, 256)),
    *(_trees("self-smollm2-code.jsonl", b) for b in (64, 256)),
    # dyspec with --calibrate, its rows starting from the pair's calibration cache (learned on the first 8 code
    # prompts), against dyspec's raw draft probabilities.
    *(Compare("calibrated dyspec (from code) / dyspec", Cell("calibrated-small-chat.jsonl", f"dyspec-{b}"),
              Cell("small-chat.jsonl", f"dyspec-{b}")) for b in (64, 256)),
)
HEADERS = ["ratio", "target", "prompts", "new tokens", "T", "numerator", "denominator", "ratio [95% CI]",
           "prompts paired", "rows (docs/bench_accept/)"]


def rows_path(rows: str) -> Path:
    """`rows`: a path, or a name under docs/bench_accept."""
    return Path(rows) if Path(rows).is_absolute() or bench.rows_file(rows).exists() else ROWS / rows


@functools.lru_cache(maxsize=None)
def stored_rows(rows: str) -> tuple:
    """A rows file's rows as measured, each run its own (stamp, command); () when the file does not exist."""
    path = rows_path(rows)
    return tuple(r for r in bench.read_rows(path) if "systems" in r) if bench.rows_file(path).exists() else ()


@functools.lru_cache(maxsize=None)
def file_rows(rows: str) -> tuple:
    """The file's rows merged by prompt (bench_accept.merged_rows: a later run's systems added to a prompt's)."""
    return tuple(bench_accept.merged_rows(list(stored_rows(rows)))) if stored_rows(rows) else ()


def cell_values(cell: Cell) -> dict:
    """{(prompt set, id, seed, temperature): the cell's tokens per pass} over the prompts its file measured."""
    return {(r["prompt_set"], *bench.row_key(r)): r["systems"][cell.system]["tokens_per_pass"]
            for r in file_rows(cell.rows) if cell.system in r["systems"] and r["temperature"] == cell.temperature}


def settings_of(cell: Cell) -> dict:
    rows = file_rows(cell.rows)
    return {**rows[0]["settings"], "prompt_set": rows[0]["prompt_set"]} if rows else {}


def compared(c: Compare) -> dict:
    """Both sides' values over the prompts both measured ({"num", "den"}), and the setting they share; where one
    side has no rows, the other's values over all its prompts (shown unpaired, with no ratio)."""
    a, b = cell_values(c.num), cell_values(c.den)
    s, t = settings_of(c.num), settings_of(c.den)
    if a and b:
        differ = [k for k in MUST_MATCH if s.get(k) != t.get(k)] + ["target"] * (s["models"][0] != t["models"][0])
        differ += ["temperature"] * (c.num.temperature != c.den.temperature)
        if differ:
            raise InputError(f"{c.num.rows}:{c.num.system} and {c.den.rows}:{c.den.system} differ in "
                             f"{', '.join(differ)}: not one question")
    if not a or not b:
        return {"num": list(a.values()), "den": list(b.values()), "settings": s or t}
    keys = [k for k in a if k in b]
    return {"num": [a[k] for k in keys], "den": [b[k] for k in keys], "settings": s or t}


def draft_name(cell: Cell) -> str:
    """The cell's draft as its rows name it: "twin" for `--draft self`, and the held form(s) the plan chose where the
    rows record it."""
    rows = file_rows(cell.rows)
    if not rows:
        return "–"
    name, group = rows[0]["settings"]["models"][1], rows[0]["settings"].get("int4_group")
    held = sorted({f"{q} g{group}" if q == "int4" and group else q for r in rows if (q := r.get("draft_quant"))})
    return " ".join(["twin" if name == "self" else name, *held])


def side_text(cell: Cell, vals: list, paired: bool = True) -> str:
    figure = bench.fmt_ci(bench.median_ci(vals), 2) if vals else "not measured"
    figure += "" if paired or not vals else f" ({len(vals)} prompt{'s' * (len(vals) != 1)}, unpaired)"
    depth = settings_of(cell).get("max_depth")          # recorded only where it is not the default
    return f"{draft_name(cell)}, {cell.system}{f' (depth {depth})' if depth else ''}: {figure}"


def table_line(c: Compare, got: dict) -> list[str]:
    s = got["settings"]
    paired = bool(got["num"]) and bool(got["den"])
    ratio = bench.ratio_ci(got["num"], got["den"]) if paired else None
    files = " / ".join(dict.fromkeys((c.num.rows, c.den.rows)))
    return [c.what, f"`{s['models'][0]}`" if s else "–", bench_accept.SET_NAMES.get(s.get("prompt_set"), "–"),
            str(s.get("new_tokens", "–")), f"{c.num.temperature:g}", side_text(c.num, got["num"], paired),
            side_text(c.den, got["den"], paired),
            bench.fmt_ci(ratio, 2, "ratio", "x") if ratio else "not measured", str(len(got["num"]) * paired), files]


def render(grid) -> tuple[list[list[str]], list[dict]]:
    """The table's lines, and every row of the files they read (each file once)."""
    lines = [table_line(c, compared(c)) for c in grid]
    files = dict.fromkeys(cell.rows for c in grid for cell in (c.num, c.den))
    return lines, [r for f in files for r in stored_rows(f)]


def section(lines: list[list[str]], rows: list[dict]) -> str:
    commands = sorted({_common.relative_command(r["command"]) for r in rows if r.get("command")})
    dtypes = sorted({r["settings"]["dtype"] for r in rows})
    return "\n".join([
        f"## Drafts and trees compared (`scripts/{Path(__file__).name}`)",
        "",
        "Each line: a ratio of two cells of scripts/bench_accept.py's rows, numerator over denominator, each the "
        "median over the prompts both cells measured (paired by prompt) with its bootstrap 95% interval, and the "
        "ratio of those medians with a paired bootstrap interval. The cells of one line share the target, the "
        f"prompts, the new tokens (EOS ignored), the temperature (T; 0: greedy) and the dtype ({', '.join(dtypes)}). "
        "The twin is the "
        "target's own layers held in 4-bit groups (`--draft self`; \"int4 g32\": groups of 32, the default since "
        "2026-11-29; plain \"int4\", measured before, a dense target's groups of 64 and a GGUF's own 32), the 0.5B "
        "the demo's separate draft held int8; "
        "tokens a pass do not depend on the machine's speed. At 64 new tokens a cell is a count of passes (64/2 = "
        "32, 64/3 = 21.33): a twin that finishes in 2 passes is at the measurement's ceiling (the 256-token lines "
        "are for that). Sequoia's acceptance vector is the pair's cache when the line was measured (its notes: "
        "docs/notes/). A line marked not measured is a cell the grid still lacks.",
        "",
        "Rendered by:",
        "```",
        "python scripts/render_drafts.py --write-docs",
        "```",
        "Measured by:",
        "```",
        *commands,
        "```",
        _common.measured_line(rows),
        "",
        _common.markdown_table(HEADERS, lines),
    ])


def parse_cell(text: str, temperature: float = 0.0) -> Cell:
    """A --compare cell, FILE:SYSTEM; its file must exist (a system the file lacks is shown as not measured)."""
    rows, sep, system = text.rpartition(":")
    if not sep or not rows or not system:
        raise InputError(f"--compare takes FILE:SYSTEM cells, got {text!r}")
    if not bench.rows_file(rows_path(rows)).exists():
        raise InputError(f"--compare: no rows file {rows!r}")
    return Cell(rows, system, temperature)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--compare", nargs=2, metavar=("NUM", "DEN"),
                   help="render one comparison of two FILE:SYSTEM cells instead of the published grid")
    p.add_argument("--temperature", type=float, default=0.0, help="--compare: both cells' temperature (0: greedy)")
    p.add_argument("--write-docs", action="store_true", help=f"write the {SECTION} section of docs/benchmarks.md")
    args = p.parse_args(argv)
    if args.compare and args.write_docs:
        p.error("--write-docs writes the published grid; --compare prints one comparison")
    grid = ((Compare("num / den", *(parse_cell(cell, args.temperature) for cell in args.compare)),)
            if args.compare else GRID)
    lines, rows = render(grid)
    print(_common.text_table(HEADERS, lines))
    if args.write_docs:
        _common.write_doc_section(SECTION, section(lines, rows))
        print(f"wrote section {SECTION} of {_common.BENCHMARKS_MD}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    _common.run_main(main)
