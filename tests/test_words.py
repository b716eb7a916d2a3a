"""Words where they belong: the CLI's help and the README quote the code's constants as they are now, help texts
carry no measurements (those live in docs/benchmarks.md), and offspec's comments name no missing document and
no issue numbers."""
import io
import re
import tokenize
from pathlib import Path

import click
from click.testing import CliRunner

from offspec.cli.main import main
from offspec.config import AUTO_MAX_TREE_BUDGET, DEFAULT_PREFILL_CHUNK
from offspec.engine.controller import MIN_JOIN_CHUNK, ONE_ROW_CPU_BUDGET, ROW_GAIN
from offspec.formats.weights import FUSED_MAX_ROWS
from offspec.plan.machine import PINNED_FRACTION
from offspec.plan.search import AUTO_CONCURRENCY
from offspec.spec import ngram

ROOT = Path(__file__).resolve().parents[1]

# (command, pattern whose group is the quoted value, the value as the code has it, the constant's name)
HELP_QUOTES = [
    (("generate",), r"covers at most (\d+) of that prompt's tokens", str(FUSED_MAX_ROWS), "weights.FUSED_MAX_ROWS"),
    (("generate",), r"draft and target times, up to (\d+);", str(AUTO_MAX_TREE_BUDGET), "config.AUTO_MAX_TREE_BUDGET"),
    (("generate",), r"target streams: (\d+) every round", str(ONE_ROW_CPU_BUDGET), "controller.ONE_ROW_CPU_BUDGET"),
    (("generate",), r"Default: (\d+%) of min\(MemAvailable", f"{PINNED_FRACTION:.0%}", "plan.PINNED_FRACTION"),
    (("batch",), r"auto = the most, up to (\d+), that the memory plan fits", str(AUTO_CONCURRENCY),
     "plan.AUTO_CONCURRENCY"),
    (("batch",), r"add at least (\d+%) to tokens/s", f"{ROW_GAIN:.0%}", "controller.ROW_GAIN"),
    (("batch",), r"and is at least (\d+) tokens", str(MIN_JOIN_CHUNK), "controller.MIN_JOIN_CHUNK"),
    (("models", "info"), r"or auto \(up to (\d+)\)", str(AUTO_MAX_TREE_BUDGET), "config.AUTO_MAX_TREE_BUDGET"),
    (("models", "info"), r"Default: (\d+%) of the host memory", f"{PINNED_FRACTION:.0%}", "plan.PINNED_FRACTION"),
]

# (pattern whose group is the quoted value, the value as the code has it, the constant's name); README.md's
# text with every run of white space made one space, as in the help.
README_QUOTES = [
    (r"a draft call that covers ≤ (\d+) of that prompt's tokens", str(FUSED_MAX_ROWS), "weights.FUSED_MAX_ROWS"),
    (r"`auto` = the most, up to (\d+), that the memory plan fits", str(AUTO_CONCURRENCY), "plan.AUTO_CONCURRENCY"),
    (r"keeps the fewest within (\d+%) of the best", f"{ROW_GAIN:.0%}", "controller.ROW_GAIN"),
    (r"as a / b tokens, at least (\d+)", str(MIN_JOIN_CHUNK), "controller.MIN_JOIN_CHUNK"),
    (r"\| `--tree-budget` \| auto \| .*? or auto \(from measured costs, up to (\d+);", str(AUTO_MAX_TREE_BUDGET),
     "config.AUTO_MAX_TREE_BUDGET"),
    (r"one prompt on a CPU whose target streams from RAM or disk: (\d+) nodes every round", str(ONE_ROW_CPU_BUDGET),
     "controller.ONE_ROW_CPU_BUDGET"),
    (r"\| `--prefill-chunk` \| (\d+) \|", str(DEFAULT_PREFILL_CHUNK), "config.DEFAULT_PREFILL_CHUNK"),
    (r"\| `--host-budget` \| (\d+%) of min", f"{PINNED_FRACTION:.0%}", "plan.PINNED_FRACTION"),
    (r"pinned within (\d+%) of what the host", f"{PINNED_FRACTION:.0%}", "plan.PINNED_FRACTION"),
    (r"earlier occurrences of the sequence's last 1–(\d+) tokens", str(ngram.MAX_MATCH), "ngram.MAX_MATCH"),
    (r"up to (\d+) chains of \d+\)", str(ngram.MAX_CHAINS), "ngram.MAX_CHAINS"),
    (r"up to \d+ chains of (\d+)\)", str(ngram.MAX_LEN), "ngram.MAX_LEN"),
]


