"""scripts/gpu_check.py without a GPU: the clean skip, and every part of the check that can run on a CPU (the
bandwidth and overlap measurements through the CPU transfer backend, the demo pair on tiny checkpoints through
the command line, the pytest runner, the section runner and the JSON -> markdown rendering). What stays
GPU-only is the device choice in main() and the CUDA calls inside offspec's CudaBackend."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from scripts_module import load_script
from tiny import hf_config, make_model, perturbed_copy, save_checkpoint

from offspec.config import ModelConfig

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "gpu_check.py"
CPU = torch.device("cpu")
TINY = ModelConfig(arch="llama", vocab_size=64, hidden_size=32, intermediate_size=64, n_layers=7,
                   n_heads=2, n_kv_heads=2, head_dim=16)


@pytest.fixture(scope="module")
def gc():
    return load_script("gpu_check")


def options(gc, *argv):
    return gc.parse_args(list(argv))


def fake_env():
    return {"gpu": "NVIDIA Test GPU", "gpu_memory_gib": 80.0, "capability": "9.0", "gpu_count": 1, "driver": "1.0",
            "torch": torch.__version__, "cuda": "12.8", "python": "3.11", "platform": "linux", "cpu": "cpu",
            "commit": "abc1234"}


# ---------------------------------------------------------------- no CUDA: one line, exit 0

def run_script(*argv):
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}   # no GPU even on a machine that has one
    return subprocess.run([sys.executable, str(SCRIPT), *argv], capture_output=True, text=True, env=env, timeout=120)


def test_without_cuda_the_script_skips_cleanly(tmp_path):
    out = tmp_path / "check.json"
    result = run_script("--out", str(out))
    assert result.returncode == 0, result.stderr
    assert result.stdout == "no CUDA device: nothing to check; skipped\n"
    summary = json.loads(out.read_text())
    assert summary["status"] == "skipped" and "no CUDA device" in summary["reason"]
    assert not out.with_suffix(".md").exists()


def test_a_skip_never_overwrites_a_gpu_run(tmp_path):
    out = tmp_path / "check.json"
    out.write_text(json.dumps({"status": "passed", "sections": {}}))
    result = run_script("--out", str(out), "--quick")
    assert result.returncode == 0
    assert result.stdout.count("\n") == 1 and "left as it is" in result.stdout
    assert json.loads(out.read_text())["status"] == "passed"


def test_arguments(gc):
    args = options(gc, "--quick", "--sections", "bandwidth,demo")
    assert args.sections == ["bandwidth", "demo"] and args.max_new_tokens == 16 and args.out == gc.DEFAULT_OUT
    with pytest.raises(SystemExit):
        options(gc, "--sections", "bandwith")
    with pytest.raises(SystemExit):
        options(gc, "--target", "t")                    # without --draft


# ---------------------------------------------------------------- the measurements, on the CPU backend

def test_bandwidth_through_the_cpu_backend(gc):
    rows = gc.measure_bandwidth(CPU, [1 << 16, 1 << 20], repeats=2)
    assert [r["bytes"] for r in rows] == [1 << 16, 1 << 20]
    for r in rows:
        assert not r["pinned"] and r["not_pinned_because"] == "cpu device"
        assert min(r["pinned_gbps"], r["pageable_gbps"], r["pinned_host_gbps"], r["pageable_host_gbps"]) > 0


def test_bandwidth_section_fails_when_nothing_could_be_pinned(gc):
    result = gc.run_section(lambda: gc.bandwidth_section(options(gc, "--quick"), CPU))
    assert result["status"] == "failed" and "could not pin" in result["error"] and len(result["rows"]) == 2


def test_overlap_through_the_cpu_backend(gc):
    out = gc.measure_overlap(CPU, TINY, torch.float32, n_slots=2, tokens=[1, 4], passes=2, context=8)
    assert out["streamed_layers"] == TINY.n_layers and not out["host"]["pinned"]
    assert [r["tokens"] for r in out["rows"]] == [1, 4]
    for r in out["rows"]:
        assert r["logits_equal"]                        # streamed == resident, bit for bit
        assert r["layers_copied"] == r["expected_layers"] == 2 * TINY.n_layers
        assert r["pass_s"] > 0 and r["compute_s"] > 0 and r["transfer_s"] > 0 and r["wait_s"] >= 0
        assert r["efficiency"] == max(r["transfer_s"], r["compute_s"]) / r["pass_s"]


# ---------------------------------------------------------------- the command-line sections

@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("pair")
    target = make_model(hf_config("llama", n_layers=6), seed=7, scale=3.0)   # budget of 3 layers: 5 stream
    return (str(save_checkpoint(target, root / "target")),
            str(save_checkpoint(perturbed_copy(target, noise=0.02), root / "draft")))


def in_process(argv, timeout=None):
    """The script's run_cli, but in this process through click's CliRunner (seconds instead of a process start)."""
    from offspec.cli.main import main
    result = CliRunner().invoke(main, argv, prog_name="offspec")
    return SimpleRun(result.exit_code, 0.0, result.output[-3000:])


class SimpleRun:
    def __init__(self, returncode, seconds, output):
        self.returncode, self.seconds, self.output = returncode, seconds, output


def test_demo_section_on_tiny_checkpoints(gc, tiny_pair):
    """The three `offspec generate` runs of the demo section (forced streaming in float32 and bfloat16, and
    resident float32): the same flags, the same checks, on a CPU and tiny models."""
    target, draft = tiny_pair
    args = options(gc, "--target", target, "--draft", draft, "--max-new-tokens", "6")
    result = gc.run_section(lambda: gc.demo_section(args, CPU, run=in_process))
    assert result["status"] == "passed", result
    assert result["float32_tokens_identical"]
    runs = result["runs"]
    assert set(runs) == {"float32_streamed", "float32_resident", "bfloat16_streamed", "bfloat16_streamed_tree32",
                         "float32_batch_streamed"}
    assert runs["bfloat16_streamed_tree32"]["report"]["tree_budget"] == gc.DEMO_TREE_BUDGET
    assert result["float32_batch_tokens_identical"] and result["pair"] == "given"
    batch = runs["float32_batch_streamed"]["report"]
    assert batch["rows_per_pass"] > 1 and batch["gb_streamed_per_token"] > 0
    assert "--gpu-budget" in runs["float32_streamed"]["command"]
    assert "--offload cpu" in runs["bfloat16_streamed"]["command"]
    streamed, resident = runs["float32_streamed"]["report"], runs["float32_resident"]["report"]
    assert streamed["gb_streamed"] > 0 and streamed["offload"] == "cpu" and resident["gb_streamed"] == 0
    assert runs["bfloat16_streamed"]["report"]["dtype"] == "bfloat16"


def test_without_the_demo_models_the_demo_section_runs_a_random_pair(gc, monkeypatch):
    """The device machine lent to a session has no demo models: the section builds a random pair and checks it."""
    import offspec.formats.demo
    from offspec.errors import CheckpointError

    def missing(progress=True):
        raise CheckpointError("the demo model parts are not installed")
    monkeypatch.setattr(offspec.formats.demo, "ensure_demo_models", missing)
    result = gc.run_section(lambda: gc.demo_section(options(gc, "--max-new-tokens", "6"), CPU, run=in_process))
    assert result["status"] == "passed", result
    assert result["pair"].startswith("a random 8-layer pair (no demo pair: the demo model parts are not installed")
    assert result["float32_tokens_identical"] and result["float32_batch_tokens_identical"]


def test_a_batched_prompt_that_differs_from_its_run_alone_fails_the_section(gc, tiny_pair, monkeypatch):
    target, draft = tiny_pair
    real = gc.batch_tokens
    monkeypatch.setattr(gc, "batch_tokens", lambda path: {k: [t + 1 for t in v] for k, v in real(path).items()})
    result = gc.run_section(lambda: gc.demo_section(options(gc, "--target", target, "--draft", draft,
                                                            "--max-new-tokens", "6"), CPU, run=in_process))
    assert result["status"] == "failed" and not result["float32_batch_tokens_identical"]
    assert "the demo prompt's tokens in a batch of 2 differ from its resident run's from token 0 on" in result["error"]


def test_demo_section_reports_a_failed_run(gc, tiny_pair):
    target, draft = tiny_pair

    def broken(argv, timeout=None):
        return SimpleRun(1, 0.1, "offspec: error: out of device memory")
    args = options(gc, "--target", target, "--draft", draft)
    result = gc.run_section(lambda: gc.demo_section(args, CPU, run=broken))
    assert result["status"] == "failed" and "float32_streamed exited with 1" in result["error"]
    assert result["runs"]["float32_streamed"]["output_tail"].endswith("out of device memory")


def test_doctor_section(gc):
    def doctor(argv, timeout=None):
        path = argv[argv.index("--json") + 1]
        Path(path).write_text(json.dumps({"link": {"status": "ok", "pinned_gbps": 25.0, "pageable_gbps": 9.0}}))
        return SimpleRun(0, 1.0, "")
    result = gc.run_section(lambda: gc.doctor_section(None, CPU, run=doctor))
    assert result["status"] == "passed" and result["report"]["link"]["pinned_gbps"] == 25.0
    assert "pinned 25.0 GB/s" in gc.section_line("doctor", result)
    result = gc.run_section(lambda: gc.doctor_section(None, CPU, run=lambda argv, timeout=None: SimpleRun(1, 1.0, "x")))
    assert result["status"] == "failed" and result["report"] is None


# ---------------------------------------------------------------- pytest runner, sections, rendering

def test_pytest_runner_counts_and_fails(gc, tmp_path):
    tests = tmp_path / "test_sample.py"
    tests.write_text("import pytest\n"
                     "def test_ok(): pass\n"
                     "def test_bad(): assert 1 == 2, 'one is not two'\n"
                     "@pytest.mark.skip(reason='not here')\n"
                     "def test_skipped(): pass\n")
    result = gc.run_pytest([str(tests)], env={"OFFSPEC_SAMPLE": "1"})
    assert (result["passed"], result["failed"], result["skipped"]) == (1, 1, 1)
    assert result["status"] == "failed" and result["returncode"] == 1
    assert "test_bad" in result["failures"][0] and "one is not two" in result["failures"][0]
    assert "not here" in result["skips"][0]
    assert result["command"].startswith("OFFSPEC_SAMPLE=1 python -m pytest")
    only_skips = gc.run_pytest([str(tests), "-k", "skipped"])
    assert only_skips["status"] == "failed" and only_skips["error"] == "no test ran: every selected test was skipped"
    passing = gc.run_pytest([str(tests), "-k", "ok"])
    assert passing["status"] == "passed" and "output_tail" not in passing


def test_a_failing_section_never_stops_the_others(gc, tmp_path):
    args = options(gc, "--sections", "bandwidth,overlap,demo", "--quick", "--out", str(tmp_path / "c.json"))
    overlap = gc.measure_overlap(CPU, TINY, torch.float32, n_slots=3, tokens=[2], passes=1, context=4)
    runners = {"bandwidth": lambda: {"rows": gc.measure_bandwidth(CPU, [1 << 16], 1)},
               "overlap": lambda: dict(overlap),
               "demo": lambda: 1 / 0}
    summary = gc.run_check(args, fake_env(), runners, started=0.0)
    sections = summary["sections"]
    assert {n: s["status"] for n, s in sections.items()} == {
        "gpu_tests": "skipped", "sanitizer": "skipped", "bandwidth": "passed", "overlap": "passed", "demo": "failed",
        "doctor": "skipped"}
    assert sections["demo"]["error"] == "ZeroDivisionError: division by zero" and sections["demo"]["traceback"]
    assert summary["status"] == "failed" and summary["failed_sections"] == ["demo"]
    gc.write_summary(summary, args.out)
    assert json.loads(args.out.read_text())["sections"]["overlap"]["rows"][0]["logits_equal"]
    markdown = args.out.with_suffix(".md").read_text()
    assert "NVIDIA Test GPU" in markdown and "**Overall: failed.**" in markdown
    assert "| demo | failed |" in markdown and "ZeroDivisionError" in markdown
    assert "## overlap" in markdown and "| 2 |" in markdown       # the overlap table's row for T=2
    assert "## gpu_tests" not in markdown                          # skipped sections: a table row only


def test_markdown_of_every_section(gc):
    """Each section's rendering, from results shaped as the sections return them."""
    tests = {"status": "failed", "seconds": 60, "tests": 3, "passed": 2, "failed": 1, "skipped": 0,
             "command": "python -m pytest -m gpu tests", "returncode": 1,
             "failures": ["tests/test_gpu.py::test_cuda_ring_holds[2-x]: assert [(0, 3, [4, 4, 1, 1])] == []"],
             "skips": []}
    demo_report = {"seconds_per_token": 0.02, "tokens_per_pass": 3.5, "wait_seconds": 0.1, "transfer_seconds": 0.5,
                   "gb_per_second": 24.0, "peak_device_gb": 3.2, "weights_source": "host arena, pinned"}
    demo = {"status": "passed", "seconds": 100, "target": "t", "draft": "d", "prompt": "p",
            "float32_tokens_identical": True,
            "runs": {"bfloat16_streamed": {"command": "offspec generate ...", "returncode": 0, "seconds": 9.0,
                                           "report": demo_report}}}
    summary = {"command": "python scripts/gpu_check.py", "started": "now", "seconds": 300.0, "quick": False,
               "status": "failed", "environment": fake_env(),
               "sections": {"gpu_tests": tests, "sanitizer": {"status": "failed", "seconds": 1,
                                                              "error": "TimeoutExpired: pytest took too long"},
                            "demo": demo}}
    markdown = gc.render_markdown(summary)
    assert "FAILED tests/test_gpu.py::test_cuda_ring_holds" in markdown
    assert "| sanitizer | failed | 1 | TimeoutExpired: pytest took too long |" in markdown
    assert "bfloat16 streamed 0.0200 s/token" in markdown and "| bfloat16_streamed | 0 | 0.0200 |" in markdown


