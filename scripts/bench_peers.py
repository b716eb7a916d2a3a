#!/usr/bin/env python3
"""offspec against the transformers peer and against its own ablations, on one regime and one prompt set.

Systems (--systems), every one on every prompt, interleaved per prompt by offspec.bench.runner:
  hf-assisted  transformers generate with the draft as assistant (scripts/peer_hf.py), accelerate offloading the
               target, at the best setting the peer's own sweep found for this regime and prompt set (the --sweep
               rows; each cell stores the settings transformers read back)
  hf-plain     transformers generate without the assistant (optional: the slowest cell by far on disk)
  default      offspec as `offspec generate --offload REGIME` loads and runs it (with --offload auto: as
               `offspec generate` with no --offload): load.Models and the memory plan, the draft quantization the
               plan picks for the device, dyspec with an auto budget
  none         offspec --tree none on the same engine (plain greedy: the identity reference)
  chain-8      offspec --tree chain --tree-budget 8 on the same engine
  dyspec-16    offspec --tree dyspec --tree-budget 16 on the same engine
Regimes: disk (the target's layers read from offspec's layer store / the checkpoint's safetensors for the peer;
with cold, the default, the page cache is dropped after every read, as for a target bigger than RAM) and cpu
(the target's weights in host RAM: the peer keeps them there; offspec streams them through its ring, or, with
--offload auto, places them as `offspec generate` does by default: on a CPU-only machine the target is left where
it lies and computed there, as a CPU user runs it, the plan's choice on a GPU). Streaming from host RAM on a CPU
copies every layer each pass on the cores that compute: an emulation of a GPU's host-RAM regime, not a CPU user's
run.
Both sides stop at EOS or --new-tokens. A cell's s/token is its wall time over its own tokens, prefill included.

Identity (greedy): every system must write `none`'s tokens. In float32 a difference fails the run (exit 1). In
bfloat16 a many-token pass can round a near-tie differently from a one-token pass, so a difference is rechecked
(untimed) in float32 on resident models, transformers generate against offspec dyspec, up to the first
difference: identical there, it is rounding; different there, exit 1. Rechecks are rows of kind "fp32_check".

Rows: one per prompt, appended to --rows as measured; a rerun measures only the prompts the file lacks. Tables:
scripts/render_peers.py. Example (the published grid is in docs/benchmarks.md):
  python scripts/bench_peers.py --regime cpu --prompt-set chat --rows docs/bench_peers/cpu-chat.jsonl \\
      --sweep docs/bench_peers/sweep-cpu-chat.jsonl
"""
from __future__ import annotations

import argparse
import gc
import os
import shutil
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                 # this checkout's offspec, not an installed one
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402
import peer_hf  # noqa: E402

from offspec.bench import runner as bench  # noqa: E402
from offspec.config import OffloadConfig, SamplingConfig, TreeConfig  # noqa: E402
from offspec.errors import InputError  # noqa: E402

