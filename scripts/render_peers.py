#!/usr/bin/env python3
"""The peer comparison's tables, rendered from the rows scripts/bench_peers.py measured (no model is loaded).

Per group (regime, prompt set, where offspec's target lay; a GPU's rows apart from a CPU's): each system's median
s/token over prompts with a bootstrap 95% interval, its speedup over hf-assisted and over offspec's plain decoding
(`none`) with paired bootstrap intervals, tokens per target pass, and how many prompts gave plain greedy's tokens.
Then, per group, whether offspec's default is within 5% of the best fixed policy measured there (DEFAULT_MARGIN),
and what the peer ran, as transformers read it back.

The README's headline shows what a user gets: offspec's default against the peer, one line per group, except a
streamed emulation (host RAM on a CPU-only machine with --offload cpu: every layer copied each pass on the cores
that compute, which no CPU user runs) wherever the same prompt set was measured as a CPU user runs it
(bench_peers.py --offload auto); the emulation stays on docs/benchmarks.md, labelled, as an ablation.

  python scripts/render_peers.py --rows docs/bench_peers/{disk,cpu}-*.jsonl --sweep docs/bench_peers/sweep-*.jsonl \\
      --write-docs
writes the bench_peers and bench_peers_sweep sections of docs/benchmarks.md and the benchmark block of README.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path
from typing import Sequence

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402
import _stats  # noqa: E402
import bench_peers  # noqa: E402

from offspec.bench import runner as bench  # noqa: E402

DEFAULT_MARGIN = 1.05    # the default's median s/token may be at most this times the best fixed policy's
README = ROOT / "README.md"


def group_key(row: dict) -> tuple:
    """(regime, prompt set, GPU or "", offload): offload is bench_peers' --offload, the regime where rows lack it
    (the layers streamed from where the regime keeps them)."""
    return row["regime"], row["prompt_set"], row.get("gpu") or "", row.get("settings", {}).get("offload", row["regime"])


def groups_of(rows: list[dict]) -> dict[tuple, list[dict]]:
    """Timing rows by group_key, disk before cpu, a streamed emulation after the run it emulates; a later row for
    the same prompt wins."""
    groups: dict[tuple, dict] = {}
    for r in rows:
        if r.get("kind") is None and "systems" in r:
            groups.setdefault(group_key(r), {})[r["id"]] = r
    order = {"disk": 0, "cpu": 1}
    return {k: list(groups[k].values())
            for k in sorted(groups, key=lambda k: (order.get(k[0], 2), k[1], k[2], emulation(k), k[3]))}


def emulation(key: tuple) -> bool:
    """A streamed emulation: host RAM on a CPU-only machine with the layers streamed (--offload cpu), copied each
    pass on the cores that compute. A CPU user runs the default, the target left where it lies."""
    regime, _, gpu, offload = key
    return regime == "cpu" and not gpu and offload == "cpu"


def group_checks(rows_by_file: list[list[dict]]) -> dict[tuple, dict]:
    """Each group's float32 rechecks {prompt id: check row}, from the rows files holding the group's timing rows: a
    recheck row names its prompt alone, and groups of two regimes share their prompts' ids."""
    checks: dict[tuple, dict] = {}
    for rows in rows_by_file:
        found = bench_peers.rechecks(rows)
        for key in groups_of(rows):
            checks.setdefault(key, {}).update(found)
    return checks


def regime_title(regime: str, prompt_set: str, gpu: str = "") -> str:
    return f"{'cold disk' if regime == 'disk' else 'host RAM'}, {prompt_set}" + (f", {gpu}" if gpu else "")


def group_title(key: tuple) -> str:
    regime, prompt_set, gpu, offload = key
    title = regime_title(regime, prompt_set, gpu)
    if emulation(key):
        return f"{title}, streamed emulation (--offload cpu)"
    return title if offload == regime or (offload == "auto" and not gpu) else f"{title}, --offload {offload}"


def headline_groups(keys) -> list[tuple]:
    """The groups the README's headline shows: each but a streamed emulation whose prompt set was also measured as
    a CPU user runs it (--offload auto)."""
    keys = list(keys)
    run = {(k[0], k[1], k[2]) for k in keys if k[3] == "auto"}
    return [k for k in keys if not (emulation(k) and (k[0], k[1], k[2]) in run)]


def fixed_policies(systems) -> list[str]:
    """The systems that are a policy at a fixed budget (chain-8, dyspec-16)."""
    return [s for s in systems if s.rpartition("-")[0] in bench.POLICIES]


