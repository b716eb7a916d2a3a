"""Two checkouts of offspec, the same commands: identical tokens, and wall time alternated on one machine.

For a change that must not change behaviour (a refactor): each configuration runs `offspec generate` or
`offspec batch` on the embedded demo pair with each checkout (PYTHONPATH points at it), in the order given by
--order (alternated: base, new, new, base ... spreads a drifting machine over both), in float32 so greedy
tokens must be identical. Prints one line per run and a summary per configuration; every run is appended to
--out as a JSON line (tokens included) so a later look can check them.

  git worktree add /tmp/base HEAD~1
  python scripts/devtools/ab_checkouts.py --base /tmp/base --new . --configs all --max-new-tokens 24 --order base,new
  python scripts/devtools/ab_checkouts.py --base /tmp/base --new . --configs gen-none-dyspec,batch4-none-dyspec \\
      --max-new-tokens 32 --order base,new,new,base

A run loads both models each time (tens of seconds on a 2-core CPU): plan ~1 minute per run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[:0] = [str(Path(__file__).resolve().parents[2]), str(Path(__file__).resolve().parents[1])]   # offspec, scripts/
import _common  # noqa: E402

PROMPTS = ["Write a Python function that returns the n-th Fibonacci number.",
           "What is the capital of France? Answer in one sentence.",
           "Explain what a hash map is in two sentences.",
           "Write a bash one-liner that counts the lines of every .py file in a folder."]
CONFIGS = {    # name -> the command's arguments (the prompt file is added)
    "gen-none-dyspec": ["generate", "--offload", "none", "--tree", "dyspec"],
    "gen-cpu-dyspec": ["generate", "--offload", "cpu", "--tree", "dyspec"],
    "gen-disk-dyspec": ["generate", "--offload", "disk", "--tree", "dyspec"],
    "gen-cpu-chain": ["generate", "--offload", "cpu", "--tree", "chain"],
    "gen-cpu-none": ["generate", "--offload", "cpu", "--tree", "none"],
    "batch4-none-dyspec": ["batch", "--concurrency", "4", "--offload", "none", "--tree", "dyspec"],
    "batch4-cpu-dyspec": ["batch", "--concurrency", "4", "--offload", "cpu", "--tree", "dyspec"],
    "batch4-disk-chain": ["batch", "--concurrency", "4", "--offload", "disk", "--tree", "chain"],
    "batch4-none-none": ["batch", "--concurrency", "4", "--offload", "none", "--tree", "none"],
    "batch1-cpu-dyspec": ["batch", "--concurrency", "1", "--offload", "cpu", "--tree", "dyspec"],
}


def run_once(checkout: str, args: list[str], prompts: Path, work: Path, max_new: int) -> dict:
    """One command with one checkout -> {wall, passes, tokens (by prompt id)}."""
    out = work / ("out.jsonl" if args[0] == "batch" else "out.json")
    out.unlink(missing_ok=True)
    where = [str(prompts), "-o", str(out)] if args[0] == "batch" else ["--prompt-file", str(prompts), "--json",
                                                                      str(out), "--quiet"]
    command = [sys.executable, "-m", "offspec.cli", args[0], *where, *args[1:], "--dtype", "float32",
               "--max-new-tokens", str(max_new)]
    started = time.perf_counter()
    done = subprocess.run(command, env={**os.environ, "PYTHONPATH": str(Path(checkout).resolve())},
                          capture_output=True, text=True, cwd=work)
    wall = time.perf_counter() - started
    if done.returncode:
        raise SystemExit(f"ab_checkouts: {checkout}: {' '.join(command)} failed:\n{done.stderr[-2000:]}")
    if args[0] == "batch":
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        return {"wall": wall, "passes": sum(r["passes"] for r in rows), "tokens": {r["id"]: r["tokens"] for r in rows}}
    report = json.loads(out.read_text())
    return {"wall": wall, "passes": report["passes"], "tokens": {"prompt": report["tokens"]}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--base", required=True, help="the checkout before the change (its root folder)")
    p.add_argument("--new", required=True, help="the checkout after it")
    p.add_argument("--configs", default="all", help=f"comma-separated names, or all: {', '.join(CONFIGS)}")
    p.add_argument("--max-new-tokens", type=int, default=24)
    p.add_argument("--order", default="base,new", help="the checkouts' order within each configuration")
    p.add_argument("--out", default="ab_checkouts.jsonl", help="JSON lines, one per run (appended)")
    args = p.parse_args()
    names = list(CONFIGS) if args.configs == "all" else args.configs.split(",")
    unknown = [n for n in names if n not in CONFIGS]
    order = args.order.split(",")
    if unknown or set(order) - {"base", "new"} or args.max_new_tokens < 1:
        p.error(f"unknown configuration {unknown}" if unknown else "--order takes base and new; --max-new-tokens >= 1")
    checkouts = {"base": args.base, "new": args.new}
    with tempfile.TemporaryDirectory(prefix="offspec-ab-") as tmp, open(args.out, "a") as log:
        work = Path(tmp)
        prompts = work / "prompts.txt"
        prompts.write_text("\n".join(PROMPTS) + "\n")
        for name in names:
            runs = {"base": [], "new": []}
            for version in order:
                r = run_once(checkouts[version], CONFIGS[name], prompts, work, args.max_new_tokens)
                runs[version].append(r)
                log.write(json.dumps({"config": name, "version": version, **r}) + "\n")
                log.flush()
                print(f"{name} {version}: {r['wall']:.1f} s, {r['passes']} passes", flush=True)
            same = len({json.dumps(r["tokens"], sort_keys=True) for rs in runs.values() for r in rs}) == 1
            walls = {v: [round(r["wall"], 1) for r in rs] for v, rs in runs.items() if rs}
            means = {v: f"{statistics.mean(w):.1f}" for v, w in walls.items()}
            print(f"== {name}: tokens {'identical' if same else 'DIFFER'}; wall s {walls} (means {means})", flush=True)
            if not same:
                return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
