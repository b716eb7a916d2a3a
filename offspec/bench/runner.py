"""The one benchmark runner: `offspec bench`, scripts/bench_peers.py and scripts/bench_accept.py measure through it.

A *system* is a name and a function `(prompt ids, new tokens, seed) -> cell` that generates once and says what
it did. offspec's systems share one loaded engine (load.Models and the memory plan, as `offspec generate`
loads it) and differ only in the tree they grow:

    default      the tree options the run was given (dyspec, auto budget, unless told otherwise)
    none         plain autoregressive decoding on the same engine
    <policy>-<N> that policy at a fixed budget of N nodes: chain-8 is an 8-token chain, dyspec-16 a dyspec
                 tree of at most 16 nodes (the ablations a default is judged against)

measure() runs every system on every prompt (and seed), interleaved: for each prompt the systems run in an
order drawn per prompt and repeat, so a slow spell of the machine falls on different systems. One row per
(prompt, seed):

    {"id", "seed", "prompt_tokens", "prompt_digest", "new_tokens", "temperature", "stamp", "systems": {name: cell}}
    cell: {"tokens": [ids], "seconds_per_token": median over repeats of seconds / own tokens,
           "repeat_seconds_per_token": [...], "tokens_per_pass", "passes", ...}

A cell's seconds cover the whole generation (prefill included, load excluded), the same for every system.
summarize() gives each system's median over prompts with a bootstrap 95% interval over prompts, and its
speedup over a reference system with a paired bootstrap interval (prompts resampled with both systems' values).
"""
from __future__ import annotations

import os
import random
import statistics
import subprocess
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import numpy as np

from offspec.config import AUTO_MAX_TREE_BUDGET, RunLimits, SamplingConfig, TreeConfig
from offspec.engine.generate import Engine, GenerationRequest, run
from offspec.errors import InputError
from offspec.formats import cpu_bf16

DEFAULT = "default"
PLAIN = "none"
ABLATIONS = ("chain-8", "dyspec-16")      # fixed policies a default is judged against (same engine, same draft)
POLICIES = ("auto", "dyspec", "heap", "chain", "static", "sequoia")   # <policy>-<N> systems (auto-N: the engine's)
BOOTSTRAP_RESAMPLES = 2000   # the 2.5% and 97.5% points move by < 1% of the spread beyond this
BOOTSTRAP_SEED = 13          # fixed, so a table rendered twice from the same rows prints the same intervals
CONFIDENCE = 0.95
WARM_UP_TOKENS = 4

Runner = Callable[[Sequence[int], int, int], dict]     # (prompt ids, new tokens, seed) -> cell


# ------------------------------------------------------------------ systems

def system_tree(name: str, default: TreeConfig) -> TreeConfig:
    """The tree a system name runs: default, none, or <policy>-<N> (default's other options kept)."""
    if name == DEFAULT:
        return default
    if name == PLAIN:
        return replace(default, policy="none")
    policy, _, budget = name.rpartition("-")
    if policy in POLICIES and budget.isdigit() and int(budget) > 0:
        return replace(default, policy=policy, budget=int(budget))
    raise InputError(f"unknown system {name!r}: expected {DEFAULT}, {PLAIN} or <policy>-<nodes> with policy one of "
                     f"{', '.join(POLICIES)} (e.g. chain-8, dyspec-16)")


def bench_limits(trees: Iterable[TreeConfig], longest: int, sampling: bool) -> RunLimits:
    """What the memory plan sizes a benchmark for: the longest prompt plus new tokens, one full tree of the
    largest system and its root on top; an auto budget anywhere plans the auto budget."""
    trees = [t for t in trees if t.policy != "none"]
    auto = any(t.budget is None for t in trees)
    budget = None if auto or not trees else max(t.budget for t in trees)
    room = AUTO_MAX_TREE_BUDGET if auto else (budget or 0)
    return RunLimits(context=longest + room + 2, tree_budget=budget, sampling=sampling)