def default_check(rows: list[dict]) -> dict | None:
    """{"best", "ratio": default / best fixed policy's s/token over the prompts both ran (paired CI), "same": the
    best policy's rounds were the default's on every prompt, "ok": its median within DEFAULT_MARGIN, or the
    same rounds (the default is that policy there: what is left is two runs' spread)}; None where the group ran
    no default or no fixed policy."""
    systems = set.intersection(*(set(r["systems"]) for r in rows))
    fixed = fixed_policies(sorted(systems))
    if bench.DEFAULT not in systems or not fixed:
        return None
    medians = {s: statistics.median(r["systems"][s]["seconds_per_token"] for r in rows) for s in fixed}
    best = min(medians, key=medians.get)
    ratio = bench.ratio_ci([r["systems"][bench.DEFAULT]["seconds_per_token"] for r in rows],
                           [r["systems"][best]["seconds_per_token"] for r in rows])
    same = all(same_rounds(r["systems"][bench.DEFAULT], r["systems"][best]) for r in rows)
    return {"best": best, "ratio": ratio, "same": same, "ok": ratio["ratio"] <= DEFAULT_MARGIN or same}


def same_rounds(a: dict, b: dict) -> bool:
    """Two cells ran the same rounds: the same tokens, passes and mean tree size."""
    return all(k in a and k in b and a[k] == b[k] for k in ("tokens", "passes", "mean_tree_size"))


def identity(rows: list[dict], checks: dict) -> dict:
    counts = {"identical": 0, "rounding": 0, "fail": 0, "unchecked": 0}
    fp32 = rows[0]["settings"]["dtype"] == "float32"
    for r in rows:
        counts[bench_peers.verdict(r, checks, fp32)] += 1
    return counts


def identity_text(counts: dict, n: int) -> str:
    parts = [f"{counts['identical']}/{n} identical"]
    if counts["rounding"]:
        n = counts["rounding"]
        parts.append(f"{n} {'differs' if n == 1 else 'differ'} in bf16, identical in float32 (rechecked)")
    if counts["unchecked"]:
        parts.append(f"{counts['unchecked']} differ, not yet rechecked in float32")
    if counts["fail"]:
        parts.append(f"**{counts['fail']} FAIL** (differ in float32)")
    return "; ".join(parts)


def peer_text(rows: list[dict]) -> str:
    """What hf-assisted ran, as transformers read it back (every row's first run)."""
    used = {tuple(sorted(r["systems"]["hf-assisted"]["peer_settings"].items()))
            for r in rows if "peer_settings" in r["systems"].get("hf-assisted", {})}
    if not used:
        return "no hf-assisted cells"
    texts = []
    for settings in sorted(used):
        s = dict(settings)
        texts.append(f"{s['num_assistant_tokens']} draft tokens a pass, schedule {s['num_assistant_tokens_schedule']}, "
                     f"confidence threshold {s['assistant_confidence_threshold']:g} (transformers {s['transformers']})")
    return "; ".join(texts)


def group_table(key: tuple, rows: list[dict], checks: dict) -> tuple[list[str], dict]:
    """Markdown rows of one group and its facts for the text under the table."""
    vs_plain = {s["system"]: s for s in bench.summarize(rows, bench.PLAIN)}
    vs_peer = {s["system"]: s for s in bench.summarize(rows, "hf-assisted")} if "hf-assisted" in vs_plain else {}
    lines = []
    for name, s in vs_plain.items():
        peer = vs_peer.get(name, {}).get("speedup") if name != "hf-assisted" else None
        plain = s["speedup"] if name != bench.PLAIN else None
        same = "-" if s["identical"] is None else f"{s['identical']}/{s['paired']}"
        lines.append(f"| {group_title(key)} | {name} | {_stats.fmt_ci(s['seconds_per_token'])} | "
                     f"{_stats.fmt_ci(peer, 2, 'ratio', 'x')} | {_stats.fmt_ci(plain, 2, 'ratio', 'x')} | "
                     f"{s['tokens_per_pass']:.2f} | {same} |")
    facts = {"check": default_check(rows), "identity": identity(rows, checks), "n": len(rows),
             "peer": peer_text(rows), "default": vs_plain.get(bench.DEFAULT), "vs_peer": vs_peer.get(bench.DEFAULT)}
    return lines, facts


HEADER = ("| group | system | s/token [95% CI] | speedup over hf-assisted | speedup over none | tokens/pass | "
          "same tokens as none |\n|---|---|---|---|---|---|---|")