# ---------------------------------------------------------------- scripts/gpu_session.py (the lent GPU's one command)

def test_gpu_session_parts_run_on_a_cpu_with_tiny_shapes(tmp_path):
    """The 70B-shaped parts, on --tiny shapes through the CPU backend (the same code a GPU runs): each part's
    rows land in gpu_70b.json as they come, the streamed logits equal the resident ones, and the markdown
    renders every part."""
    gs = load_script("gpu_session")
    common = ["--out", str(tmp_path), "--tiny", "--device", "cpu", "--passes", "1", "--context", "16"]
    for part in ("pass70b", "drafts", "twin", "dequant", "passq"):
        assert gs.main([*common, "--part", part]) == 0
    data = json.loads((tmp_path / "gpu_70b.json").read_text())
    assert all(data[part]["status"] == "passed" for part in ("pass70b", "drafts", "twin", "dequant", "passq"))
    twin = data["twin"]
    assert twin["int4_max_rel_error"] < 0.05 and twin["int4_from_host_max_rel_error"] < 0.05
    assert {(r["form"], r["tokens"]) for r in twin["rows"] if "tokens" in r} >= {("int4", t) for t in gs.TWIN_ROWS}
    rows = data["pass70b"]["rows"]
    assert [r["tokens"] for r in rows] == list(gs.WIDTHS) and all(r["logits_equal"] for r in rows)
    assert {(r["draft"], r["tokens"]) for r in data["drafts"]["rows"]} == {(d, t) for d in gs.DRAFTS for t in gs.WIDTHS}
    timed = {r["quant"]: r for r in data["dequant"]["rows"] if "seconds" in r}
    assert {"int8", "awq-g128", "gptq-b4-g128-v2", "ct-b4-g128-bf16", "gguf-q4_k+q6_k"} <= set(timed)
    assert all(r["block_bytes"] < r["dense_bytes"] for r in timed.values())
    awq = [r for r in data["dequant"]["rows"] if r["quant"] == "awq-g128"]
    assert [r["path"] for r in awq] == ["torch"] + ["kernel"] * len(gs.TILE_SWEEP["awq"])
    assert [tuple(r["tile"]) for r in awq[1:]] == gs.TILE_SWEEP["awq"] and all(r["equal"] for r in awq[1:])
    assert all(r["issue_seconds"] > 0 for r in data["dequant"]["rows"] if "seconds" in r)
    import os

    from offspec.formats import kernels
    assert "OFFSPEC_DEQUANT" not in os.environ and kernels.TILES["awq"] == gs.TILE_SWEEP["awq"][0]   # restored
    passq = data["passq"]["rows"]
    assert {(r["queues"], r["path"]) for r in passq} == set(gs.PASSQ_RUNS) and all(r["copies_s"] > 0 for r in passq)
    text = (tmp_path / "gpu_70b.md").read_text()
    assert "## pass70b" in text and "## drafts" in text and "## twin" in text and "## dequant" in text
    assert "## passq" in text


