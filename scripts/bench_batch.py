#!/usr/bin/env python
"""Batched speculation: throughput of `offspec batch` by prompts in flight (B), and the batched peer.

For each prompt set, regime and B in --concurrency (a number, or auto: what `offspec batch --concurrency auto`
does), offspec runs the same prompts (--prompt-sets: code = HumanEval, chat = MT-Bench first turns, with the chat
template; --new-tokens each, EOS ignored so every prompt makes the same count) through Engine.run_batch, the loop
`offspec batch` runs, and records the job's totals (metrics.JobReport): tokens/s, passes, prompts and tokens
per pass, GB streamed per token, and each prompt's latency (s/token over its own passes).

  regimes   disk   the target's layers streamed from its packed store, every read cold (--disk-io; pages
                   dropped behind each read), resident draft
            cpu    on a CPU: the CPU user's default, both models resident (--offload none), a pass is compute;
                   on a GPU: the target's layers in pinned host RAM, streamed over the link (--offload cpu)
  device    --device (default auto: the GPU when there is one). On a GPU a streamed target keeps only its ring
            of 2 slots there (--gpu-budget of 2 layers), as for a target many times the GPU's memory: every
            layer crosses the link every pass, whatever GPU runs it (the demo target would otherwise sit
            resident on any GPU). The draft is resident, with the int8 copy on a CPU only (--draft-quant auto).
  ablation  offspec --tree none at --none-concurrency: the same engine and batching, no speculation (what
            the trees add at a given B)
  peer      transformers + accelerate, the same prompts left-padded into batches of B, greedy generate()
            (disk: device_map layers -> "disk", pages of the weight files dropped before every forward;
            cpu: weights in host RAM, on a GPU device_map layers -> "cpu"; the rest on the compute device). Its
            tokens are checked against offspec's (bf16: agreement, not identity).

Every cell runs --repeats times (default 3): each repeat runs all the cells in an order shuffled for (prompt set,
repeat), so no cell always runs first or last (a drive or a machine that changes speed lands on every cell). Each
cell runs in a process of its own (--cell-process own, the default), as a user's job does: cells that shared one
process ran faster after some cells than after others (docs/notes/2026-11-25-batch-cold-disk-goals.md, "Cold disk again,
on one machine"). Rows of the two kinds are never
pooled: the table's "process" column says which a cell is (rows from before the flag ran in one shared process). The
table gives each cell's median over its repeats with the [min, max] of tokens/s, and × B=1 as the ratio of the
medians. Rows are appended to --rows as they finish, one per (prompt set, regime, system, B, repeat), so an
interrupted run resumes; rows from before repeats count as repeat 0.

Columns of the printed table (every cell; --write-docs shows tokens/s by B for one machine and process kind per
prompt set and regime). A pass streams every target layer once for all prompts in flight.
  machine        the GPU, or on a CPU the CPU, the rows were measured on (`unrecorded`: rows from before rows
                 carried a stamp); process: `own` = each cell ran in a fresh process of its own (as a user's job
                 runs), `shared` = all the cells of a run in one process, one after another (rows from before
                 --cell-process). A cell, its × B=1 and the goals use the runs of one machine and process kind only.
  tokens/s       all prompts' tokens / the job's wall time, the median over the cell's runs with their [min, max];
                 × B=1 = the ratio of the medians (offspec B=1 of the same machine and process). passes,
                 prompts/pass, tokens/pass, GB/token: medians over the runs too.
  draft s/pass   the draft's work (catch-up and growth of every row's tree) a pass.
  pass s         the target pass (waiting: the part of it spent waiting for streamed layers; the transformers peer:
                 its wall time over its forwards).
  stream GB/s    bytes streamed over the reads' and copies' own seconds (they overlap the draft and compute): the
                 drive's pace in the disk regime. These three are medians over the runs that recorded them (–: none
                 did; rows keep them from commit c2b5e19).
  prompt s/token each prompt's own passes' time over its tokens (the latency a prompt sees), median over prompts.
  agrees         the share of each prompt's tokens before the first difference from offspec at B=1, mean over
                 prompts (bf16: batched matmuls round differently).

--predict (no measurement): the cost model's PREDICTION for a 70B target (Llama-3.1-70B shapes, 1B draft) on one
24 GB GPU with 192 GB of host RAM for B = 1..64 prompts in flight: the memory plan at each B (fewer resident
layers as KV caches and trees grow), then s/token = (max(streamed bytes / link, verification compute) + draft)
/ (B x tokens per row-pass), with every assumption printed beside the table.

Examples:
  python scripts/bench_batch.py --prompts 4 --new-tokens 8 --concurrency 1,2 --regimes cpu --no-peer \\
      --cell-process shared   # smoke: one process, one model load
  python scripts/bench_batch.py --prompts 16 --new-tokens 64 --concurrency 1,2,4,8,16,auto --peer-concurrency 8 \\
      --prompt-sets code,chat --rows docs/bench_batch_rows.jsonl --write-docs   # gunzip the .gz first (below)
  python scripts/bench_batch.py --report-only --prompt-sets code,chat --rows docs/bench_batch_rows.jsonl.gz --write-docs

A gzip-compressed --rows (.jsonl.gz; a path naming x.jsonl finds x.jsonl.gz where only that exists) is a read-only
archive: --report-only and --predict read it, a measuring run refuses it before measuring anything (gunzip it to add
rows). --write-docs writes the section's headline table (tokens/s by B
for one machine and process kind per prompt set and regime) and the goals; the printed table has every cell.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
import _common  # noqa: E402
import _stats  # noqa: E402

from offspec.bench import runner as bench  # noqa: E402
from offspec.bench.prompt_sets import load_prompt_set  # noqa: E402
from offspec.config import OffloadConfig, RunLimits, RuntimeConfig, TreeConfig  # noqa: E402
from offspec.engine.generate import GenerationRequest  # noqa: E402
from offspec.engine.load import Models, parse_dtype  # noqa: E402
from offspec.engine.metrics import JobReport, synchronize  # noqa: E402
from offspec.engine.prompt import encode_prompt  # noqa: E402
from offspec.formats.demo import ensure_demo_models  # noqa: E402
from offspec.formats.draft_quant import auto_draft_quant  # noqa: E402
from offspec.plan.costmodel import LINK_GB_PER_S  # noqa: E402
from offspec.plan.sizes import layer_nbytes  # noqa: E402

SECTION = "bench_batch"
# The docstring's column notes, printed beneath the table they explain (python -O drops docstrings: none then).
COLUMN_NOTES = __doc__[__doc__.index("Columns of the printed table"):__doc__.index("\n\n--predict")] if __doc__ else ""
UNRECORDED = "unrecorded"                  # the machine of rows measured before rows carried a stamp
CPU = torch.device("cpu")
PROCESS_WORDS = {"own": "each cell in its own process", "shared": "cells sharing a process"}
# --doc-section -> (marker name, heading, the file it is written into). The goal cells get a table of their own
# because cells pool their rows across commits: rows measured after an engine change that moves them go in a rows
# file of their own, and that table shows them apart from the main table's older rows, in the goals' notes entry.
DOC_SECTIONS = {
    "main": (SECTION, "## Batched speculation: prompts in flight (`scripts/bench_batch.py`)", _common.BENCHMARKS_MD),
    "goals": (SECTION + "_goals", "### Issue #11's goal cells in one sitting, at the current engine",
              _common.REPO / "docs" / "notes" / "2026-11-25-batch-cold-disk-goals.md"),
}


class CellFailed(Exception):
    """A cell's own process exited without its row (its own error printed above); main reports it in one line."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--prompts", type=int, default=16, help="prompts of each set (the first N)")
    p.add_argument("--prompt-sets", default="code",
                   help="code (HumanEval), chat (MT-Bench first turns), or both: code,chat (offspec/bench/prompt_sets.py)")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens per prompt (EOS ignored)")
    p.add_argument("--concurrency", default="1,2,4,8,auto",
                   help="offspec B values, comma separated; auto = `offspec batch --concurrency auto`")
    p.add_argument("--peer-concurrency", default="8", help="B values of the transformers peer, comma separated")
    p.add_argument("--no-peer", dest="peer", action="store_false", help="skip the transformers peer")
    p.add_argument("--none-concurrency", default="8", help="B values of offspec --tree none (empty: none)")
    p.add_argument("--regimes", default="disk,cpu", help="disk, cpu (comma separated)")
    p.add_argument("--tree-budget", default="auto", help="offspec tree budget (auto or a number)")
    p.add_argument("--repeats", type=int, default=3, help="runs of every cell, in an order shuffled per repeat")
    p.add_argument("--disk-io", default="direct", choices=["direct", "buffered"], help="disk regime reads")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto",
                   help="compute device: auto (the GPU when there is one, else the CPU), cpu, or cuda[:N]; rows are "
                        "kept per device, and a GPU's rows per GPU model")
    p.add_argument("--cell-process", default="own", choices=["own", "shared"],
                   help="own: every cell in a fresh process of its own (as a user's job runs); shared: all cells in "
                        "this process (quicker, for smoke runs; a cell can depend on the one before it)")
    p.add_argument("--one-cell", default=None, help=argparse.SUPPRESS)   # internal: {prompt_set, regime, system, B,
    #                                     dir, out} as JSON; measure that cell alone, write its dict to out, exit
    p.add_argument("--rows", default=None, help="JSONL file the rows are appended to (resume: done cells are skipped); "
                                                "a .jsonl.gz is read only (--report-only, --predict)")
    p.add_argument("--write-docs", action="store_true", help="replace this script's section (--doc-section)")
    p.add_argument("--doc-section", default="main", choices=sorted(DOC_SECTIONS),
                   help="with --write-docs, which section: main (the table of every cell, in docs/benchmarks.md) or "
                        "goals (the goal cells measured in one sitting at one commit, from a rows file of their own, "
                        "in docs/notes/2026-11-25-batch-cold-disk-goals.md)")
    p.add_argument("--report-only", action="store_true",
                   help="measure nothing: the table (and with --write-docs the section) from the --rows of these "
                        "--prompt-sets and settings")
    p.add_argument("--predict", action="store_true", help="print (with --write-docs: write) the 70B-on-24GB "
                   "prediction for B = 1..64 instead of measuring")
    p.add_argument("--tokens-per-row-pass", type=float, default=None,
                   help="prediction: tokens one prompt gains per pass (default: measured offspec B=1 disk rows' "
                        "tokens/pass in --rows, else 8)")
    p.add_argument("--link-gbps", type=float, default=LINK_GB_PER_S, help="prediction: host-to-device GB/s, pinned (PCIe 4.0 x16)")
    p.add_argument("--draft-ms", type=float, default=None,
                   help="prediction: one batched draft call, ms [default: the 1B-shaped draft's call measured on a "
                        "GPU at the call's width (offspec.plan.costmodel.REFERENCE_GPU)]")
    p.add_argument("--tree-nodes", type=int, default=64, help="prediction: tree nodes per prompt per pass")
    args = p.parse_args(argv)
    if not (args.report_only or args.predict or args.one_cell):
        bench.check_appendable(args.rows)      # before anything is measured: a .gz rows file is an archive
    # Resolved once: a report (--report-only) may name a device this machine lacks; it only picks that device's rows.
    args.device = _common.compute_device(args.device, here=not args.report_only)
    return args