def render(rows_by_file: list[list[dict]], files: list[str], sweep_files: Sequence[str] = ()) -> tuple[str, str]:
    """(the docs section, the README block) from each rows file's rows; sweep_files: the sweep's rows files,
    named in the rendering command."""
    groups = groups_of([r for rows in rows_by_file for r in rows])
    checks = group_checks(rows_by_file)
    table, notes, headline = [HEADER], [], []
    shown = headline_groups(groups)
    several_machines = len({machine_of(groups[k]) for k in shown}) > 1
    for key, group in groups.items():
        lines, facts = group_table(key, group, checks.get(key, {}))
        table += lines
        check = facts["check"]
        judged = ("" if check is None else
                  f" Default against the best fixed policy here ({check['best']}): "
                  f"{_stats.fmt_ci(check['ratio'], 2, 'ratio', 'x')} its s/token, "
                  + ("within 5%." if check["ratio"]["ratio"] <= DEFAULT_MARGIN else
                     f"its rounds were {check['best']}'s on every prompt (the same tokens, passes and trees: the "
                     "default is that policy here), so the gap is two runs' spread on this machine." if check["same"]
                     else "**more than 5% slower**."))
        modes = sorted({r["offload_mode"] for r in group if "offload_mode" in r})
        placed = f" offspec's --offload {key[3]} ran {' and '.join(modes)}." if key[3] == "auto" and modes else ""
        notes.append(f"- {group_title(key)} ({facts['n']} prompts): tokens {identity_text(facts['identity'], facts['n'])}."
                     f"{placed} hf-assisted ran {facts['peer']}.{judged}")
        if facts["vs_peer"] is not None and key in shown:
            where = f" {machine_of(group)} |" if several_machines else ""
            headline.append(f"| {group_title(key)} |{where} {_stats.fmt_ci(facts['default']['seconds_per_token'])} | "
                            f"{_stats.fmt_ci(facts['vs_peer']['speedup'], 2, 'ratio', 'x')} | "
                            f"{_stats.fmt_ci(facts['default']['speedup'], 2, 'ratio', 'x')} |")
    s0 = next(iter(groups.values()))[0]["settings"]
    sweep = f" --sweep {' '.join(sweep_files)}" if sweep_files else ""
    command = f"python scripts/render_peers.py --rows {' '.join(files)}{sweep} --write-docs"
    section = "\n".join([
        "## offspec against transformers + accelerate, and against its own ablations (`scripts/bench_peers.py`)", "",
        "Each row: one system over the group's prompts, greedy, at most "
        f"{s0['new_tokens']} new tokens ({s0['stop']}), {s0['dtype']}, {s0['repeats']} timed run(s) per prompt, "
        "systems interleaved per prompt. `default` is offspec as `offspec generate` runs: with no `--offload` in "
        "the host-RAM groups (on a CPU the target is left where it lies and computed there, as a CPU user runs it), "
        "with `--offload disk` on a cold disk; a streamed emulation group ran it with `--offload cpu`, every layer "
        "copied each pass on the cores that compute (an ablation: what streaming costs where there is no link to "
        "hide it behind). `none`, `chain-8` and `dyspec-16` are the same engine with one tree setting changed. "
        "hf-assisted is transformers' assisted generation at the best setting of its own sweep "
        "(`scripts/peer_hf.py`); hf-plain is transformers' generate without it.", "",
        "Measured by:", "```",
        *sorted({_common.relative_command(r["command"]) for g in groups.values() for r in g if "command" in r}), "```",
        f"Rendered by `{command}`. " + _common.measured_line([r for g in groups.values() for r in g]), "",
        *table, "", *notes])
    machines = "the machine each row names" if several_machines else "; ".join(sorted({machine_of(g)
                                                                                       for g in groups.values()}))
    counts = sorted({len(g) for g in groups.values()})
    readme = "\n".join([
        f"Measured on {machines}, models {' and '.join(s0.get('models', ['?']))}, greedy, up to "
        f"{s0['new_tokens']} new tokens, {' or '.join(map(str, counts))} prompts per group; medians with bootstrap "
        "95% intervals ([docs/benchmarks.md](docs/benchmarks.md)):", "",
        "| group |" + " measured on |" * several_machines
        + " offspec s/token | speedup over transformers assisted | speedup over plain decoding |",
        "|---|" + "---|" * several_machines + "---|---|---|", *headline, "", *headline_note(groups, shown),
        f"Command: `{command}`"])
    return section, readme


def machine_of(rows: list[dict]) -> str:
    """The machine(s) a group's rows were measured on, as their stamps name them."""
    return "; ".join(sorted({r["stamp"]["machine"] for r in rows if "stamp" in r})) or "?"


def headline_note(groups: dict, shown: list[tuple]) -> list[str]:
    """What the headline's host-RAM rows ran, when it shows any: a line and a blank line, else nothing."""
    host = [k for k in shown if k[0] == "cpu" and not k[2]]
    if not host:
        return []
    if any(emulation(k) for k in host):
        text = ("A streamed emulation row ran offspec with `--offload cpu` on a CPU: every layer copied each pass on "
                "the cores that compute, which a CPU user does not run.")
    else:
        text = ("Host RAM on a CPU: offspec as a CPU user runs it, with no `--offload` (the target computed where it "
                "lies)")
        if any(emulation(k) for k in groups):
            text += "; the streamed emulation (`--offload cpu`) is an ablation on docs/benchmarks.md"
        text += "."
    return [text + " Plain decoding is offspec's own (`--tree none`) in the same placement; a speedup over it below 1x "
            "means `--tree none` was the faster choice on that machine.", ""]