def offspec_runner(engine: Engine, tree: TreeConfig, sampling: SamplingConfig, ignore_eos: bool) -> Runner:
    """A system on a loaded engine: one request per call, timed around the whole generation. A cell's
    learned_from: the observations of the pair's acceptance its run started from, by kind
    (engine.pair_cache.PairCache.row_start: a greedy run's include what the engine's earlier runs, a warm-up's too,
    observed; a learning sampled run's, the greedy seed)."""
    def measure(ids: Sequence[int], new_tokens: int, seed: int) -> dict:
        request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=new_tokens, tree=tree,
                                    sampling=replace(sampling, seed=seed), ignore_eos=ignore_eos)
        learned = engine.learned.observations(sampling.greedy)
        start = time.perf_counter()
        report, steps = run(engine, request)
        seconds = time.perf_counter() - start
        return {"tokens": list(report.tokens), "seconds": seconds, "passes": report.passes,
                "tokens_per_pass": report.tokens_per_pass,
                "mean_tree_size": statistics.fmean(s.tree_size for s in steps) if steps else 0.0,
                "draft_seconds": report.draft_seconds, "target_seconds": report.target_seconds,
                "gb_streamed": report.gb_streamed, "learned_from": learned}
    return measure


# ------------------------------------------------------------------ measuring

def stamp() -> dict:
    """Provenance of one row: the code's commit, the UTC time, the 1/5/15-minute load average and the CPU."""
    import torch

    try:
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    return {"commit": git_commit(), "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "load_average": load, "machine": f"{cpu_model()}, {torch.get_num_threads()} torch threads"}


def git_commit() -> Optional[str]:
    """$OFFSPEC_COMMIT when set (a tree copied to another machine), else the checkout's short HEAD, '+changes'
    when tracked files differ from it; None for an installed copy outside a checkout."""
    if os.environ.get("OFFSPEC_COMMIT"):
        return os.environ["OFFSPEC_COMMIT"]
    root = Path(__file__).resolve().parents[2]
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True)
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+changes" if dirty.stdout.strip() else "")


CPUINFO = "/proc/cpuinfo"


def cpu_model() -> str:
    """The CPU's model name with its family and model numbers and the widest of its vector and bfloat16
    instructions, so that two machines sold under one name are told apart, and a row says whether its CPU
    computes bf16 natively: "AMD EPYC (family 23 model 49; avx2)", no comma in it (a stamp's machine is what
    comes before its first comma). The platform's name where /proc/cpuinfo has none."""
    info = cpu_bf16.cpu_info(CPUINFO)
    if not info.get("model name"):
        import platform
        return platform.processor() or platform.machine()
    flags = cpu_bf16.cpu_flags(info)
    isa = [f for f in ("avx512f", "avx512_bf16", "amx_bf16") if f in flags] or [f for f in ("avx2",) if f in flags]
    ids = " ".join(f"{label} {info[key]}" for key, label in (("cpu family", "family"), ("model", "model"))
                   if key in info)
    detail = "; ".join(part for part in (ids, " ".join(isa)) if part)
    return f"{info['model name']} ({detail})" if detail else info["model name"]


def shuffled_order(items: Sequence, key: str, repeat: int) -> list:
    """`items` in an order drawn for (key, repeat): the same on a resumed run, different per prompt and repeat,
    so no system always runs first (warm caches) or last (a machine that got busier)."""
    order = list(items)
    random.Random(f"0:{key}:{repeat}").shuffle(order)
    return order


def row_key(row: dict) -> tuple:
    return row["id"], row.get("seed"), row.get("temperature", 0.0)


def _stderr(message: str) -> None:
    import sys
    print(f"warning: {message}", file=sys.stderr)


