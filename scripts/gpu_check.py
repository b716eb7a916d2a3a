#!/usr/bin/env python
"""The first-GPU checklist (docs/streaming.md §8) in one command: about 7 minutes on one GPU
(3 with --quick), then docs/gpu_check.json and docs/gpu_check.md say what passed and what was measured.

Sections, in order; each records its own failure (with the error) and the check goes on:
  gpu_tests   python -m pytest -m gpu: the CUDA ring-tearing tests (torch.cuda._sleep on both streams, layer L
              filled with L+1, broken streamers that must be caught), streamed == resident bitwise in fp32
              across slot counts, resident budgets and passes, streamed passes under
              torch.cuda.set_sync_debug_mode("error"), offspec's pinned host buffers, the quantized target's
              int8/nf4 dequantization on the copy stream (tests/test_gpu.py and the GPU tests of
              tests/test_offload.py and tests/test_target_quant.py)
  sanitizer   the ring tests again under TORCH_CUDA_SANITIZER=1 (PyTorch's CUDA Stream Sanitizer, which checks
              every kernel's accesses against the stream order), plus proof that it sees a missing wait
  bandwidth   host -> device GB/s, pinned (offspec's HostBuffer: mmap + cudaHostRegister, via
              CudaBackend.host_buffer) vs pageable (a plain torch tensor), several sizes, timed by CUDA events
              on the copy stream; and how long pinning each size took
  overlap     streamed forwards of random Llama-2-7B-shaped bf16 layers (~400 MB each), all streamed through
              2 slots, back to back: per pass the copy time and the compute stall from the streamer's own
              StreamStats, the same forward with every layer resident (compute), and
              overlap efficiency = max(transfer, compute) / pass (1.0: the transfer is fully hidden);
              the streamed logits must equal the resident ones bit for bit
  demo        the demo pair end to end with forced streaming (--offload cpu, a --gpu-budget of 3 layers:
              2 ring slots + 1 resident layer): float32 streamed vs --offload none must give identical tokens
              (greedy, fixed tree budget), and so must the prompt in `offspec batch` with 2 prompts in flight
              (streamed, float32); a bfloat16 streamed run gives s/token and the report's fields. Where the demo
              models are not installed (the device machine a session is lent reaches no package registry), a
              random 8-layer pair built on the spot (tests/tiny.py) runs instead: the same checks of the
              tokens, speed figures that are not the demo pair's
  doctor      `offspec doctor --quick`: devices, host memory, the largest pinnable buffer, link and drive
              rates, the advice for the demo target

Exit code: 0 when every section passed, 1 otherwise. Without CUDA: one line, exit 0, and a JSON summary
saying "skipped" (a file holding a GPU run's results is never overwritten by a skip).

Examples:
  python scripts/gpu_check.py                         # everything, ~7 min; writes docs/gpu_check.{json,md}
  python scripts/gpu_check.py --quick                 # smaller sizes, ~3 min
  python scripts/gpu_check.py --sections gpu_tests,sanitizer --out /tmp/check.json

On a machine lent for minutes, with no package registry (the workplace's device machine): run
scripts/gpu_session.py, which runs this script (--quick) and then the 70B-shaped measurements, e.g.
  PYTHONUNBUFFERED=1 python3 scripts/gpu_session.py --out $OUT
The demo section then runs its random pair; the nf4 GPU tests need bitsandbytes, which such a machine lacks
unless its wheel is carried (without it they are skipped, with that reason).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ElementTree
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Optional

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))                # this checkout's offspec, not an installed one
sys.path.insert(0, str(REPO / "scripts"))

import _common  # noqa: E402
from bench_stream import forward_at, make_inputs, prefill, settle  # noqa: E402

from offspec.bench.runner import first_divergence  # noqa: E402
from offspec.cli.doctor import measure_bandwidth  # noqa: E402
from offspec.config import ModelConfig, OffloadConfig  # noqa: E402
from offspec.engine.load import open_target_layers  # noqa: E402
from offspec.engine.metrics import Timer  # noqa: E402
from offspec.formats.layout import GlobalWeights, layer_shapes  # noqa: E402
from offspec.model.forward import Model  # noqa: E402
from offspec.model.kv_cache import KVCache  # noqa: E402
from offspec.plan.placement import LayerPlan  # noqa: E402
from offspec.plan.sizes import layer_nbytes  # noqa: E402

DEFAULT_OUT = REPO / "docs" / "gpu_check.json"
# In this order; doctor comes after demo, so its advice covers the demo target that the demo section prepared.
SECTIONS = ("gpu_tests", "sanitizer", "bandwidth", "overlap", "demo", "doctor")
SKIP_LINE = "no CUDA device: nothing to check; skipped"
RESULT_KEY = {"gpu_tests": "tests", "sanitizer": "tests", "bandwidth": "rows", "overlap": "rows", "doctor": "report",
              "demo": "runs"}   # the key a section's results live under (absent when it raised before them)

# The ring tests (and the sanitizer's own proof tests) that run under TORCH_CUDA_SANITIZER=1; the harness's
# broken-streamer tests are left out there (the sanitizer would stop them before they tear a read).
SANITIZER_SELECTION = ["tests/test_gpu.py", "-m", "gpu", "-k", "cuda_ring_holds or cuda_sanitizer"]
PYTEST_TIMEOUT_S = 300
CLI_TIMEOUT_S = 300

# Llama-2-7B's decoder layer: 202M parameters, 404 MB in bf16.
OVERLAP_MODEL = ModelConfig(arch="llama", vocab_size=32000, hidden_size=4096, intermediate_size=11008, n_layers=8,
                            n_heads=32, n_kv_heads=32, head_dim=128, rms_norm_eps=1e-5)

DEMO_PROMPT = "Write a Python function that checks whether a number is prime."
BATCH_COMPANION = "Explain what a hash map is."   # the demo prompt's company in the batch run (2 rows in flight)
DEMO_TREE_BUDGET = 32          # fixed for the float32 pair (the same trees) and one bf16 run beside the default
RANDOM_PAIR_LAYERS = 8         # the random pair's (demo_pair): with the 3-layer --gpu-budget, 7 layers stream
DEMO_REPORT_FIELDS = ("new_tokens", "finish_reason", "seconds_per_token", "seconds_per_token_e2e", "tokens_per_pass",
                      "passes", "load_seconds", "prefill_seconds", "draft_seconds", "target_seconds", "wait_seconds",
                      "compute_seconds", "transfer_seconds", "gb_streamed", "gb_per_second", "prefetch_gb",
                      "peak_device_gb", "peak_host_gb", "tree_budget", "tree_sizes", "offload", "weights_source",
                      "dtype",
                      # the batch run's job report (metrics.JobReport)
                      "tokens_per_second", "rows_per_pass", "gb_streamed_per_token", "stream_gb_per_second")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--out", default=None, help="the JSON summary; the markdown rendering goes beside it (same "
                                               "name, .md) [default docs/gpu_check.json]")
    p.add_argument("--quick", action="store_true",
                   help="smaller sizes everywhere (bandwidth to 64 MiB, 4 overlap layers, 2 passes, 16 demo tokens)")
    p.add_argument("--sections", default=",".join(SECTIONS), help="the sections to run, comma separated")
    p.add_argument("--target", default=None, help="demo section: target model folder (default: the demo target, "
                                                  "converted on first use)")
    p.add_argument("--draft", default=None, help="demo section: draft model folder (default: the demo draft)")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help="demo section: tokens per run [default 48; 16 with --quick]")
    args = p.parse_args(argv)
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = [s for s in args.sections if s not in SECTIONS]
    if unknown:
        p.error(f"--sections: unknown {', '.join(unknown)} (known: {', '.join(SECTIONS)})")
    if (args.target is None) != (args.draft is None):
        p.error("--target and --draft go together")
    if args.max_new_tokens is None:
        args.max_new_tokens = 16 if args.quick else 48
    args.out = Path(args.out) if args.out else DEFAULT_OUT
    return args


# ---------------------------------------------------------------- sections, one function each

def run_section(fn: Callable[[], dict]) -> dict:
    """Run one section: its dict, with status ("passed" unless it says otherwise) and seconds; an exception
    becomes status "failed" with the error and the last lines of its traceback (recorded, not swallowed: it
    fails the whole check)."""
    start = time.perf_counter()
    try:
        out = fn()
        out.setdefault("status", "passed")
    except Exception as err:
        out = {"status": "failed", "error": f"{type(err).__name__}: {err}",
               "traceback": traceback.format_exc(limit=6).splitlines()[-8:]}
    out["seconds"] = round(time.perf_counter() - start, 1)
    return out


# ---- pytest

def parse_junit(path: str) -> dict:
    """pytest's --junitxml file -> counts, and the failed and skipped tests with their first message line."""
    counts = {"tests": 0, "passed": 0, "failed": 0, "skipped": 0}
    failures, skips = [], []
    for case in ElementTree.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        counts["tests"] += 1
        bad = case.find("failure") if case.find("failure") is not None else case.find("error")
        skipped = case.find("skipped")
        if bad is not None:
            counts["failed"] += 1
            message = (bad.get("message") or "").strip().splitlines()
            failures.append(f"{name}: {message[0][:300] if message else ''}")
        elif skipped is not None:
            counts["skipped"] += 1
            skips.append(f"{name}: {skipped.get('message', '')}")
        else:
            counts["passed"] += 1
    return {**counts, "failures": failures, "skips": skips}