def test_gpu_session_records_a_failing_part(tmp_path, monkeypatch):
    gs = load_script("gpu_session")

    def broken(args, device, results):
        raise RuntimeError("the ring tore")
    monkeypatch.setitem(gs.PART_FNS, "drafts", broken)
    assert gs.main(["--out", str(tmp_path), "--tiny", "--device", "cpu", "--part", "drafts"]) == 1
    drafts = json.loads((tmp_path / "gpu_70b.json").read_text())["drafts"]
    assert drafts["status"] == "failed" and "the ring tore" in drafts["error"]


def test_the_sdpa_backend_probe_runs_on_a_cpu(tmp_path, monkeypatch):
    """scripts/devtools/sdpa_backends.py on a CPU: a row per (heads, dtype, backend, shapes), the backends a CPU
    lacks recorded as refused, never raised."""
    probe = load_script("sdpa_backends")
    monkeypatch.setattr(sys, "argv", ["sdpa_backends", "--device", "cpu", "--calls", "1",
                                      "--json", str(tmp_path / "s.json")])
    probe.main()
    rows = json.loads((tmp_path / "s.json").read_text())["rows"]
    assert len(rows) == len(probe.HEADS) * 2 * len(probe.BACKENDS) * 2
    assert all(isinstance(r["ms_per_call"], float) for r in rows if r["backend"] in ("default", "math"))
    assert any(str(r["ms_per_call"]).startswith("refused") for r in rows if r["backend"] == "cudnn")