def resumed_rows(path, prompts: Sequence[tuple[str, Sequence[int]]], systems: Iterable[str], temps: Sequence[float],
                 seed: int, settings: dict, warn: Callable[[str], None] = _stderr) -> list[dict]:
    """The measured rows of a rows file a run can reuse: its prompts (the same tokens), temperatures (T > 0 at
    `seed`) and every one of its systems. Rows measured with other settings (a key's value differs, or only one
    side has the key) are an InputError, as they could not be summarized with the new ones; rows of another kind
    (a "kind" field: a check, not a measurement) are passed over. warn: where read_rows' warnings go."""
    old = [r for r in read_rows(path, warn) if "systems" in r and r.get("kind") is None]
    other = sorted({k for r in old for k in {*settings, *r.get("settings", {})}
                    if r.get("settings", {}).get(k) != settings.get(k)})
    if other:
        raise InputError(f"{path} holds rows measured with other settings ({', '.join(other)}): pass the same "
                         "options or another rows file")
    digests = {pid: prompt_digest(ids) for pid, ids in prompts}
    wanted = {(pid, None if t == 0 else seed, t) for pid in digests for t in temps}
    return list({row_key(r): r for r in old if row_key(r) in wanted and set(systems) <= set(r["systems"])
                 and r.get("prompt_digest") == digests[r["id"]]}.values())


def parse_temperatures(text: str) -> list[float]:
    """'0,0.6' -> [0.0, 0.6] (repeats dropped); InputError unless one or more numbers >= 0."""
    try:
        temps = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise InputError(f"--temperatures must be comma-separated numbers, not {text!r}") from None
    if not temps or any(t < 0 for t in temps):
        raise InputError(f"--temperatures must be one or more numbers >= 0, not {text!r}")
    return list(dict.fromkeys(temps))


def measure(prompts: Sequence[tuple[str, Sequence[int]]], runners: dict[str, Runner], new_tokens: int, *,
            temperature: float = 0.0, seeds: Sequence[Optional[int]] = (None,), repeats: int = 1,
            done: Iterable[tuple] = (), on_row: Optional[Callable[[dict], None]] = None,
            extra: Optional[dict] = None) -> list[dict]:
    """Every (prompt, seed) not in `done` (row_key) run by every runner `repeats` times, interleaved; each row
    is passed to on_row as soon as it is made (a caller appends it to a file: a killed run loses one prompt).
    extra: fields every row carries (the regime, the settings). Seed None (greedy) runs with seed 0."""
    done = set(done)
    todo = [(pid, ids, seed) for pid, ids in prompts for seed in seeds if (pid, seed, temperature) not in done]
    if todo:
        for runner in runners.values():        # warm-up, not counted: first calls allocate and compile
            runner(todo[0][1], WARM_UP_TOKENS, 0)
    rows = []
    for pid, ids, seed in todo:
        runs: dict[str, list[dict]] = {name: [] for name in runners}
        for repeat in range(repeats):
            for name in shuffled_order(list(runners), f"{pid}|{seed}", repeat):
                runs[name].append(runners[name](ids, new_tokens, seed or 0))
        row = {**(extra or {}), "id": pid, "seed": seed, "temperature": temperature, "prompt_tokens": len(ids),
               "prompt_digest": prompt_digest(ids),
               "new_tokens": new_tokens, "stamp": stamp(), "systems": {n: merge_repeats(r) for n, r in runs.items()}}
        rows.append(row)
        if on_row is not None:
            on_row(row)
    return rows


def prompt_digest(ids: Sequence[int]) -> str:
    """A short digest of a prompt's token ids: a resumed run reuses a row only for the same prompt."""
    import hashlib

    return hashlib.sha1(",".join(map(str, ids)).encode()).hexdigest()[:16]


def merge_repeats(runs: list[dict]) -> dict:
    """One cell from a system's repeats on one prompt: the first run's counters and tokens, the median of the
    repeats' seconds per token."""
    per_token = [r["seconds"] / max(len(r["tokens"]), 1) for r in runs]
    cell = {k: v for k, v in runs[0].items() if k != "seconds"}
    return {**cell, "seconds_per_token": statistics.median(per_token), "repeat_seconds_per_token": per_token}