PEERS = ("hf-assisted", "hf-plain")
SYSTEMS = ("hf-assisted", bench.DEFAULT, bench.PLAIN, *bench.ABLATIONS)
REFERENCE = bench.PLAIN
FP32_CHECK = "fp32_check"
STOP_RULE = "EOS or new_tokens, both sides"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--regime", choices=("disk", "cpu"), required=True)
    p.add_argument("--prompt-set", choices=peer_hf.PROMPT_SETS, default="code")
    p.add_argument("--prompts", type=int, default=16, help="prompts of the set, from --prompt-offset on")
    p.add_argument("--prompt-offset", type=int, default=0)
    p.add_argument("--new-tokens", type=int, default=64, help="token budget per prompt (both sides stop at EOS)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per system and prompt, order shuffled")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated: {', '.join(PEERS)}, and offspec systems (offspec.bench.runner: default, none, "
                        "<policy>-<N>); none is required (the identity reference)")
    p.add_argument("--sweep", nargs="+", default=[], metavar="FILE",
                   help="the peer's sweep rows (scripts/peer_hf.py): hf-assisted runs the best setting they hold "
                        "for this regime and prompt set")
    p.add_argument("--assist-defaults", action="store_true",
                   help="hf-assisted runs transformers' defaults instead of a swept setting")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 (differences rechecked in float32) or float32")
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu or cuda[:N]")
    p.add_argument("--no-cold", dest="cold", action="store_false", help="disk regime: keep the page cache warm")
    p.add_argument("--offload", choices=("auto",), default=None,
                   help="cpu regime: load offspec as `offspec generate` with no --offload (the memory plan's choice; "
                        "on a CPU-only machine the target resident) [default: --offload REGIME, the layers streamed]")
    p.add_argument("--target", default=None, help="target model folder [default: the demo target]")
    p.add_argument("--draft", default=None, help="draft model folder [default: the demo draft]")
    p.add_argument("--rows", required=True, help="JSONL file the rows are appended to; a rerun resumes")
    p.add_argument("--fresh", action="store_true", help="move an existing --rows file to FILE.bak first")
    args = p.parse_args(argv)
    args.systems = list(dict.fromkeys(x.strip() for x in args.systems.split(",") if x.strip()))
    try:
        for name in args.systems:
            if name not in PEERS:
                bench.system_tree(name, TreeConfig())
    except Exception as e:
        p.error(f"--systems: {e}")
    if REFERENCE not in args.systems:
        p.error(f"--systems must include {REFERENCE}: every other system's tokens are compared with it")
    if "hf-assisted" in args.systems and not (args.sweep or args.assist_defaults):
        p.error("hf-assisted needs its setting: --sweep FILE (the peer's sweep rows) or --assist-defaults")
    if args.prompts < 1 or args.new_tokens < 1 or args.repeats < 1 or args.prompt_offset < 0:
        p.error("--prompts, --new-tokens and --repeats must be >= 1, --prompt-offset >= 0")
    if args.offload is not None and args.regime != "cpu":
        p.error("--offload auto needs --regime cpu: a cold disk's target is one bigger than host RAM, so it streams")
    if (args.target is None) != (args.draft is None):
        p.error("give both --target and --draft, or neither (the demo pair)")
    args.device = _common.compute_device(args.device)
    return p, args


def peer_assist(args) -> dict:
    """{"label", "assist"} of the setting hf-assisted runs: the sweep's best for this regime and prompt set."""
    if args.assist_defaults:
        return {"label": peer_hf.assist_label(None), "assist": peer_hf.assist_record(None)}
    rows = [r for f in args.sweep for r in bench.read_rows(f)]
    best = peer_hf.best_setting(rows, args.regime, args.prompt_set)
    if best is None:
        raise SystemExit(f"error: {', '.join(args.sweep)} hold no sweep rows for {args.regime}, {args.prompt_set}: "
                         f"run scripts/peer_hf.py --regime {args.regime} --prompt-set {args.prompt_set} first")
    return best


