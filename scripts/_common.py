"""Helpers shared by the benchmark scripts: the machine a number was measured on, the command that
measured it, markdown tables, and writing one benchmark's section of docs/benchmarks.md.

docs/benchmarks.md holds one section per benchmark between markers

    <!-- bench_stream:start -->
    ...written by scripts/bench_stream.py --write-docs...
    <!-- bench_stream:end -->

so a rerun of one script replaces only its own section and leaves the rest of the file as it was.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional, Sequence

import psutil
import torch

REPO = Path(__file__).resolve().parent.parent
BENCHMARKS_MD = REPO / "docs" / "benchmarks.md"

DOC_HEADER = """# Benchmarks

Measured, not asserted: each section below is written by one script in `scripts/` (run it with
`--write-docs` to replace its section; the rest of this file is left as it is). Every section states the
exact command and the machine it ran on. Timings taken while other work shares the machine are noisy: the
load average at the start and end of each run is recorded so a reader can tell.
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


def git_commit() -> Optional[str]:
    """$OFFSPEC_COMMIT when set (a copy of the tree sent to another machine, whose .git may be another state's),
    else HEAD's short hash, with '+changes' when the working tree differs from it; None outside a checkout."""
    if os.environ.get("OFFSPEC_COMMIT"):
        return os.environ["OFFSPEC_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                               capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compute_device(name: str, here: bool = True) -> torch.device:
    """A benchmark's --device: auto = the GPU when there is one (the regime offspec is built for), else the CPU.
    here False (a report of stored rows): the device may be another machine's; only its rows are picked."""
    from offspec.load import parse_device     # when called: by then the script has put its checkout on sys.path
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


def machine_description(device: torch.device) -> list[str]:
    """Markdown bullet lines naming the hardware and software a benchmark ran on."""
    vm = psutil.virtual_memory()
    lines = [
        f"- CPU: {cpu_model()}, {psutil.cpu_count(logical=False)} cores / {psutil.cpu_count()} threads "
        f"(torch uses {torch.get_num_threads()} threads); RAM {vm.total / 2**30:.1f} GiB",
        f"- OS: {platform.platform()}; Python {platform.python_version()}; torch {torch.__version__}",
    ]
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        lines.append(f"- GPU: {props.name}, {props.total_memory / 2**30:.1f} GiB; CUDA {torch.version.cuda}")
    else:
        lines.append("- compute device: cpu (no GPU)")
    return lines


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


def run_header(device: torch.device, started: float, load_at_start: str) -> str:
    """The command / machine / date block every section starts with (load_at_start: load_average() then)."""
    lines = [
        "Command:",
        "```",
        command_line(),
        "```",
        *machine_description(device),
        f"- run {time.strftime('%Y-%m-%d %H:%M', time.localtime(started))}, {time.time() - started:.0f} s; "
        f"load average (1 / 5 / 15 min) {load_at_start} at the start, {load_average()} at the end",
    ]
    return "\n".join(lines)


def run_main(main: Callable[[], int]) -> None:
    """A script's entry point: exit with main()'s code; an OffspecError (bad input, a plan that does not fit) is
    one `error:` line on stderr and exit 1, not a traceback."""
    from offspec.errors import OffspecError     # when called: by then the script has put its checkout on sys.path
    try:
        sys.exit(main())
    except OffspecError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
