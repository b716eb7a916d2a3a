"""Helpers shared by the benchmark scripts: the machine a number was measured on, the command that
measured it, markdown tables, rows files (JSON lines, gzip-compressed or not), and writing one benchmark's
section of docs/benchmarks.md.

docs/benchmarks.md holds one section per benchmark between markers

    <!-- bench_stream:start -->
    ...written by scripts/bench_stream.py --write-docs...
    <!-- bench_stream:end -->

so a rerun of one script replaces only its own section and leaves the rest of the file as it was. A section
starts with run_header(): the command in a code block and one line saying where, when and at which commit the
figures were measured (from the rows' stamps when it renders stored rows, never the rendering's own time).
"""
from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import torch

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = REPO / "docs" / "benchmarks.md"

DOC_HEADER = """# Benchmarks

Measured, not asserted: each section below is written by one script in `scripts/` (run it with
`--write-docs` to replace its section; the rest of this file is left as it is). Every section states the
exact command and where, when and at which commit its figures were measured.
"""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Shows defaults (except None ones, whose help text says what happens) and keeps the description's lines."""

    def _get_help_string(self, action):
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def command_line() -> str:
    """The command that is running, as a user would type it from the repository root."""
    script = Path(sys.argv[0]).resolve()
    try:
        script_name = str(script.relative_to(REPO))
    except ValueError:
        script_name = str(script)
    return " ".join(shlex.quote(a) for a in ["python", script_name, *sys.argv[1:]])


def relative_command(command: str) -> str:
    """A stored measuring command as run from the repository root: paths into this checkout made relative."""
    return command.replace(f"{REPO}/", "")


def git_commit() -> Optional[str]:
    """offspec.bench.runner.git_commit(): $OFFSPEC_COMMIT when set, else the checkout's short HEAD with '+changes' when
    tracked files differ from it; None outside a checkout."""
    from offspec.bench.runner import (
        git_commit as commit,  # when called: by then the script has put its checkout on sys.path
    )
    return commit()


def cpu_model() -> str:
    """offspec.bench.runner.cpu_model(): the CPU's model name."""
    from offspec.bench.runner import cpu_model as model
    return model()


def compute_device(name: str, here: bool = True) -> torch.device:
    """A benchmark's --device: auto = the GPU when there is one (the regime offspec is built for), else the CPU.
    here False (a report of stored rows): the device may be another machine's; only its rows are picked."""
    from offspec.engine.load import parse_device  # when called: by then the script has put its checkout on sys.path
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return parse_device(name, check_available=here)