def predict(args, rows: list[dict]) -> tuple[str, list[str]]:
    """The PREDICTION section: the plan and cost model for a 70B on a 24 GB GPU at B = 1..64; and the lines saying
    why the B values that do not fit do not (printed, not in the section)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
    from shapes import headers_only_checkpoint  # config + safetensors headers of real models, no weights

    from offspec.errors import BudgetError
    from offspec.formats.checkpoint import Checkpoint
    from offspec.plan.costmodel import (
        REFERENCE_GPU,
        GpuSetup,
        draft_call_seconds,
        pass_compute_seconds,
        predict_seconds_per_token,
    )
    from offspec.plan.machine import GB, Machine
    from offspec.plan.search import make_plan
    from offspec.plan.sizes import ModelSpec
    measured = [r["tokens_per_pass"] for r in rows if r["regime"] == "disk" and r["system"] == "offspec"
                and r["concurrency"] == 1 and r["prompt_set"] == "code"]
    tau = args.tokens_per_row_pass or (statistics.median(measured) if measured else 8.0)
    context, depth = 1024, 12
    with tempfile.TemporaryDirectory() as tmp:
        target, draft = (ModelSpec.of(Checkpoint(headers_only_checkpoint(Path(tmp), name), headers_only=True))
                         for name in ("Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct"))
    cfg = target.cfg                                   # parameters of the decoder layers' matrices
    params = cfg.n_layers * (cfg.hidden_size * (2 * cfg.n_heads + 2 * cfg.n_kv_heads) * cfg.head_dim
                             + 3 * cfg.hidden_size * cfg.intermediate_size)
    headers = ["B", "plan", "streamed GB/pass", "transfer s", "compute s", "PREDICTED s/token", "PREDICTED tokens/s"]
    table, why = [], []
    for B in (1, 2, 4, 8, 16, 32, 64):
        try:
            plan = make_plan(target, draft, OffloadConfig(mode="auto"), RuntimeConfig(dtype=torch.bfloat16),
                             RunLimits(context=context, tree_budget=args.tree_nodes, concurrency=B, sampling=False),
                             Machine.given(24 * GB, 192 * GB))
        except BudgetError as e:
            table.append([str(B), "does not fit", "–", "–", "–", "–", "–"])
            why.append(f"B={B} does not fit: {e}")
            continue
        compute = pass_compute_seconds(params // cfg.n_layers, cfg.n_layers, B * (args.tree_nodes + 1))
        call_width = B * args.tree_nodes // depth          # a call grows one level of every row's tree
        draft_s = (depth + 1) * (args.draft_ms / 1000 if args.draft_ms else draft_call_seconds(call_width))
        p = predict_seconds_per_token(plan.streamed_bytes, GpuSetup(link_gb_per_s=args.link_gbps), B * tau, draft_s,
                                      compute)
        table.append([str(B), f"{len(plan.placement.resident)} resident, {plan.mode}", f"{plan.streamed_bytes / 1e9:.1f}",
                      f"{p['transfer_seconds_per_pass']:.2f}", f"{compute:.2f}", f"{p['seconds_per_token']:.4f}",
                      f"{1 / p['seconds_per_token']:.1f}"])
    assumptions = (f"PREDICTED from measured parts, not measured. Assumptions: Llama-3.1-70B target and Llama-3.2-1B draft "
                   f"in bf16; a 24 GB GPU and 192 GB of host RAM (offload auto); context {context} tokens a prompt; "
                   f"{args.tree_nodes} tree nodes per prompt per pass; each prompt gains {tau:.2f} tokens a pass "
                   f"({f'measured here: offspec B=1, disk regime, demo pair, median of {len(measured)} runs' if measured and not args.tokens_per_row_pass else 'given'}); "
                   f"link {args.link_gbps:g} GB/s pinned (assumed: PCIe 4.0 x16); verification compute of the "
                   f"{cfg.n_layers} layers over B x {args.tree_nodes + 1} tokens"
                   + (f", and the draft's calls at {args.draft_ms:g} ms, " if args.draft_ms else " and the draft's calls ")
                   + f"({depth + 1} a round, one level of every row's tree each, not overlapped with the pass) as "
                   f"measured on {REFERENCE_GPU.device} (scripts/gpu_session.py; docs/gpu_70b.md). "
                   "s/token = (max(transfer, compute) + draft) / (B x tokens per prompt-pass).")
    fits = (["", f"Why {', '.join(w.split(' ')[0] for w in why)} {'does' if len(why) == 1 else 'do'} not fit (the memory "
             "plan's sum, and what would fit): printed by the command."] if why else [])
    return "\n".join(["### Prediction: a 70B on one 24 GB GPU, by prompts in flight",
                      "```", _common.command_line(), "```", assumptions, "",
                      _common.markdown_table(headers, table), *fits]), why


def load_rows(path) -> list[dict]:
    """The rows of --rows (.jsonl, or .jsonl.gz: offspec.bench.runner.read_rows); a torn last line (a run killed while writing) is
    skipped with a warning."""
    rows = bench.read_rows(path, torn="ignored (its cell will be measured again)")
    for row in rows:                   # rows from before prompt sets were all HumanEval, before repeats one run
        row.setdefault("prompt_set", "code")
        row.get("settings", {}).setdefault("prompt_set", "code")
        row.setdefault("repeat", 0)
        row.get("settings", {}).setdefault("cell_process", "shared")   # rows from before --cell-process
        row.get("settings", {}).setdefault("device", "cpu")            # rows from before --device
    return rows


def append_row(path, row: dict) -> None:
    if path is not None:
        bench.append_row(path, row)


def offload_of(regime: str, device: torch.device, layer_bytes: int, store_dir, disk_io: str) -> OffloadConfig:
    """Where the target's layers live in a regime (the module docstring's table). On a GPU a streamed target gets a
    --gpu-budget of its ring alone, so no layer stays resident and every pass moves the whole target."""
    if device.type == "cpu":
        return OffloadConfig(mode="disk" if regime == "disk" else "none", store_dir=store_dir, disk_io=disk_io)
    ring = OffloadConfig().n_slots * layer_bytes
    return OffloadConfig(mode=regime, gpu_budget=ring, store_dir=store_dir, disk_io=disk_io)


def offspec_cell(models: Models, regime: str, requests: list[GenerationRequest], B, args, store_dir,
                 plain: bool = False) -> dict:
    """One job of every request at B in flight -> the row (JobReport totals, latencies, tokens). B "auto": what
    `offspec batch --concurrency auto` does (the memory plan's most, up to AUTO_CONCURRENCY, and as many of
    those as the measured costs favour)."""
    gc.collect()      # the previous cells' engines (reference cycles): the memory plan measures what is free
    device, dtype = args.device, parse_dtype(args.dtype)
    offload = offload_of(regime, device, layer_nbytes(models.target.config, dtype), store_dir, args.disk_io)
    runtime = RuntimeConfig(device=device, dtype=dtype, draft_quant=auto_draft_quant(device.type, dtype))
    if plain:
        requests = [dataclasses.replace(r, tree=TreeConfig(policy="none")) for r in requests]
    longest = max(len(r.prompt_ids) for r in requests) + args.new_tokens
    tree = requests[0].tree

    adapt = B == "auto"
    limits = RunLimits(context=longest + (tree.budget or 1024) + 2, tree_budget=tree.budget, sampling=False,
                       concurrency=None if adapt else B, concurrency_cap=len(requests))
    loaded = models.load(offload, runtime, limits, progress=False)
    most = loaded.plan.concurrency
    job, steps = JobReport(concurrency=most, device=str(loaded.engine.device)), {}
    started = time.perf_counter()
    try:
        for event in loaded.engine.run_batch(requests, concurrency=most, adapt_rows=loaded.plan.concurrency_auto):
            if event.error is not None:
                raise event.error
            job.add(event.step)
            steps.setdefault(event.request, []).append(event.step)
            if event.step.finish_reason is not None:
                job.prompts += 1
    finally:
        job.wall_seconds = time.perf_counter() - started
        loaded.engine.close()
    latency = [sum(s.draft_seconds + s.target_seconds for s in st) / sum(len(s.tokens) for s in st)
               for st in steps.values()]
    return {**job.to_dict(), "concurrency": B,
            "most_in_flight": most,
            "median_prompt_seconds_per_token": statistics.median(latency),
            "tokens": {str(i): [t for s in st for t in s.tokens] for i, st in steps.items()},
            "offload": loaded.plan.mode, "weights_source": loaded.engine.weights_source(),
            "device": str(loaded.engine.device)}


def peer_cell(target_dir, regime: str, prompt_ids: list[list[int]], B: int, args, offload_folder) -> dict:
    """transformers generate over left-padded batches of B prompts (greedy, exactly --new-tokens each)."""
    from peer_hf import HfSystems

    from offspec.stream.disk import drop_page_cache
    device = args.device
    hf = HfSystems(target_dir, None, parse_dtype(args.dtype), regime, offload_folder, cold=True,
                   device=device)
    passes = [0]
    hook = hf.target.register_forward_pre_hook(lambda module, a: passes.__setitem__(0, passes[0] + 1))
    tokens, latency = {}, []
    started = time.perf_counter()
    for first in range(0, len(prompt_ids), B):
        batch = prompt_ids[first: first + B]
        width = max(len(ids) for ids in batch)
        ids = torch.tensor([[0] * (width - len(x)) + x for x in batch], device=device)    # (b, width) left-padded
        mask = torch.tensor([[0] * (width - len(x)) + [1] * len(x) for x in batch], device=device)
        drop_page_cache(*hf.weight_files)
        t0 = time.perf_counter()
        with torch.no_grad():
            out = hf.target.generate(ids, attention_mask=mask, max_new_tokens=args.new_tokens,
                                     min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            synchronize(device)
        seconds = time.perf_counter() - t0
        for k, row in enumerate(out[:, width:].tolist()):
            tokens[str(first + k)] = row
            latency.append(seconds / args.new_tokens)
    hook.remove()
    wall = time.perf_counter() - started
    generated = sum(len(t) for t in tokens.values())
    return {"concurrency": B, "prompts": len(prompt_ids), "generated_tokens": generated, "wall_seconds": wall,
            "tokens_per_second": generated / wall, "passes": passes[0], "rows_per_pass": None,
            "tokens_per_pass": generated / max(passes[0], 1), "median_prompt_seconds_per_token": statistics.median(latency),
            "target_seconds_per_pass": wall / max(passes[0], 1),         # the forward, with its weights' reads
            "tokens": tokens}


def agreement(a: list[int], b: list[int]) -> float:
    """The share of a's tokens before b first differs from it."""
    first = bench.first_divergence(a, b)
    return (len(a) if first is None else first) / max(len(a), 1)