def run_pytest(selection: list[str], env: Optional[dict] = None, timeout: float = PYTEST_TIMEOUT_S) -> dict:
    """python -m pytest <selection> from the repository root, in a subprocess. Passed: exit code 0, nothing
    failed, and at least one test ran (all skipped on a GPU machine means the GPU was not seen)."""
    with tempfile.TemporaryDirectory() as tmp:
        junit = os.path.join(tmp, "junit.xml")
        command = [sys.executable, "-m", "pytest", "-q", "-rfEs", "-p", "no:cacheprovider", f"--junitxml={junit}",
                   *selection]
        proc = subprocess.run(command, cwd=REPO, env={**os.environ, **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)
        result = parse_junit(junit) if os.path.exists(junit) else {"tests": 0, "passed": 0, "failed": 0, "skipped": 0}
    shown_env = " ".join(f"{k}={v}" for k, v in (env or {}).items())
    result["command"] = (shown_env + " " if shown_env else "") + "python -m pytest " + " ".join(selection)
    result["returncode"] = proc.returncode
    ok = proc.returncode == 0 and result["failed"] == 0 and result["passed"] > 0
    if not ok:
        result["output_tail"] = (proc.stdout + proc.stderr)[-4000:]
        if result["passed"] == 0 and proc.returncode == 0:
            result["error"] = "no test ran: every selected test was skipped"
    result["status"] = "passed" if ok else "failed"
    return result


def gpu_tests_section(args) -> dict:
    return run_pytest(["-m", "gpu", "tests"])


def sanitizer_section(args) -> dict:
    return run_pytest(SANITIZER_SELECTION, env={"TORCH_CUDA_SANITIZER": "1"})


# ---- bandwidth

def bandwidth_section(args, device: torch.device) -> dict:
    sizes = [16 << 20, 64 << 20] if args.quick else [16 << 20, 64 << 20, 256 << 20, 1 << 30]
    rows = measure_bandwidth(device, sizes, repeats=3 if args.quick else 5)
    out = {"rows": rows}
    unpinned = [r for r in rows if not r["pinned"]]
    if unpinned:
        out["status"] = "failed"
        out["error"] = f"could not pin {unpinned[0]['bytes']} bytes: {unpinned[0]['not_pinned_because']}"
    elif any(r["pinned_gbps"] < r["pageable_gbps"] for r in rows):
        out["note"] = "pinned copies were slower than pageable ones at some size"
    return out


# ---- overlap

def random_layers(cfg: ModelConfig, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """layer index -> tensors, made on `device` from a per-layer seed: the same weights on every call (the
    resident and the streamed model read the same numbers)."""
    def layer(i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator(device=device).manual_seed(seed + i)
        return {name: torch.randn(shape, generator=g, device=device, dtype=torch.float32).mul_(0.02).to(dtype)
                for name, shape in layer_shapes(cfg).items()}
    return layer


def random_globals(cfg: ModelConfig, device: torch.device, dtype: torch.dtype) -> GlobalWeights:
    g = torch.Generator(device=device).manual_seed(12345)
    embed = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, device=device).mul_(0.02).to(dtype)
    head = torch.randn(cfg.vocab_size, cfg.hidden_size, generator=g, device=device).mul_(0.02).to(dtype)
    return GlobalWeights(embed=embed, final_norm=torch.ones(cfg.hidden_size, device=device, dtype=dtype), lm_head=head)


def back_to_back(model: Model, cache: KVCache, start: int, ids: torch.Tensor,
                 passes: int) -> tuple[float, torch.Tensor]:
    """`passes` forwards with no synchronization between them, timed as one block (a streamed model keeps its
    ring busy across pass boundaries, as in generation) -> (seconds per pass, the last pass's logits)."""
    with Timer(model.device) as timer:
        for _ in range(passes):
            logits = forward_at(model, cache, start, ids)
    return timer.seconds / passes, logits


def measure_overlap(device: torch.device, cfg: ModelConfig, dtype: torch.dtype, n_slots: int, tokens: list[int],
                    passes: int, context: int) -> dict:
    """The same random model twice: every layer resident (compute alone), then every layer streamed from the
    pinned host arena through `n_slots` slots. Per number of new tokens T: seconds per pass of each, and the
    streamer's per-pass copy and wait seconds (StreamStats, device-timed on CUDA)."""
    layers_fn = random_layers(cfg, device, dtype)
    globals_ = random_globals(cfg, device, dtype)
    inputs = make_inputs(cfg.vocab_size, context, tokens, device)
    capacity = context + max(tokens)
    compute, resident_logits = {}, {}
    resident = open_target_layers(layers_fn, cfg,
                                  LayerPlan.of(cfg, OffloadConfig(mode="none"), dtype), device, dtype, progress=False)
    model = Model(cfg, globals_, resident)
    cache = prefill(model, inputs, capacity)
    for T in tokens:
        back_to_back(model, cache, context, inputs.new[T], 1)                          # warm-up
        compute[T], resident_logits[T] = back_to_back(model, cache, context, inputs.new[T], passes)
    del model, cache, resident
    if device.type == "cuda":
        torch.cuda.empty_cache()                       # the resident layers' memory goes back before streaming

    layout_bytes = layer_nbytes(cfg, dtype)
    offload = OffloadConfig(mode="cpu", n_slots=n_slots, gpu_budget=n_slots * layout_bytes)
    rows = []
    with open_target_layers(layers_fn, cfg,
                            LayerPlan.of(cfg, offload, dtype), device, dtype, progress=False) as streamed:
        n_streamed = len(streamed.placement.streamed)
        model = Model(cfg, globals_, streamed)
        cache = prefill(model, inputs, capacity)
        for T in tokens:
            back_to_back(model, cache, context, inputs.new[T], 1)                      # warm-up
            settle(streamed, n_slots)
            s0 = streamed.stats()
            pass_s, logits = back_to_back(model, cache, context, inputs.new[T], passes)
            settle(streamed, n_slots)
            s1 = streamed.stats()
            copied = s1.layers - s0.layers             # passes * n_streamed: the ring is settled at both ends
            transfer = (s1.transfer_s - s0.transfer_s) / passes
            rows.append({
                "tokens": T, "pass_s": pass_s, "compute_s": compute[T], "transfer_s": transfer,
                "wait_s": (s1.wait_s - s0.wait_s) / passes,
                "efficiency": max(transfer, compute[T]) / pass_s,
                "copy_gbps": (s1.bytes - s0.bytes) / max(s1.transfer_s - s0.transfer_s, 1e-9) / 1e9,
                "stream_gbps": (s1.bytes - s0.bytes) / passes / pass_s / 1e9,
                "layers_copied": copied, "expected_layers": passes * n_streamed,
                "logits_equal": bool(torch.equal(logits, resident_logits[T])),
            })
        host = streamed.host
    return {"model": {"hidden": cfg.hidden_size, "intermediate": cfg.intermediate_size, "layers": cfg.n_layers,
                      "vocab": cfg.vocab_size, "dtype": str(dtype).removeprefix("torch."), "layer_bytes": layout_bytes},
            "n_slots": n_slots, "streamed_layers": n_streamed, "passes": passes, "context": context,
            "host": dataclasses.asdict(host), "rows": rows}


def overlap_section(args, device: torch.device) -> dict:
    cfg = dataclasses.replace(OVERLAP_MODEL, n_layers=4) if args.quick else OVERLAP_MODEL
    out = measure_overlap(device, cfg, torch.bfloat16, n_slots=2, tokens=[1] if args.quick else [1, 128],
                          passes=2 if args.quick else 5, context=128)
    problems = []
    if not out["host"]["pinned"]:
        problems.append(f"the host arena is not pinned ({out['host']['reason']}): copies were synchronous")
    problems += [f"T={r['tokens']}: streamed logits differ from resident ones"
                 for r in out["rows"] if not r["logits_equal"]]
    problems += [f"T={r['tokens']}: {r['layers_copied']} layers copied in the timed passes, expected "
                 f"{r['expected_layers']}" for r in out["rows"] if r["layers_copied"] != r["expected_layers"]]
    if problems:
        out.update(status="failed", error="; ".join(problems))
    return out


# ---- the offspec command line (doctor, demo)

@dataclass
class CliRun:
    returncode: int
    seconds: float
    output: str          # the end of stdout + stderr


def run_cli(args: list[str], timeout: float = CLI_TIMEOUT_S) -> CliRun:
    """`offspec ARGS` in a fresh process (python -m offspec.cli), from the repository root."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "offspec.cli", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout)
    return CliRun(proc.returncode, time.perf_counter() - start, (proc.stdout + proc.stderr)[-3000:])


def doctor_section(args, device: torch.device, run: Callable[..., CliRun] = run_cli) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "doctor.json")
        argv = ["doctor", "--quick", "--device", str(device), "--json", path]
        result = run(argv)
        report = json.loads(Path(path).read_text()) if os.path.exists(path) else None
    out = {"command": "offspec " + " ".join(argv[:-2]), "returncode": result.returncode, "report": report}
    if result.returncode != 0 or report is None:
        out.update(status="failed", error=f"offspec doctor exited with {result.returncode}", output_tail=result.output)
    return out


def demo_pair(args, tmp: str) -> tuple[str, str, str]:
    """-> (target, draft, what they are): --target/--draft as given; else the demo pair; else, where the demo models
    are not installed, a random pair built in `tmp`. The device machine a session is lent reaches no package
    registry and takes no 4 GB of models, so that is where the random pair runs: a target with peaked
    distributions and a 2%-noisy copy of it as the draft (tests/tiny.py), so trees grow and are accepted. Its
    tokens check the streamed path as the demo pair's would; its speed is not the demo pair's."""
    if args.target is not None:
        return args.target, args.draft, "given"
    from offspec.errors import OffspecError
    from offspec.formats.demo import ensure_demo_models
    try:
        target, draft = ensure_demo_models(progress=False)
        return str(target), str(draft), "the demo pair"
    except OffspecError as missing:
        sys.path.insert(0, str(REPO / "tests"))
        from tiny import save_agreeing_pair
        target, draft, _ = save_agreeing_pair(Path(tmp), n_layers=RANDOM_PAIR_LAYERS)
        return str(target), str(draft), f"a random {RANDOM_PAIR_LAYERS}-layer pair (no demo pair: {missing})"


def demo_runs(target: str, draft: str, device: torch.device, max_new_tokens: int,
              prompts_file: str) -> dict[str, list[str]]:
    """name -> `offspec` arguments (the caller adds --json PATH). The streamed runs get a --gpu-budget of 3 of the
    target's layers with 2 slots: 2 ring slots + 1 resident layer, every other layer streamed from the pinned host
    arena. The batch run is the float32 streamed run with 2 prompts in flight (`prompts_file`: the demo prompt,
    then its companion), writing its results beside the file."""
    from offspec.formats.checkpoint import Checkpoint
    cfg = Checkpoint(target).config
    models = ["--target", target, "--draft", draft, "--device", str(device), "--max-new-tokens", str(max_new_tokens)]

    def streamed(dtype: torch.dtype) -> list[str]:
        return ["--offload", "cpu", "--slots", "2", "--gpu-budget", str(3 * layer_nbytes(cfg, dtype))]
    fixed_tree = ["--tree-budget", str(DEMO_TREE_BUDGET)]
    return {
        "float32_streamed": ["generate", *models, "--quiet", "--dtype", "float32", *streamed(torch.float32),
                             *fixed_tree, DEMO_PROMPT],
        "float32_resident": ["generate", *models, "--quiet", "--dtype", "float32", "--offload", "none", *fixed_tree,
                             DEMO_PROMPT],
        "bfloat16_streamed": ["generate", *models, "--quiet", "--dtype", "bfloat16", *streamed(torch.bfloat16),
                              DEMO_PROMPT],
        "bfloat16_streamed_tree32": ["generate", *models, "--quiet", "--dtype", "bfloat16",
                                     *streamed(torch.bfloat16), *fixed_tree, DEMO_PROMPT],
        "float32_batch_streamed": ["batch", prompts_file, "-o", prompts_file + ".out", "--concurrency", "2",
                                   *models, "--dtype", "float32", *streamed(torch.float32), *fixed_tree],
    }


def batch_tokens(results_file: str) -> dict[str, list[int]]:
    """A batch run's tokens per prompt id, from its results file."""
    lines = Path(results_file).read_text().splitlines() if os.path.exists(results_file) else []
    return {r["id"]: r["tokens"] for r in map(json.loads, lines)}


def demo_section(args, device: torch.device, run: Callable[..., CliRun] = run_cli) -> dict:
    runs, reports, problems = {}, {}, []
    with tempfile.TemporaryDirectory() as tmp:
        target, draft, pair = demo_pair(args, tmp)
        prompts_file = os.path.join(tmp, "prompts.jsonl")
        Path(prompts_file).write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                                              for i, p in (("demo", DEMO_PROMPT), ("companion", BATCH_COMPANION))))
        for name, argv in demo_runs(target, draft, device, args.max_new_tokens, prompts_file).items():
            path = os.path.join(tmp, f"{name}.json")
            result = run([*argv, "--json", path])
            runs[name] = {"command": "offspec " + " ".join(argv), "returncode": result.returncode,
                          "seconds": round(result.seconds, 1)}
            if result.returncode != 0 or not os.path.exists(path):
                runs[name]["output_tail"] = result.output
                problems.append(f"{name} exited with {result.returncode}")
                continue
            report = json.loads(Path(path).read_text())
            reports[name] = report
            runs[name]["report"] = {k: report.get(k) for k in DEMO_REPORT_FIELDS}
            if name.endswith("streamed"):
                if not report.get("gb_streamed") and not report.get("gb_streamed_per_token"):
                    problems.append(f"{name} streamed nothing")
                if device.type == "cuda" and "pageable" in str(report.get("weights_source")):
                    problems.append(f"{name}: {report.get('weights_source')}")
        batched = batch_tokens(prompts_file + ".out")
    out = {"target": target, "draft": draft, "pair": pair, "prompt": DEMO_PROMPT, "runs": runs}
    streamed, resident = reports.get("float32_streamed"), reports.get("float32_resident")
    if streamed and resident:
        first = first_divergence(streamed["tokens"], resident["tokens"])
        out["float32_tokens_identical"] = first is None
        if first is not None:
            out["float32_first_difference"] = first
            problems.append(f"float32 streamed and resident tokens differ from token {first} on")
    if resident and "float32_batch_streamed" in reports:
        first = first_divergence(batched.get("demo", []), resident["tokens"])
        out["float32_batch_tokens_identical"] = first is None
        if first is not None:
            out["float32_batch_first_difference"] = first
            problems.append(f"the demo prompt's tokens in a batch of 2 differ from its resident run's from token "
                            f"{first} on")
    if problems:
        out.update(status="failed", error="; ".join(problems))
    return out