# ------------------------------------------------------------------ statistics

def median_ci(values: Sequence[float], resamples: int = BOOTSTRAP_RESAMPLES) -> Optional[dict]:
    """{"median", "low", "high", "n"}: the median of `values` (one per prompt) and its percentile-bootstrap 95%
    interval over prompts; None for no values."""
    x = np.asarray([v for v in values if v is not None], dtype=np.float64)   # (n,)
    if x.size == 0:
        return None
    draws = np.random.default_rng(BOOTSTRAP_SEED).integers(0, x.size, size=(resamples, x.size))   # (resamples, n)
    low, high = _percentiles(np.median(x[draws], axis=1))
    return {"median": float(np.median(x)), "low": low, "high": high, "n": int(x.size)}


def ratio_ci(numerators: Sequence[float], denominators: Sequence[float],
             resamples: int = BOOTSTRAP_RESAMPLES) -> Optional[dict]:
    """{"ratio", "low", "high", "n"}: median(numerators) / median(denominators) over paired prompts (index i
    is the same prompt in both) and its paired bootstrap 95% interval; None without pairs."""
    if len(numerators) != len(denominators):
        raise ValueError(f"ratio_ci needs paired values, got {len(numerators)} and {len(denominators)}")
    pairs = [(a, b) for a, b in zip(numerators, denominators) if a is not None and b is not None]
    if not pairs:
        return None
    a = np.asarray([p[0] for p in pairs], dtype=np.float64)   # (n,)
    b = np.asarray([p[1] for p in pairs], dtype=np.float64)   # (n,)
    draws = np.random.default_rng(BOOTSTRAP_SEED).integers(0, a.size, size=(resamples, a.size))   # (resamples, n)
    low, high = _percentiles(np.median(a[draws], axis=1) / np.median(b[draws], axis=1))
    return {"ratio": float(np.median(a) / np.median(b)), "low": low, "high": high, "n": int(a.size)}


def _percentiles(samples: np.ndarray) -> tuple[float, float]:
    tail = (1.0 - CONFIDENCE) / 2 * 100
    low, high = np.percentile(samples, [tail, 100 - tail])
    return float(low), float(high)


def fmt_ci(cell: Optional[dict], digits: int = 3, key: str = "median", suffix: str = "") -> str:
    """'0.263 [0.241, 0.290]' ('–' when missing)."""
    if cell is None:
        return "–"
    return f"{cell[key]:.{digits}f}{suffix} [{cell['low']:.{digits}f}, {cell['high']:.{digits}f}]"


def first_divergence(a: Sequence[int], b: Sequence[int]) -> Optional[int]:
    """Index of the first token where a and b differ (a length difference counts there); None if identical."""
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), n)
    return None if first == len(a) == len(b) else first


def summarize(rows: list[dict], reference: str = PLAIN) -> list[dict]:
    """Per system of `rows` (one group: same settings): {"system", "prompts", "seconds_per_token": median CI,
    "tokens_per_pass": median, "mean_tree_size": mean, "speedup": ratio CI over `reference` (None without it),
    "identical": prompts whose tokens equal the reference's (greedy rows only, else None)}."""
    systems = list(dict.fromkeys(name for r in rows for name in r["systems"]))
    greedy = all(r.get("temperature", 0.0) == 0.0 for r in rows)
    table = []
    for name in systems:
        have = [r for r in rows if name in r["systems"]]
        cells = [r["systems"][name] for r in have]
        paired = [r for r in have if reference in r["systems"]]
        speedup = ratio_ci([r["systems"][reference]["seconds_per_token"] for r in paired],
                           [r["systems"][name]["seconds_per_token"] for r in paired]) if paired else None
        identical = (sum(first_divergence(r["systems"][name]["tokens"], r["systems"][reference]["tokens"]) is None
                         for r in paired) if greedy and paired else None)
        table.append({"system": name, "prompts": len(cells),
                      "seconds_per_token": median_ci([c["seconds_per_token"] for c in cells]),
                      "tokens_per_pass": statistics.median(c.get("tokens_per_pass", 1.0) for c in cells),
                      "mean_tree_size": statistics.fmean(c.get("mean_tree_size", 0.0) for c in cells),
                      "speedup": speedup, "identical": identical, "paired": len(paired)})
    return table