def cell_order(B) -> int:
    """Table order of a B value: numbers, then auto."""
    return 10 ** 6 if B == "auto" else int(B)


def concurrency_values(text: str) -> list:
    return [b if b == "auto" else int(b) for b in text.split(",") if b]


def machine_of(row: dict) -> str:
    """The GPU a row was measured on, or on a CPU the CPU (its stamp; rows from before stamps: "unrecorded").
    Cells, their B=1 baselines, resume and the goals are per machine: runs of two machines are never pooled."""
    return row.get("gpu") or row.get("stamp", {}).get("machine", "").split(",")[0] or UNRECORDED


def process_of(row: dict) -> str:
    """"own" (the cell ran in a fresh process) or "shared" (all cells of a run in one process)."""
    return row.get("settings", {}).get("cell_process", "shared")


def cells_of(rows: list[dict]) -> dict:
    """(machine, process, prompt set, regime, system, B) -> that cell's rows, one per repeat."""
    cells: dict = {}
    for r in rows:
        key = (machine_of(r), process_of(r), r["prompt_set"], r["regime"], r["system"], r["concurrency"])
        cells.setdefault(key, []).append(r)
    return cells


def median_of(runs: list[dict], key: str):
    values = [r[key] for r in runs if r.get(key) is not None]
    return statistics.median(values) if values else None


