"""scripts/bench_peers.py's measuring path end to end on tiny checkpoints (CPU, float32, seconds): every system,
ablations included, loads and runs; rows carry their tags, stamps and repeats; greedy outputs all equal
hf-plain's; the rows file resumes; the report renders from it without models; the sweep names a best setting."""
import json

import pytest
import torch

from scripts_module import load_script
from tiny import hf_config, make_model, perturbed_copy, save_checkpoint

NEW_TOKENS = 8


@pytest.fixture(scope="module")
def bp():
    return load_script("bench_peers")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("peers")
    target = make_model(hf_config("llama", n_layers=3), scale=4.0)
    draft = perturbed_copy(target, noise=0.01)
    return save_checkpoint(target, root / "target"), save_checkpoint(draft, root / "draft")


def args_for(bp, rows_file, *extra, device="cpu"):
    _, args = bp.parse_args(["--regimes", "cpu", "--new-tokens", str(NEW_TOKENS), "--repeats", "2", "--dtype",
                             "float32", "--chain-length", "4", "--rows", str(rows_file), "--device", device, *extra])
    return args


def prompts_for(n=2):
    from tiny import make_tokenizer
    from offspec.prompt import encode_prompt

    tok = make_tokenizer()
    return [(f"p{k}", encode_prompt(tok, f"write {k} things")) for k in range(n)]