# ---------------------------------------------------------------- the run

def environment(device: torch.device) -> dict:
    props = torch.cuda.get_device_properties(device)
    return {
        "gpu": props.name, "gpu_memory_gib": round(props.total_memory / 2**30, 1),
        "capability": f"{props.major}.{props.minor}", "gpu_count": torch.cuda.device_count(),
        "driver": nvidia_smi_field("driver_version"), "torch": torch.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "platform": platform.platform(), "cpu": _common.cpu_model(),
        "commit": _common.git_commit(),
    }


def nvidia_smi_field(field: str) -> Optional[str]:
    """One --query-gpu field of the first GPU, or None when nvidia-smi is not there."""
    try:
        out = subprocess.run(["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else None


def write_text(path: Path, text: str) -> None:
    """Atomically: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def holds_gpu_results(path: Path) -> bool:
    try:
        old = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(old, dict) and old.get("status") in ("passed", "failed")


def skip(out: Path, started: float) -> int:
    """No CUDA: one line, a JSON summary saying so (unless `out` holds a GPU run's results), exit 0."""
    summary = {"format": "offspec-gpu-check", "version": 1, "status": "skipped",
               "reason": "no CUDA device (torch.cuda.is_available() is False)",
               "command": _common.command_line(), "started": iso(started), "torch": torch.__version__}
    if holds_gpu_results(out):
        print(f"{SKIP_LINE} ({out} holds a GPU run's results: left as it is)")
    else:
        write_text(out, json.dumps(summary, indent=2) + "\n")
        print(SKIP_LINE)
    return 0


def iso(t: float) -> str:
    return datetime.datetime.fromtimestamp(t).astimezone().isoformat(timespec="seconds")


def section_runners(args, device: torch.device) -> dict[str, Callable[[], dict]]:
    return {
        "gpu_tests": lambda: gpu_tests_section(args),
        "sanitizer": lambda: sanitizer_section(args),
        "bandwidth": lambda: bandwidth_section(args, device),
        "overlap": lambda: overlap_section(args, device),
        "demo": lambda: demo_section(args, device),
        "doctor": lambda: doctor_section(args, device),
    }


def run_check(args, env: dict, runners: dict[str, Callable[[], dict]], started: float,
              out: Optional[Path] = None) -> dict:
    """Every section asked for, in order, each on its own (a failed one never stops the rest) -> the summary,
    also written to `out` after every section (status "running" until the last), so a kill keeps what ran."""
    summary = {"format": "offspec-gpu-check", "version": 1, "status": "running", "command": _common.command_line(),
               "started": iso(started), "quick": args.quick, "environment": env, "sections": {}}
    for name in SECTIONS:
        if name not in args.sections:
            summary["sections"][name] = {"status": "skipped", "reason": "not in --sections"}
            continue
        print(f"[{name}] running ...", file=sys.stderr, flush=True)
        summary["sections"][name] = result = run_section(runners[name])
        print(f"[{name}] {result['status']} in {result['seconds']:.0f} s: {section_line(name, result)}",
              file=sys.stderr, flush=True)
        if out is not None:
            write_summary({**summary, "seconds": round(time.time() - started, 1)}, out)
    failed = [name for name, s in summary["sections"].items() if s["status"] == "failed"]
    summary["status"] = "failed" if failed else "passed"
    summary["failed_sections"] = failed
    summary["seconds"] = round(time.time() - started, 1)
    return summary


def write_summary(summary: dict, out: Path) -> None:
    write_text(out, json.dumps(summary, indent=2) + "\n")
    write_text(out.with_suffix(".md"), render_markdown(summary))


def main(argv=None) -> int:
    args = parse_args(argv)
    started = time.time()
    if not torch.cuda.is_available():
        return skip(args.out, started)
    device = torch.device("cuda", torch.cuda.current_device())
    summary = run_check(args, environment(device), section_runners(args, device), started, args.out)
    write_summary(summary, args.out)
    failed = summary["failed_sections"]
    print(f"gpu check {summary['status']}" + (f" ({', '.join(failed)})" if failed else "")
          + f" in {summary['seconds']:.0f} s; wrote {args.out} and {args.out.with_suffix('.md')}")
    return 1 if failed else 0


# ---------------------------------------------------------------- rendering

def f(x, digits: int = 3) -> str:
    return _common.fmt(x, digits)


def section_line(name: str, s: dict) -> str:
    """One line: what the section found, then its error if it failed."""
    if s["status"] == "skipped":
        return s.get("reason", "")
    if RESULT_KEY[name] not in s:
        return s.get("error", "")
    if name in ("gpu_tests", "sanitizer"):
        found = f"{s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped"
    elif name == "bandwidth":
        largest = max(s["rows"], key=lambda r: r["bytes"])
        found = (f"{largest['bytes'] >> 20} MiB: pinned {largest['pinned_gbps']:.1f} GB/s, pageable "
                 f"{largest['pageable_gbps']:.1f} GB/s")
    elif name == "overlap":
        found = "; ".join(f"T={r['tokens']}: efficiency {r['efficiency']:.2f} (pass {r['pass_s']:.3f} s, transfer "
                          f"{r['transfer_s']:.3f} s, compute {r['compute_s']:.3f} s)" for r in s["rows"])
    elif name == "doctor":
        link = (s["report"] or {}).get("link", {})
        found = f"link pinned {f(link.get('pinned_gbps'), 1)} GB/s, pageable {f(link.get('pageable_gbps'), 1)} GB/s"
    else:   # demo
        bf16 = s["runs"].get("bfloat16_streamed", {}).get("report")
        found = (f"float32 tokens identical: {s.get('float32_tokens_identical', '–')}, in a batch of 2: "
                 f"{s.get('float32_batch_tokens_identical', '–')}") + (
            f"; bfloat16 streamed {bf16['seconds_per_token']:.4f} s/token" if bf16 else "")
    return found + (f"; {s['error']}" if "error" in s else "")


def render_markdown(summary: dict) -> str:
    """docs/gpu_check.md: the JSON summary for people."""
    env = summary["environment"]
    lines = [
        "# First-GPU check (`scripts/gpu_check.py`)",
        "",
        "Written by the script, with `gpu_check.json` beside it; rerun the script to replace both.",
        "",
        "Command:",
        "```",
        summary["command"],
        "```",
        f"- GPU: {env['gpu']} ({env['gpu_memory_gib']} GiB, sm {env['capability']}, {env['gpu_count']} device(s)); "
        f"driver {env['driver'] or 'unknown'}",
        f"- torch {env['torch']}, CUDA {env['cuda']}; Python {env['python']}; {env['platform']}; CPU {env['cpu']}",
        f"- commit {env['commit'] or 'unknown'}; run {summary['started']}, {summary['seconds']:.0f} s"
        + (" (--quick)" if summary.get("quick") else ""),
        "",
        f"**Overall: {summary['status']}.**",
        "",
        _common.markdown_table(["section", "status", "seconds", "result"],
                               [[name, s["status"], f(s.get("seconds"), 0), section_line(name, s)]
                                for name, s in summary["sections"].items()]),
    ]
    renderers = {"gpu_tests": tests_markdown, "sanitizer": tests_markdown, "bandwidth": bandwidth_markdown,
                 "overlap": overlap_markdown, "doctor": doctor_markdown, "demo": demo_markdown}
    for name, s in summary["sections"].items():
        if s["status"] == "skipped":
            continue
        lines += ["", f"## {name}", ""]
        if "error" in s:
            lines += [f"Error: `{s['error']}`", ""]
        if RESULT_KEY[name] in s:      # else it failed before producing results: the error says it all
            lines += renderers[name](s)
    return "\n".join(lines) + "\n"


def tests_markdown(s: dict) -> list[str]:
    return ([f"`{s['command']}`: {s['passed']} passed, {s['failed']} failed, {s['skipped']} skipped."]
            + [f"- FAILED {x}" for x in s["failures"]] + [f"- skipped {x}" for x in s["skips"]])


def bandwidth_markdown(s: dict) -> list[str]:
    return ["Host → device, through offspec's transfer backend: GB/s from CUDA events around each copy on the copy "
            "stream, and (host) from the host clock, issue to completion; medians. Pinned = offspec's HostBuffer "
            "(mmap + cudaHostRegister); pageable = a plain torch tensor.", "",
            _common.markdown_table(
                ["size", "pinned GB/s", "pageable GB/s", "pinned (host) GB/s", "pageable (host) GB/s", "pinning s"],
                [[f"{r['bytes'] >> 20} MiB", f(r["pinned_gbps"], 1), f(r["pageable_gbps"], 1),
                  f(r["pinned_host_gbps"], 1), f(r["pageable_host_gbps"], 1), f(r["pin_seconds"], 3)]
                 for r in s["rows"]])]


def overlap_markdown(s: dict) -> list[str]:
    m, host = s["model"], s["host"]
    return [f"{m['layers']} random layers of hidden {m['hidden']}, intermediate {m['intermediate']} "
            f"({m['layer_bytes'] / 1e6:.0f} MB each in {m['dtype']}), all streamed from the host arena "
            f"({'pinned' if host['pinned'] else 'pageable: ' + host['reason']}) through {s['n_slots']} slots; "
            f"{s['passes']} passes back to back after a {s['context']}-token prefix. Per pass: **transfer** = the "
            f"copies' own time on the copy stream and **wait** = compute stalled on a layer (StreamStats, CUDA "
            f"events); **compute** = the same passes with every layer resident; **efficiency** = max(transfer, "
            f"compute) / pass (1.0: the transfer is fully hidden).", "",
            _common.markdown_table(
                ["tokens", "pass s", "transfer s", "wait s", "compute s", "efficiency", "copy GB/s", "stream GB/s",
                 "logits == resident"],
                [[r["tokens"], f(r["pass_s"]), f(r["transfer_s"]), f(r["wait_s"]), f(r["compute_s"]),
                  f(r["efficiency"], 2), f(r["copy_gbps"], 1), f(r["stream_gbps"], 1),
                  "yes" if r["logits_equal"] else "**no**"] for r in s["rows"]])]


def doctor_markdown(s: dict) -> list[str]:
    report = s["report"] or {}
    return [f"`{s['command']}`; its sections: " + ", ".join(
        f"{k} {v['status']}" for k, v in report.items() if isinstance(v, dict) and "status" in v)]


def demo_markdown(s: dict) -> list[str]:
    def row(name: str, run: dict) -> list:
        r = run.get("report") or {}
        return [name, run["returncode"], f(r.get("seconds_per_token"), 4), f(r.get("tokens_per_pass"), 2),
                f(r.get("prefill_seconds")), f(r.get("draft_seconds")), f(r.get("target_seconds")),
                f(r.get("wait_seconds")), f(r.get("transfer_seconds")),
                f(r.get("gb_per_second") or r.get("stream_gb_per_second"), 1),
                f(r.get("peak_device_gb"), 2), r.get("weights_source", "–")]
    return ([f"Target `{s['target']}`, draft `{s['draft']}` ({s.get('pair', 'given')}); prompt \"{s['prompt']}\". "
             f"float32 streamed and resident tokens identical: **{s.get('float32_tokens_identical', '–')}**; the "
             f"prompt's tokens in a streamed batch of 2 and its resident run's identical: "
             f"**{s.get('float32_batch_tokens_identical', '–')}**.", "",
             _common.markdown_table(["run", "exit", "s/token", "tokens/pass", "prefill s", "draft s", "target s",
                                     "wait s", "transfer s", "GB/s", "device peak GB", "weights"],
                                    [row(name, run) for name, run in s["runs"].items()]),
             "", "Commands:", ""]
            + [f"- `{run['command']} --json R.json`" for run in s["runs"].values()])


if __name__ == "__main__":
    sys.exit(main())