def report(rows: list[dict], args) -> tuple[list[str], list[list[str]]]:
    """One line per cell: medians over its repeats (tokens/s with [min, max] when it ran more than once)."""
    headers = ["prompts", "regime", "machine", "process", "system", "B", "runs", "tokens/s [min, max]", "× B=1",
               "passes", "prompts/pass", "tokens/pass", "GB/token", "draft s/pass", "pass s (waiting)",
               "stream GB/s", "prompt s/token (median)", "agrees with offspec B=1"]
    out, cells = [], cells_of(rows)
    order = {"offspec": 0, "offspec --tree none": 1}
    for key in sorted(cells, key=lambda k: (("code", "chat").index(k[2]), ("disk", "cpu").index(k[3]),
                                            k[0] == UNRECORDED, k[0], k[1] != "own", order.get(k[4], 2),
                                            cell_order(k[5]))):
        machine, process, prompt_set, regime, system, B = key
        runs = cells[key]
        base = cells.get((machine, process, prompt_set, regime, "offspec", 1))
        speed = [r["tokens_per_second"] for r in runs]
        speedup = statistics.median(speed) / median_of(base, "tokens_per_second") if base else None
        first_base = min(base, key=lambda r: r["repeat"]) if base else None
        agree = (statistics.mean(agreement(first_base["tokens"][i], r["tokens"][i])
                                 for r in runs for i in first_base["tokens"]) if base else None)
        f = _common.fmt
        most = sorted({r["most_in_flight"] for r in runs if r.get("most_in_flight")})
        shown_B = B if B != "auto" else f"auto (≤ {'/'.join(map(str, most))})"
        speed_text = f(statistics.median(speed)) + (f" [{min(speed):.3f}, {max(speed):.3f}]" if len(runs) > 1 else "")
        out.append([prompt_set, regime, machine, process, system, shown_B, str(len(runs)), speed_text,
                    f"{speedup:.2f}×" if speedup else "–", str(round(median_of(runs, "passes"))),
                    f(median_of(runs, "rows_per_pass")) if median_of(runs, "rows_per_pass") else "–",
                    f(median_of(runs, "tokens_per_pass")), f(median_of(runs, "gb_streamed_per_token") or 0.0),
                    f(median_of(runs, "draft_seconds_per_pass")),        # "–": rows from before these were kept
                    f(median_of(runs, "target_seconds_per_pass"))
                    + (f" ({f(waiting)})" if (waiting := median_of(runs, "wait_seconds_per_pass")) is not None else ""),
                    f(median_of(runs, "stream_gb_per_second"), 2),
                    f(median_of(runs, "median_prompt_seconds_per_token")),
                    f"{agree:.0%}" if agree is not None else "–"])
    return headers, out