def device_model(device: torch.device) -> str:
    """What rows measured on `device` name as their machine: the GPU's model on a GPU, else the CPU's."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else cpu_model()


def load_average() -> str:
    """'1.26 / 1.46 / 1.27' (1, 5, 15 minutes), or 'n/a' where the OS has none."""
    try:
        return " / ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def fmt(x: float, digits: int = 3) -> str:
    """A float for a table cell; '–' for missing values."""
    if x is None or x != x:   # None or NaN
        return "–"
    return f"{x:.{digits}f}"


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(out)


def text_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    """The same table for a terminal: columns padded, right-aligned."""
    cells = [list(map(str, headers))] + [list(map(str, r)) for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) for c, w in zip(r, widths)) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def write_doc_section(name: str, body: str, path: Path = BENCHMARKS_MD) -> None:
    """Replace the text between `name`'s markers in `path` with `body` (append the section, markers
    included, when the file lacks them; create the file when missing). Written atomically."""
    start, end = markers(name)
    text = path.read_text() if path.exists() else DOC_HEADER
    block = f"{start}\n{body.rstrip()}\n{end}"
    i, j = text.find(start), text.find(end)
    if i >= 0 and j > i:
        text = text[:i] + block + text[j + len(end):]
    elif i >= 0 or j >= 0:
        raise SystemExit(f"{path}: the markers of section {name!r} are damaged; fix them by hand")
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def _utc(t: str) -> str:
    """'2026-11-25T08:43:19Z' -> '2026-11-25 08:43'."""
    return t.replace("T", " ")[:16]


def _span(first: str, last: str) -> str:
    """'2026-11-25 08:43–09:10 UTC' within a day, else both dates."""
    if first == last:
        return f"{first} UTC"
    return f"{first}–{last[11:] if first[:10] == last[:10] else last} UTC"


def _unstamped(rows: Sequence[dict]) -> str:
    """What rows without a stamp say of themselves: older rows kept a `time` (the measuring run's own clock) and
    some a `commit`; '' when they say neither."""
    times = sorted(_utc(r["time"]) for r in rows if isinstance(r.get("time"), str))
    commits = sorted({r["commit"] for r in rows if isinstance(r.get("commit"), str)})
    said = ([f"times {_span(times[0], times[-1])[:-4]} by the run's clock"] if times else []) + \
           ([f"commit{'s' * (len(commits) > 1)} {', '.join(commits)}"] if commits else [])
    return f" (their own fields: {', '.join(said)})" if said else ""


def measured_line(rows: Sequence[dict]) -> str:
    """One line: the machines, the first and last time, the commits and the load the rows were measured at, from
    their stamps (_stats.stamp(): {commit, time, load_average, machine}); says which rows carry no stamp, and the
    time and commit such rows kept themselves, if any."""
    stamps = [r["stamp"] for r in rows if isinstance(r.get("stamp"), dict)]
    bare = [r for r in rows if not isinstance(r.get("stamp"), dict)]
    if not stamps:
        return f"Rows carry no stamp{_unstamped(bare)}: where they were measured is not recorded."
    machines = sorted({s.get("machine") or "?" for s in stamps})
    times = sorted(_utc(s["time"]) for s in stamps if s.get("time"))
    commits = sorted({s.get("commit") or "?" for s in stamps})
    loads = [s["load_average"][0] for s in stamps if s.get("load_average")]
    parts = [f"Measured on {'; '.join(machines)}"]
    if times:
        parts.append(_span(times[0], times[-1]))
    parts.append(f"commit{'s' * (len(commits) > 1)} {', '.join(commits)}")
    text = ", ".join(parts)
    if loads:
        text += f"; 1-minute load {min(loads):.2f}–{max(loads):.2f}"
    if bare:
        text += f"; {len(bare)} of {len(rows)} rows carry no stamp{_unstamped(bare)}"
    return text + "."


def run_header(device: torch.device, started: float, load_at_start: str, rows: Optional[Sequence[dict]] = None) -> str:
    """The head of every section: the command in a code block, then one line saying where, when and at which
    commit the figures were measured. With `rows` (what the section is rendered from) the line comes from their
    stamps, whenever they were measured; without, for a run that measured what it shows, it names this machine,
    the run's start and end (UTC), the checkout's commit and the load average. A --report-only render given no
    rows gets the command alone: its own machine and time are not when anything was measured."""
    lines = ["```", command_line(), "```"]
    if rows is not None:
        lines.append(measured_line(rows))
    elif "--report-only" not in sys.argv[1:]:
        threads = f", {torch.get_num_threads()} torch threads" if device.type == "cpu" else ""
        first = time.strftime("%Y-%m-%d %H:%M", time.gmtime(started))
        last = time.strftime("%Y-%m-%d %H:%M", time.gmtime())
        load = (f"; 1-minute load {load_at_start.split(' / ')[0]} at the start, "
                f"{load_average().split(' / ')[0]} at the end")
        lines.append(f"Measured on {device_model(device)}{threads}, torch {torch.__version__}, {_span(first, last)}, "
                     f"commit {git_commit() or '?'}{load if load_at_start != 'n/a' else ''}.")
    return "\n".join(lines)


def run_main(main: Callable[[], int]) -> None:
    """A script's entry point: exit with main()'s code; an OffspecError (bad input, a plan that does not fit) is
    one `error:` line on stderr and exit 1, not a traceback."""
    from offspec.errors import OffspecError  # when called: by then the script has put its checkout on sys.path
    try:
        sys.exit(main())
    except OffspecError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