def sweep_command(rows: list[dict], path: str) -> str:
    """The command that makes one sweep rows file: as its rows stored it, or, for rows made before they stored
    one (by the earlier bench_peers.py), peer_hf.py's at the settings the rows record."""
    stored = {_common.relative_command(r["command"]) for r in rows if "command" in r}
    if stored:
        return "\n".join(sorted(stored))
    r, prompts = rows[0], len({x["id"] for x in rows})
    options = [f"--regime {r['regime']}", f"--prompt-set {r['prompt_set']}", f"--prompts {prompts}"]
    options += [f"--new-tokens {r['new_tokens']}"] * (r["new_tokens"] != 64)
    options += [f"--repeats {r['settings']['repeats']}"] * (r["settings"].get("repeats", 1) != 1)
    return " ".join(["python scripts/peer_hf.py", *options, f"--rows {path}"])


def sweep_section(rows_by_file: list[list[dict]], files: list[str]) -> str:
    """The peer's sweep: each setting's median s/token [95% CI] per (regime, prompt set), the best in bold; then
    the command that makes each file."""
    import peer_hf

    rows = [r for file_rows in rows_by_file for r in file_rows]
    keys = sorted({(r["regime"], r["prompt_set"]) for r in rows}, key=lambda k: ({"disk": 0}.get(k[0], 1), k[1]))
    best = {k: peer_hf.best_setting(rows, *k) for k in keys}
    head = ["| hf-assisted setting | " + " | ".join(f"{regime_title(*k)} ({best[k]['prompts']} prompt{'s' * (best[k]['prompts'] != 1)})"
                                                     for k in keys) + " |", "|---" * (len(keys) + 1) + "|"]
    lines = []
    for assist in peer_hf.SWEEP:
        label, cells = peer_hf.assist_label(assist), []
        for k in keys:
            values = [r["systems"][label]["seconds_per_token"] for r in rows
                      if (r["regime"], r["prompt_set"]) == k and label in r["systems"]]
            text = _stats.fmt_ci(bench.median_ci(values))
            cells.append(f"**{text}**" if best[k]["label"] == label else text)
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    tokens = sorted({r["new_tokens"] for r in rows})
    return "\n".join([
        "## The peer's own sweep: hf-assisted settings (`scripts/peer_hf.py`)", "",
        "Median s/token [95% CI] of transformers' assisted generation under each setting, on calibration prompts "
        "kept apart from the measured ones (from the 33rd of each set on), greedy, up to "
        f"{' or '.join(map(str, tokens))} new tokens; the best (bold) is what hf-assisted runs above.", "",
        "Measured by (where a file's rows predate storing their command, the command rebuilt from their settings):", "```",
        *(sweep_command(r, f) for r, f in zip(rows_by_file, files) if r), "```",
        _common.measured_line(rows), "", *head, *lines])


def relative(path: str) -> str:
    """A rows file's path as the page names it: from the repository root when it lies inside."""
    resolved = Path(path).resolve()
    return str(resolved.relative_to(ROOT)) if resolved.is_relative_to(ROOT) else path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--rows", nargs="+", required=True, help="rows files of scripts/bench_peers.py")
    p.add_argument("--sweep", nargs="*", default=[], help="the peer's sweep rows files (scripts/peer_hf.py)")
    p.add_argument("--write-docs", action="store_true",
                   help="write the bench_peers section of docs/benchmarks.md and README.md's benchmark block")
    args = p.parse_args(argv)
    rows_by_file = [bench.read_rows(f) for f in args.rows]
    if not groups_of([r for rows in rows_by_file for r in rows]):
        p.error(f"{', '.join(args.rows)} hold no timing rows")
    sweep_files = [relative(f) for f in args.sweep]
    section, readme = render(rows_by_file, [relative(f) for f in args.rows], sweep_files)
    sweep = [[r for r in bench.read_rows(f) if r.get("kind") == "sweep"] for f in args.sweep]
    sweep_text = sweep_section(sweep, sweep_files) if any(sweep) else None
    print(section + (f"\n\n{sweep_text}" if sweep_text else ""))
    if args.write_docs:
        _common.write_doc_section("bench_peers", section)
        if sweep_text:
            _common.write_doc_section("bench_peers_sweep", sweep_text)
        _common.write_doc_section("bench_peers_readme", readme, path=README)
    return 0


if __name__ == "__main__":
    _common.run_main(main)