def shown_kinds(rows: list[dict]) -> dict:
    """(prompt set, regime) -> the one (machine, process) whose cells the docs section shows: a stamped machine
    before `unrecorded` rows, cells run in their own process before cells sharing one (the table's own order)."""
    kinds: dict = {}
    for machine, process, prompt_set, regime, *_ in sorted(
            cells_of(rows), key=lambda k: (k[0] == UNRECORDED, k[0], k[1] != "own")):
        kinds.setdefault((prompt_set, regime), (machine, process))
    return kinds


def headline(rows: list[dict]) -> tuple[list[str], list[list[str]], list[dict]]:
    """The docs section's table: tokens/s by B (the median over a cell's runs, and × offspec B=1 of the same
    machine and process), one line per (prompt set, regime, system), for the kind shown_kinds picks; and the rows
    it shows (for their goals and stamps). The command's printed table has every kind and column."""
    kinds = shown_kinds(rows)
    shown = [r for r in rows if kinds.get((r["prompt_set"], r["regime"])) == (machine_of(r), process_of(r))]
    cells = cells_of(shown)
    columns = sorted({k[5] for k in cells}, key=cell_order)
    order = {"offspec": 0, "offspec --tree none": 1}
    lines = sorted({k[:5] for k in cells}, key=lambda k: (("code", "chat").index(k[2]), ("disk", "cpu").index(k[3]),
                                                          order.get(k[4], 2)))
    table = []
    for machine, process, prompt_set, regime, system in lines:
        base = median_of(cells.get((machine, process, prompt_set, regime, "offspec", 1), []), "tokens_per_second")
        runs = sorted({len(cells[(machine, process, prompt_set, regime, system, B)]) for B in columns
                       if (machine, process, prompt_set, regime, system, B) in cells})
        line = [prompt_set, regime, f"{machine}, {process}", system,
                str(runs[0]) if len(runs) == 1 else f"{runs[0]}–{runs[-1]}"]
        for B in columns:
            runs_of = cells.get((machine, process, prompt_set, regime, system, B))
            if not runs_of:
                line.append("")
                continue
            speed = median_of(runs_of, "tokens_per_second")
            line.append(f"{speed:.2f}" + (f" ({speed / base:.2f}×)" if base else ""))
        table.append(line)
    headers = ["prompts", "regime", "machine, process", "system", "runs",
               *(f"B={B}" if B != "auto" else "auto" for B in columns)]
    return headers, table, shown


