"""Two checkouts of offspec, the same commands: identical tokens, and wall time alternated on one machine.

For a change that must not change behaviour (a refactor): each configuration runs `offspec generate` or
`offspec batch` with each checkout (PYTHONPATH points at it), in the order given by --order (alternated: base, new,
new, base ... spreads a drifting machine over both), in float32 so greedy tokens must be identical. The demo
pair's configurations use the embedded models; the awq-* and gguf-* ones a tiny random AWQ target (its draft the
dense model it was quantized from, 2% perturbed) and a tiny GGUF pair of every block type, built once per run in
the temporary folder by tests/tiny.py. The `help` configuration compares `offspec ... --help` of every command,
byte for byte. Prints one line per run and a summary per configuration; every run is appended to --out as a JSON
line (tokens included) so a later look can check them.

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
    "awq-none-dyspec": ["generate", "--offload", "none", "--tree", "dyspec", "--raw"],
    "awq-disk-chain": ["generate", "--offload", "disk", "--tree", "chain", "--raw"],
    "gguf-none-dyspec": ["generate", "--offload", "none", "--tree", "dyspec", "--raw"],
    "gguf-cpu-none": ["generate", "--offload", "cpu", "--tree", "none", "--raw"],
    "help": ["--help"],
}
HELP_COMMANDS = [[], ["generate"], ["batch"], ["bench"], ["serve"], ["doctor"], ["models"], ["models", "demo"],
                 ["models", "info"], ["models", "prepare"]]


def tiny_models(work: Path) -> dict[str, list[str]]:
    """{"awq": [--target, --draft], "gguf": [...]}: the tiny published and GGUF pairs, written under work."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from tiny import hf_config, make_model, perturbed_copy, save_checkpoint, save_gguf, save_published_checkpoint

    model = make_model(hf_config("qwen2", n_layers=3, hidden=256, heads=4, kv_heads=2), seed=7, scale=3.0)
    awq = save_published_checkpoint(model, work / "awq", "awq-g32")
    awq_draft = save_checkpoint(perturbed_copy(model, noise=0.02), work / "awq-draft")
    mixed = {"q_proj": "Q4_K", "k_proj": "Q5_K", "v_proj": ["Q6_K", "Q8_0", "F16"], "o_proj": "Q4_0",
             "gate_proj": ["Q4_1", "Q5_0", "BF16"], "up_proj": "Q5_1", "down_proj": "Q6_K"}
    model = make_model(hf_config("qwen2", n_layers=3, hidden=256, heads=4, kv_heads=2, vocab=300), seed=7, scale=3.0)
    gguf = save_gguf(model, work / "target.gguf", mixed)     # vocab 300: the byte-level tokenizer's 261 ids
    gguf_draft = save_gguf(perturbed_copy(model, noise=0.02), work / "draft.gguf")
    return {"awq": ["--target", str(awq), "--draft", str(awq_draft)],
            "gguf": ["--target", str(gguf), "--draft", str(gguf_draft)]}


def help_texts(checkout: str, work: Path) -> dict:
    """Every command's --help with one checkout -> {"wall", "passes": 0, "tokens": {command: its help text}}."""
    started, texts = time.perf_counter(), {}
    for command in HELP_COMMANDS:   # cwd: not a checkout (python -m puts the folder it starts in first on the path)
        done = subprocess.run([sys.executable, "-m", "offspec.cli", *command, "--help"], capture_output=True,
                              text=True, cwd=work, env={**os.environ, "PYTHONPATH": str(Path(checkout).resolve()),
                                                        "COLUMNS": "120"})
        texts[" ".join(command) or "offspec"] = done.stdout + done.stderr
    return {"wall": time.perf_counter() - started, "passes": 0, "tokens": texts}


def run_once(checkout: str, args: list[str], prompts: Path, work: Path, max_new: int) -> dict:
    """One command with one checkout -> {wall, passes, tokens (by prompt id)}."""
    if args == ["--help"]:
        return help_texts(checkout, work)
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
        models = tiny_models(work) if any(n.split("-")[0] in ("awq", "gguf") for n in names) else {}
        for name in names:
            runs = {"base": [], "new": []}
            for version in order:
                command = CONFIGS[name] + models.get(name.split("-")[0], [])
                r = run_once(checkouts[version], command, prompts, work, args.max_new_tokens)
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