def main(argv=None) -> int:
    from offspec.engine.load import Models, parse_dtype
    from offspec.formats.demo import ensure_demo_models

    p, args = parse_args(argv)
    dtype = parse_dtype(args.dtype)
    assist = peer_assist(args) if "hf-assisted" in args.systems else None
    target_dir, draft_dir = (args.target, args.draft) if args.target else ensure_demo_models()
    settings = {"regime": args.regime, "prompt_set": args.prompt_set, "new_tokens": args.new_tokens,
                "dtype": args.dtype, "cold": args.cold, "device": args.device.type, "repeats": args.repeats,
                "stop": STOP_RULE, "assist": assist and assist["assist"],
                "models": [Path(target_dir).name, Path(draft_dir).name],
                "gpu": _common.device_model(args.device) if args.device.type == "cuda" else None}
    if args.offload is not None:          # absent: --offload REGIME (rows measured before the option match)
        settings["offload"] = args.offload
    bench.check_appendable(args.rows)
    if args.fresh and Path(args.rows).exists():
        os.replace(args.rows, args.rows + ".bak")
    models = Models.open(target_dir, draft_dir)
    prompts = peer_hf.encoded_prompts(args.prompt_set, args.prompts, args.prompt_offset, models.tokenizer)
    try:
        reusable = bench.resumed_rows(args.rows, prompts, args.systems, [0.0], 0, settings)
    except InputError as e:
        p.error(f"{e} (or --fresh)")
    done = {bench.row_key(r) for r in reusable}
    extra = {"regime": args.regime, "prompt_set": args.prompt_set, "settings": settings,
             "command": _common.command_line()}
    if any((pid, None, 0.0) not in done for pid, _ in prompts):
        measure(args, models, prompts, dtype, assist, done, extra)
    ids = {pid for pid, _ in prompts}
    stored = bench.read_rows(args.rows)
    rows = [r for r in timing_rows(stored) if r["id"] in ids]
    checks = rechecks(stored)
    todo = {} if dtype == torch.float32 else recheck_todo(rows, checks)
    if todo:
        for entry in fp32_check(todo, dict(prompts), target_dir, draft_dir, assist, models.eos_ids).values():
            bench.append_row(args.rows, entry)
            checks[entry["id"]] = entry
    failed = [r["id"] for r in rows if verdict(r, checks, dtype == torch.float32) == "fail"]
    print(bench.format_table(bench.summarize(rows, REFERENCE), REFERENCE))
    if failed:
        print(f"FAIL: {', '.join(failed)}: a system's tokens differ from plain greedy's, and float32 does not "
              "explain it", file=sys.stderr)
        return 1
    return 0


def rechecks(rows: list[dict]) -> dict[str, dict]:
    """A rows file's float32 rechecks by prompt id (a later one for a prompt wins)."""
    return {r["id"]: r for r in rows if r.get("kind") == FP32_CHECK}


def timing_rows(rows: list[dict]) -> list[dict]:
    """The measured rows of a rows file (not its fp32 rechecks), one per prompt: a later row for a prompt wins."""
    return list({bench.row_key(r): r for r in rows if r.get("kind") is None and "systems" in r}.values())


def measure(args, models, prompts, dtype, assist, done, extra) -> None:
    """Load offspec as `offspec generate --offload REGIME` does (or --offload auto) and the peer beside it, then
    measure every prompt the rows file lacks."""
    from offspec.engine.load import runtime_config

    trees = {name: bench.system_tree(name, TreeConfig()) for name in args.systems if name not in PEERS}
    longest = max(len(ids) for _, ids in prompts) + args.new_tokens
    offload = OffloadConfig(mode=args.offload or args.regime, drop_page_cache=args.cold)
    tmp = tempfile.mkdtemp(prefix=f"bench-peers-{args.regime}-")
    loaded = None
    try:
        print(f"== {args.regime}: loading offspec through the memory plan, --offload {offload.mode} ...",
              file=sys.stderr)
        loaded = models.load(offload, runtime_config(args.device, dtype), bench.bench_limits(trees.values(), longest,
                                                                                              sampling=False))
        extra["offload_mode"] = loaded.plan.mode         # what --offload resolved to: none = the target resident
        runners = {name: bench.offspec_runner(loaded.engine, tree, SamplingConfig(), ignore_eos=False)
                   for name, tree in trees.items()}
        if set(PEERS) & set(args.systems):
            print(f"== {args.regime}: loading transformers + accelerate ...", file=sys.stderr)
            hf = peer_hf.HfSystems(models.target.path, models.draft.path, dtype, args.regime,
                                   os.path.join(tmp, "hf-offload"), args.cold, device=args.device,
                                   eos_ids=models.eos_ids)
            if "hf-assisted" in args.systems:
                runners["hf-assisted"] = hf.runner(True, peer_hf.assist_of(assist["assist"]))
            if "hf-plain" in args.systems:
                runners["hf-plain"] = hf.runner(False)
        runners = {name: runners[name] for name in args.systems}      # the table's order

        def on_row(row):
            bench.append_row(args.rows, row)
            print(f"{args.regime} {row['id']}: " + ", ".join(f"{name} {c['seconds_per_token']:.3f}"
                                                            for name, c in row["systems"].items()), file=sys.stderr)

        bench.measure(prompts, runners, args.new_tokens, repeats=args.repeats, done=done, extra=extra, on_row=on_row)
    finally:
        if loaded is not None:
            loaded.engine.close()
        shutil.rmtree(tmp, ignore_errors=True)
        gc.collect()