def settings_of(args, prompt_set: str) -> dict:
    """What a row must share with this run to be one of its cells (the rest of the key: regime, system, B, repeat,
    machine)."""
    return {"prompts": args.prompts, "new_tokens": args.new_tokens, "tree_budget": args.tree_budget,
            "dtype": args.dtype, "disk_io": args.disk_io, "prompt_set": prompt_set, "cell_process": args.cell_process,
            "device": args.device.type}


def requests_of(models: Models, prompt_set: str, args) -> tuple[list[list[int]], list[GenerationRequest]]:
    """The first --prompts of a set as token ids, and as offspec requests (--new-tokens each, EOS ignored)."""
    budget = None if args.tree_budget == "auto" else int(args.tree_budget)
    prompt_ids = [encode_prompt(models.tokenizer, text) for _, text in load_prompt_set(prompt_set, args.prompts)]
    requests = [GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=args.new_tokens, ignore_eos=True,
                                  tree=TreeConfig(budget=budget)) for ids in prompt_ids]
    return prompt_ids, requests


def cell_here(models: Models, target_dir, prompt_set: str, regime: str, system: str, B, args, tmp: str) -> dict:
    """One cell measured in this process. The disk store and the peer's offload folder live in `tmp`, built by the
    first cell that needs them and read by the rest."""
    prompt_ids, requests = requests_of(models, prompt_set, args)
    if system.startswith("offspec"):
        return offspec_cell(models, regime, requests, B, args, os.path.join(tmp, "store"), plain=system != "offspec")
    return peer_cell(target_dir, regime, prompt_ids, B, args, os.path.join(tmp, "hf-offload"))