def test_measure_cpu_regime_every_system_identical_in_fp32(bp, checkpoints, tmp_path):
    target_dir, draft_dir = checkpoints
    rows_file = tmp_path / "rows.jsonl"
    args = args_for(bp, rows_file)
    settings = bp.run_settings(args, torch.float32)
    result = bp.bench_regime(args, "cpu", prompts_for(1), target_dir, draft_dir, torch.float32, settings, [])
    assert result["systems"] == list(bp.SYSTEMS)          # the ablations included; resident: cpu regime
    rows = [json.loads(line) for line in rows_file.read_text().splitlines()]
    assert [r["prompt_id"] for r in rows] == ["p0"] and all(r["prompt_set"] == "code" for r in rows)
    for r in rows:
        assert set(r["stamp"]) == {"commit", "time", "load_average", "machine"} and r["seed"] is None
        assert r["first_divergence"] == {}                 # greedy, float32: every system makes hf-plain's tokens
        for system in bp.SYSTEMS:
            cell = r[system]
            assert len(cell["repeat_seconds_per_token"]) == 2
            assert cell["seconds_per_token"] == pytest.approx(sorted(cell["repeat_seconds_per_token"])[0] / 2
                                                              + sorted(cell["repeat_seconds_per_token"])[1] / 2)
            assert cell["agreement_with_hf_plain"] == 1.0 and 0 < cell["tokens"] <= NEW_TOKENS
        assert r[bp.CHAIN]["mean_tree_size"] <= 4 and r[bp.DYSPEC_FIXED]["mean_tree_size"] <= 4
        assert r["hf-assisted"]["peer_passes"] < r["hf-plain"]["peer_passes"] or r["hf-plain"]["tokens"] <= 1
        assert r["hf-assisted"]["peer_draft_tokens"] >= r["hf-assisted"]["peer_passes"] - 1
    result["identity"] = bp.identity_summary(result["rows"], {}, fp32_run=True)
    assert result["identity"]["identical"] == 1 and result["identity"]["fail"] == 0
    gpu = result["costmodel"]["gpu"]
    assert [g["draft_call_seconds"] for g in gpu] == list(bp.GPU_DRAFT_CALL_S)
    assert gpu[0]["offspec"] < gpu[1]["offspec"] < gpu[2]["offspec"]          # a slower draft call costs more
    assert gpu[0]["hf-assisted"] < gpu[2]["hf-assisted"]

    # Resume: the same command measures nothing more (no model is even loaded) and reports the same rows.
    again = bp.bench_regime(args, "cpu", prompts_for(1), target_dir, draft_dir, torch.float32, settings,
                            bp.read_rows_file(rows_file)[0])
    assert len(rows_file.read_text().splitlines()) == 1 and [r["id"] for r in again["rows"]] == ["p0"]

    # The report renders from the file alone.
    out = tmp_path / "report.json"
    assert bp.main(["--report-only", "--rows", str(rows_file), "--regimes", "cpu", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    assert [r["regime"] for r in report] == ["cpu"] and report[0]["identity"]["identical"] == 1


def test_sampled_rows_one_per_seed_and_both_sides_reproducible(bp, checkpoints, tmp_path):
    target_dir, draft_dir = checkpoints
    rows_file = tmp_path / "sampled.jsonl"
    args = args_for(bp, rows_file, "--temperature", "0.7", "--seeds", "0,1", "--systems",
                    "hf-plain,offspec-chain", "--repeats", "1")
    settings = bp.run_settings(args, torch.float32)
    result = bp.bench_regime(args, "cpu", prompts_for(1), target_dir, draft_dir, torch.float32, settings, [])
    assert [(r["id"], r["seed"]) for r in result["rows"]] == [("p0", 0), ("p0", 1)]
    assert all("agreement_with_hf_plain" not in r["offspec-chain"] for r in result["rows"])   # sampled: no identity
    models = bp.HfSystems(target_dir, None, torch.float32, "cpu", str(tmp_path / "off"), False, None)
    ids = prompts_for(1)[0][1]
    first, second = (models.generate(ids, NEW_TOKENS, False, temperature=0.7, seed=5) for _ in range(2))
    assert first.tokens == second.tokens                               # seeded
    greedy = models.generate(ids, NEW_TOKENS, False)
    other = models.generate(ids, NEW_TOKENS, False, temperature=0.7, seed=6)
    assert first.tokens != greedy.tokens or other.tokens != greedy.tokens   # it does sample


def test_sweep_rows_and_best_setting(bp, checkpoints, tmp_path):
    target_dir, draft_dir = checkpoints
    rows_file = tmp_path / "sweep.jsonl"
    args = args_for(bp, rows_file, "--assist-sweep", "--repeats", "1")
    settings = bp.run_settings(args, torch.float32)
    rows = bp.sweep_regime(args, "cpu", prompts_for(1), target_dir, draft_dir, torch.float32, settings, [])
    labels = [bp.assist_label(a) for a in bp.SWEEP]
    assert len(labels) == 7 and all(set(r["cells"]) == set(labels) for r in rows)
    assert all(r["kind"] == bp.SWEEP_KIND for r in rows)
    for r in rows:                                   # each setting ran as asked: read back from transformers
        cell = r["cells"]["constant 8, threshold 0"]
        used = cell["peer_settings"]
        assert (used["num_assistant_tokens"], used["assistant_confidence_threshold"]) == (8, 0.0)
        assert r["cells"]["transformers defaults"]["peer_settings"]["num_assistant_tokens"] == 20
    summary = bp.summarize_sweep(rows)
    best = min(summary["settings"], key=lambda k: summary["settings"][k]["seconds_per_token"]["median"])
    assert summary["best"] == best and summary["settings"][best]["flags"].startswith("--assist")
    # The sweep's rows are kept apart from timing rows, and its report renders from the file.
    assert bp.rows_by_key(bp.read_rows_file(rows_file)[0], "cpu", [("p0", None)]) == {}
    assert bp.main(["--report-only", "--assist-sweep", "--rows", str(rows_file), "--regimes", "cpu"]) == 0


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("regime", ["cpu", "disk"])
def test_on_a_gpu_every_system_makes_hf_plains_tokens_in_fp32(bp, checkpoints, tmp_path, regime):
    """Both sides compute on the GPU: offspec streams every layer through its ring (no int8 draft: the CPU's
    default), accelerate brings each offloaded layer there; greedy float32 output is the same for every system."""
    target_dir, draft_dir = checkpoints
    # --slots 2 of the 3 layers: with as many slots as layers the ring's budget holds the whole target, resident
    args = args_for(bp, tmp_path / "rows.jsonl", "--regimes", regime, "--repeats", "1", "--slots", "2", device="cuda")
    settings = bp.run_settings(args, torch.float32)
    assert settings["device"] == "cuda" and bp.INT8 not in bp.regime_systems(args, regime)
    result = bp.bench_regime(args, regime, prompts_for(1), target_dir, draft_dir, torch.float32, settings, [])
    for r in result["rows"]:
        assert r["first_divergence"] == {} and r["gpu"] == torch.cuda.get_device_name()
        assert r["offspec-none"]["gb_streamed"] > 0              # streamed on the GPU, not resident there