def one_line(text: str) -> str:
    """Every run of white space one space: click rewraps help to the terminal, the README wraps by hand."""
    return " ".join(text.split())


def help_of(*command: str) -> str:
    result = CliRunner().invoke(main, [*command, "--help"], prog_name="offspec", terminal_width=120)
    assert result.exit_code == 0, result.output
    return one_line(result.output)


def misquotes(where: str, text: str, quotes) -> list[str]:
    """One line per quote that is missing from `text` or gives another value than the code's."""
    wrong = []
    for pattern, value, name in quotes:
        found = re.search(pattern, text)
        if found is None:
            wrong.append(f"{where}: the words quoting {name} are gone (pattern {pattern!r}); quote it again, or "
                         "update tests/test_words.py")
        elif found.group(1) != value:
            wrong.append(f"{where} says {found.group(1)!r} where {name} is {value!r}: {found.group(0)!r}")
    return wrong


def all_commands(group: click.Group = main, path: tuple = ()):
    """(command path, command) for every command under `group`, the group itself first."""
    yield path, group
    for name, command in group.commands.items():
        if isinstance(command, click.Group):
            yield from all_commands(command, (*path, name))
        else:
            yield (*path, name), command


def test_the_help_quotes_the_constants_as_they_are():
    wrong = []
    for command, pattern, value, name in HELP_QUOTES:
        wrong += misquotes(f"offspec {' '.join(command)} --help", help_of(*command), [(pattern, value, name)])
    assert not wrong, "\n".join(wrong)


# README.md and the docs pages its reference text moved to: the quotes hold wherever they live.
README_PAGES = ["README.md", "docs/options.md", "docs/batch.md", "docs/planning.md"]


def test_the_readme_quotes_the_constants_as_they_are():
    text = " ".join(one_line((ROOT / page).read_text(encoding="utf-8")) for page in README_PAGES)
    wrong = misquotes(" + ".join(README_PAGES), text, README_QUOTES)
    assert not wrong, "\n".join(wrong)


def test_help_texts_carry_no_timings():
    """Measured times belong in docs/benchmarks.md beside the command that measured them; help may point there."""
    timing = re.compile(r"\d\s*(ms|µs|seconds?)\b|~\s*\d+(\.\d+)?\s*s\b")
    found = [f"offspec {' '.join(path)} --help: {m.group(0)!r} in ...{text[max(0, m.start() - 60):m.end() + 20]}..."
             for path, _ in all_commands() for text in [help_of(*path)] for m in timing.finditer(text)]
    assert not found, "\n".join(found)


def comments_and_docstrings(path: Path):
    """(line, text) of every comment and string literal in a Python file."""
    source = path.read_text(encoding="utf-8")
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type in (tokenize.COMMENT, tokenize.STRING):
            yield token.start[0], token.string


def test_no_missing_documents_or_issue_numbers_in_offspec():
    """The ring's protocol is docs/streaming.md (no "CUDA.md"); an issue number says nothing to a reader of the
    code: what it decided belongs in the comment. Not flagged: the review list of docs/streaming.md ("review #3")
    and another project's issue ("pytorch#32167")."""
    issue = re.compile(r"(?<![\w/])(?<!review )#\d+|\bissue\s+#?\d+", re.IGNORECASE)
    found = []
    for path in sorted((ROOT / "offspec").rglob("*.py")):
        name = path.relative_to(ROOT)
        if "CUDA.md" in path.read_text(encoding="utf-8"):
            found.append(f"{name}: cites CUDA.md, which the repository does not have (docs/streaming.md is the "
                         "protocol)")
        found += [f"{name}:{line}: {m.group(0)!r}" for line, text in comments_and_docstrings(path)
                  for m in issue.finditer(text)]
    assert not found, "\n".join(found)