def cell_command(args, prompt_set: str, regime: str, system: str, B, tmp: str, out: str) -> list[str]:
    """This script's command line that measures one cell in a fresh process and writes its dict to `out`."""
    spec = {"prompt_set": prompt_set, "regime": regime, "system": system, "B": B, "dir": tmp, "out": out}
    return [sys.executable, str(Path(__file__).resolve()), "--prompts", str(args.prompts),
            "--new-tokens", str(args.new_tokens), "--tree-budget", str(args.tree_budget), "--dtype", args.dtype,
            "--disk-io", args.disk_io, "--device", str(args.device), "--one-cell", json.dumps(spec)]


def cell_in_own_process(args, prompt_set: str, regime: str, system: str, B, tmp: str) -> dict:
    """One cell measured by a fresh process of this script (its progress and errors print to our stderr)."""
    out = os.path.join(tmp, "cell.json")
    if os.path.exists(out):
        os.remove(out)
    done = subprocess.run(cell_command(args, prompt_set, regime, system, B, tmp, out))
    if done.returncode != 0 or not os.path.exists(out):
        raise CellFailed(f"the {prompt_set} {regime} {system} B={B} cell failed in its own process "
                         f"(exit {done.returncode}); the rows measured so far are kept")
    return json.loads(Path(out).read_text())


def one_cell(args) -> int:
    """--one-cell: measure the cell it names in this (fresh) process, write its dict to the named file."""
    spec = json.loads(args.one_cell)
    target_dir, draft_dir = ensure_demo_models()
    models = Models.open(target_dir, draft_dir)
    cell = cell_here(models, target_dir, spec["prompt_set"], spec["regime"], spec["system"], spec["B"], args,
                     spec["dir"])
    Path(spec["out"]).write_text(json.dumps(cell))
    return 0


def measure_set(models: Models, target_dir, prompt_set: str, args, all_rows: list[dict], tmp: str) -> list[dict]:
    """Every (regime, system, B) cell of one prompt set: the rows already in --rows for these settings, and the
    missing ones measured now (each appended to --rows as it finishes). `models`: opened here for shared-process
    cells, None when every cell runs in its own process."""
    settings = settings_of(args, prompt_set)
    device = args.device
    here = _common.device_model(device)
    rows = [r for r in all_rows if r.get("settings") == settings]
    done = {(r["regime"], r["system"], r["concurrency"], r["repeat"]) for r in rows if machine_of(r) == here}
    cells = []
    for regime in args.regimes.split(","):
        cells += [(regime, "offspec", b) for b in concurrency_values(args.concurrency)]
        cells += [(regime, "offspec --tree none", b) for b in concurrency_values(args.none_concurrency)]
        if args.peer:
            cells += [(regime, "transformers", int(b)) for b in args.peer_concurrency.split(",")]
    for repeat in range(args.repeats):
        for regime, system, B in _stats.shuffled_order(cells, prompt_set, repeat):
            if (regime, system, B, repeat) in done:
                continue
            print(f"[{prompt_set} {regime}] {system} B={B} (repeat {repeat + 1}/{args.repeats}) ...", file=sys.stderr)
            cell = (cell_in_own_process(args, prompt_set, regime, system, B, tmp) if args.cell_process == "own" else
                    cell_here(models, target_dir, prompt_set, regime, system, B, args, tmp))
            row = {"prompt_set": prompt_set, "regime": regime, "system": system, **cell, "settings": settings,
                   "repeat": repeat, "stamp": _stats.stamp(), **({"gpu": here} if device.type == "cuda" else {})}
            rows.append(row)
            append_row(args.rows, row)
            print(f"[{prompt_set} {regime}] {system} B={B}: {cell['tokens_per_second']:.3f} tokens/s", file=sys.stderr)
    return rows