# ------------------------------------------------------------------ identity

def divergences(row: dict) -> dict[str, int]:
    """{system: first token where it differs from the reference}, for the systems of a greedy row that do."""
    ref = row["systems"][REFERENCE]["tokens"]
    out = {name: bench.first_divergence(cell["tokens"], ref) for name, cell in row["systems"].items()}
    return {name: index for name, index in out.items() if index is not None}


def verdict(row: dict, checks: dict, fp32_run: bool) -> str:
    """identical | rounding (bf16: each differing system's float32 rerun gives transformers' plain greedy tokens
    past its difference) | fail | unchecked."""
    found = divergences(row)
    if not found:
        return "identical"
    if fp32_run:
        return "fail"
    check = checks.get(row["id"])
    if check is None or check["checked_tokens"] <= max(found.values()) or not set(found) <= set(check["systems"]):
        return "unchecked"
    rechecked = [check["systems"][name] for name in {*found, REFERENCE} if name in check["systems"]]
    return "rounding" if all(result == "identical" for result in rechecked) else "fail"


def recheck_todo(rows: list[dict], checks: dict) -> dict[str, tuple[int, list[str]]]:
    """{prompt id: (tokens, systems)} to recheck in float32: the greedy rows whose differences no stored check
    covers. The reference (plain greedy) is always rechecked with them."""
    todo = {}
    for row in rows:
        found = divergences(row)
        if found and row.get("temperature", 0.0) == 0.0 and verdict(row, checks, fp32_run=False) == "unchecked":
            todo[row["id"]] = (max(found.values()) + 1, sorted({*found, REFERENCE}))
    return todo


def fp32_check(todo: dict, prompt_ids: dict, target_dir, draft_dir, assist, eos_ids) -> dict[str, dict]:
    """Rerun each (prompt, system) of `todo` in float32 on resident models and compare it with transformers'
    plain greedy generate there: one model set at a time, each loaded once. -> {prompt id: fp32_check row}."""
    from transformers import AutoModelForCausalLM

    from offspec.config import RuntimeConfig
    from offspec.engine.load import load_engine

    print(f"== fp32 recheck of {len(todo)} prompt(s) that differ in bf16 ...", file=sys.stderr)
    fp32 = dict(dtype=torch.float32, device_map={"": "cpu"})
    model = AutoModelForCausalLM.from_pretrained(target_dir, **fp32).eval()
    helper = AutoModelForCausalLM.from_pretrained(draft_dir, **fp32).eval()
    setting = peer_hf.assist_of(assist["assist"]) if assist else None
    reference, runs = {}, {}
    for pid, (n, systems) in todo.items():
        ids = prompt_ids[pid]
        reference[pid] = peer_hf.hf_generate(model, ids, n, eos_ids=eos_ids).tokens
        for name in systems:
            if name in PEERS:
                runs[pid, name] = peer_hf.hf_generate(model, ids, n, helper if name == "hf-assisted" else None,
                                                      setting, eos_ids=eos_ids).tokens
    del model, helper
    gc.collect()
    loaded = load_engine(target_dir, draft_dir, OffloadConfig(mode="none"),
                         RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32))
    try:
        for pid, (n, systems) in todo.items():
            for name in systems:
                if name not in PEERS:
                    tree = bench.system_tree(name, TreeConfig())
                    run = bench.offspec_runner(loaded.engine, tree, SamplingConfig(), ignore_eos=False)
                    runs[pid, name] = run(prompt_ids[pid], n, 0)["tokens"]
    finally:
        loaded.engine.close()
    checks = {}
    for pid, (n, systems) in todo.items():
        result = {name: "identical" if runs[pid, name] == reference[pid] else "differs" for name in systems}
        checks[pid] = {"kind": FP32_CHECK, "id": pid, "checked_tokens": n, "systems": result}
        print(f"fp32 recheck {pid}: {n} tokens, {result}", file=sys.stderr)
    return checks


if __name__ == "__main__":
    _common.run_main(main)