def format_table(summary: list[dict], reference: str = PLAIN) -> str:
    """The summary for a terminal."""
    head = (f"{'system':<18} {'prompts':>7} {'s/token [95% CI]':>26} {'tok/pass':>9} {'tree':>7} "
            f"{'vs ' + reference + ' [95% CI]':>26} {'same':>6}")
    lines = [head, "-" * len(head)]
    for r in summary:
        same = "-" if r["identical"] is None else f"{r['identical']}/{r['paired']}"
        lines.append(f"{r['system']:<18} {r['prompts']:>7} {fmt_ci(r['seconds_per_token'], 4):>26} "
                     f"{r['tokens_per_pass']:>9.2f} {r['mean_tree_size']:>7.1f} "
                     f"{fmt_ci(r['speedup'], 2, 'ratio', 'x'):>26} {same:>6}")
    return "\n".join(lines)


def bench_prompts(tokenizer, items, prompt_tokens: int) -> list[tuple[str, tuple[int, ...]]]:
    """(id, first `prompt_tokens` ids of the prompt) for each item; chat messages are templated."""
    from offspec.engine.prompt import encode_prompt
    out = []
    for item in items:
        ids = encode_prompt(tokenizer, item.prompt, raw=isinstance(item.prompt, str))
        out.append((item.id, tuple(ids[:prompt_tokens])))
    return out


# ------------------------------------------------------------------ the rows file

def rows_file(path) -> Path:
    """A rows file's path. Where only its gzip-compressed copy (path + '.gz') exists, that one: a command naming
    `rows.jsonl` goes on reading after the file was compressed. Both existing: InputError (which one holds the
    rows is not for this to guess)."""
    path = Path(path)
    gz = path.with_name(path.name + ".gz")
    if path.suffix == ".gz" or not gz.exists():
        return path
    if path.exists():
        raise InputError(f"both {path} and {gz} exist; keep one (gunzip the archive into the plain file, or move "
                         "one away)")
    return gz


def check_appendable(path) -> None:
    """InputError unless rows can be appended to `path`: a compressed rows file is a read-only archive. A
    measuring run calls this before it measures anything."""
    if path is not None and rows_file(path).suffix == ".gz":
        raise InputError(f"{rows_file(path)} is a compressed archive; gunzip it to add rows")


def append_row(path, row: dict) -> None:
    """Append one JSON line to a plain rows file, first ending a torn last line (a run killed mid-write) so the
    new one parses; on disk (fsynced) before this returns."""
    import json

    check_appendable(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a+b") as f:
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(row) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())   # a row that took minutes to measure should survive a crash right after


def read_rows(path, warn: Callable[[str], None] = _stderr, torn: str = "ignored") -> list[dict]:
    """The JSON objects of a rows file, in order ([] when there is none): plain, or gzip-compressed (rows_file).
    A line that is not complete JSON (the torn last line of a killed run) is skipped with a warning ending in
    `torn`; a compressed file cut short keeps the rows before the cut, with a warning."""
    import gzip
    import json
    import zlib

    if path is None or not rows_file(path).is_file():
        return []
    path = rows_file(path)
    rows, number = [], 0
    try:
        with (gzip.open(path, "rt") if path.suffix == ".gz" else open(path)) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    warn(f"{path}:{number} is not a complete JSON line; {torn}")
                    continue
                if isinstance(row, dict):
                    rows.append(row)
                else:
                    warn(f"{path}:{number} is not a JSON object; ignored")
    except (EOFError, gzip.BadGzipFile, zlib.error) as err:
        warn(f"{path} ends early after line {number} ({err}); the rows read so far are kept")
    return rows