def goal_lines(rows: list[dict], compact: bool = False) -> list[str]:
    """Issue #11's goals, per prompt set, from the cold-disk rows: B=8 >= 3x the tokens/s of B=1, and >= 4x
    transformers' batched generate at B=8. compact: both goals of a prompt set on one line (the docs section)."""
    lines = []
    cells = cells_of(rows)
    for machine, process in sorted({k[:2] for k in cells}, key=lambda k: (k[0] == UNRECORDED, k[0], k[1] != "own")):
        for prompt_set in ("code", "chat"):
            disk = {(system, B): median_of(runs, "tokens_per_second")
                    for (m, p, s, regime, system, B), runs in cells.items()
                    if (m, p, regime, s) == (machine, process, "disk", prompt_set)}
            b8, b1, peer = disk.get(("offspec", 8)), disk.get(("offspec", 1)), disk.get(("transformers", 8))
            if b8 is None:
                continue
            head = f"- {prompt_set}, cold disk ({machine}, {PROCESS_WORDS[process]}): offspec B=8 {b8:.2f} tokens/s = "
            verdicts = [f"{b8 / base:.2f}× {name} ({base:.2f}); goal ≥ {goal:g}×: "
                        f"{'met' if b8 / base >= goal else 'NOT met'}"
                        for name, base, goal in (("offspec B=1", b1, 3.0), ("transformers B=8", peer, 4.0))
                        if base is not None]
            lines += [head + ". ".join(verdicts)] if compact else [head + v for v in verdicts]
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.repeats < 1:
        print(f"bench_batch: --repeats must be at least 1, not {args.repeats}", file=sys.stderr)
        return 2
    if args.one_cell:
        return one_cell(args)
    if args.predict:
        text, why = predict(args, load_rows(args.rows))
        print("\n".join([text, "", *why]))
        if args.write_docs:
            _common.write_doc_section(SECTION + "_prediction", text)
        return 0
    started, load_at_start = time.time(), _common.load_average()
    device = args.device
    header_device = device if device.type == "cpu" or torch.cuda.is_available() else CPU   # a report of GPU rows here
    all_rows, kept = load_rows(args.rows), []
    if args.report_only:            # every row of these settings, whichever --cell-process measured it
        kept = [r for prompt_set in args.prompt_sets.split(",") for r in all_rows
                if {**r.get("settings", {}), "cell_process": args.cell_process} == settings_of(args, prompt_set)]
    else:
        target_dir, draft_dir = ensure_demo_models()
        models = Models.open(target_dir, draft_dir) if args.cell_process == "shared" else None
        with tempfile.TemporaryDirectory(prefix="offspec-bench-batch-") as tmp:
            try:
                for prompt_set in args.prompt_sets.split(","):
                    kept += measure_set(models, target_dir, prompt_set, args, all_rows, tmp)
            except CellFailed as e:
                print(f"bench_batch: {e}", file=sys.stderr)
                return 1
    if not kept:
        print(f"bench_batch: no {device.type} rows of these settings in {args.rows} (--device picks another "
              "device's rows)", file=sys.stderr)
        return 1
    headers, table = report(kept, args)
    print(_common.text_table(headers, table))
    print("\n" + COLUMN_NOTES + "\n")
    print("\n".join(goal_lines(kept)))
    if args.write_docs:
        section, heading, path = DOC_SECTIONS[args.doc_section]
        head, line, shown = headline(kept)
        body = "\n".join([
            heading,
            _common.run_header(header_device, started, load_at_start, shown),
            f"One job per cell: {args.prompts} prompts of a set (code: HumanEval, chat: MT-Bench first turns; chat "
            f"template), {args.new_tokens} new tokens each (EOS ignored), {args.dtype}, greedy, tree budget "
            f"{args.tree_budget}, demo pair (1.5B target, 0.5B draft"
            + (", int8 draft copy" if device.type == "cpu" else
               f"; on the GPU only the target's ring of {OffloadConfig().n_slots} slots resident")
            + ") with B prompts in flight; disk: every pass reads the target cold from its store; cpu: the target in "
            "host RAM. A cell: all prompts' tokens over the job's wall time, the median over its runs (each run's "
            "cells in an order shuffled per repeat), and in brackets its ratio to offspec B=1's median. Per prompt "
            "set and regime one machine and process kind is shown (own: each cell in a fresh process); the command "
            "prints every kind (shared: a run's cells in one process) with passes, tokens a pass, draft and pass seconds "
            "and agreement with B=1, and what each column is.",
            "", _common.markdown_table(head, line), "", *goal_lines(shown, compact=True)])
        _common.write_doc_section(section, body, path=path)
    return 0


if __name__ == "__main__":
    _common.run_main(main)
