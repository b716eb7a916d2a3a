"""scripts/bench_batch.py's measuring path end to end on a tiny pair in float32, on the CPU and (skipped without
CUDA) on a GPU: where each regime puts the target, offspec's cell, and the transformers peer's cell."""
import pytest
import torch
from scripts_module import load_script
from tiny import save_agreeing_pair

bench = load_script("bench_batch")
peers = load_script("peer_hf")

GPU = pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                       reason="needs a CUDA device")])
EOS = 2                 # the tiny tokenizer's <|im_end|>


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    target_dir, draft_dir, _ = save_agreeing_pair(tmp_path_factory.mktemp("batch-cells"), n_layers=3)
    return target_dir, draft_dir


def test_each_regime_puts_the_target_where_its_description_says():
    cpu, gpu, layer = torch.device("cpu"), torch.device("cuda"), 1000
    assert bench.offload_of("disk", cpu, layer, "s", "direct") == bench.OffloadConfig(mode="disk", store_dir="s")
    assert bench.offload_of("cpu", cpu, layer, "s", "direct").mode == "none"      # the CPU user's default
    for regime in ("disk", "cpu"):            # on a GPU: streamed, only the ring of 2 slots on the device
        offload = bench.offload_of(regime, gpu, layer, "s", "buffered")
        assert (offload.mode, offload.gpu_budget, offload.n_slots, offload.disk_io) == (regime, 2 * layer, 2,
                                                                                          "buffered")


def test_on_a_gpu_the_plan_streams_every_layer_through_the_ring(pair, tmp_path):
    """The streamed regimes' --gpu-budget leaves no layer resident even on a GPU far larger than the target (a
    24 GB GPU, planned here without one)."""
    from offspec.plan.machine import GB, Machine

    models = bench.Models.open(*pair)
    gpu = torch.device("cuda")
    layer = bench.layer_nbytes(models.target.config, torch.float32)
    for regime in ("disk", "cpu"):
        plan = models.plan(bench.offload_of(regime, gpu, layer, str(tmp_path), "direct"),
                           bench.RuntimeConfig(device=gpu, dtype=torch.float32),
                           bench.RunLimits(context=256, concurrency=2), Machine.given(24 * GB, 64 * GB))
        assert (plan.mode, plan.placement.resident, plan.placement.streamed) == (regime, (), (0, 1, 2))


def test_the_peer_keeps_the_layers_where_the_regime_does_and_the_rest_on_the_compute_device():
    cpu = torch.device("cpu")
    assert peers.peer_device_map("cpu", 2, cpu) == {"": "cpu"}         # host RAM on a CPU: executed in place
    disk = peers.peer_device_map("disk", 2, cpu)
    assert disk["model.layers.0"] == disk["model.layers.1"] == "disk" and disk["lm_head"] == "cpu"
    host = peers.peer_device_map("cpu", 2, torch.device("cuda", 1))
    assert host["model.layers.1"] == "cpu" and host["model.embed_tokens"] == host["lm_head"] == 1
    assert peers.peer_device_map("disk", 2, torch.device("cuda"))["model.norm"] == 0


def test_rows_are_kept_per_device_and_a_gpu_report_renders_here(tmp_path, monkeypatch, capsys):
    """A GPU's rows carry its model as their machine, key their settings by device, and never pool with a CPU's;
    --report-only --device cuda renders them on a machine without CUDA."""
    monkeypatch.setattr(bench._common, "write_doc_section", lambda name, body, path=None: None)
    cpu_args = bench.parse_args(["--device", "cpu"])
    gpu_args = bench.parse_args(["--device", "cuda", "--report-only"])
    assert bench.settings_of(cpu_args, "code")["device"] == "cpu"
    assert bench.settings_of(gpu_args, "code")["device"] == "cuda"
    stamp = {"machine": "AMD EPYC, 2 torch threads", "commit": "abc1234", "time": "2026-11-26T01:00:00Z",
             "load_average": [0.5, 0.5, 0.5]}
    rows = [{"prompt_set": "code", "regime": "disk", "system": "offspec", "concurrency": B, "repeat": 0,
             "tokens_per_second": speed, "passes": 4, "tokens_per_pass": 3.0, "tokens": {"0": [1, 2]},
             "settings": bench.settings_of(args, "code"), "stamp": stamp,
             **({"gpu": "NVIDIA H100"} if args is gpu_args else {})}
            for args in (cpu_args, gpu_args) for B, speed in ((1, 2.0), (8, 8.0))]
    assert [bench.machine_of(r) for r in rows] == ["AMD EPYC"] * 2 + ["NVIDIA H100"] * 2
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(bench.json.dumps(r) + "\n" for r in rows))
    assert bench.main(["--report-only", "--device", "cuda", "--rows", str(path), "--write-docs"]) == 0
    out = capsys.readouterr().out
    assert "NVIDIA H100" in out and "AMD EPYC" not in out
    assert "offspec B=8 8.00 tokens/s = 4.00× offspec B=1" in out


def test_a_cuda_run_without_cuda_is_one_line(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exit_:
        bench._common.run_main(lambda: bench.main(["--device", "cuda", "--no-peer", "--concurrency", "1"]))
    assert exit_.value.code == 1
    assert capsys.readouterr().err.strip() == ("error: device 'cuda' requested but CUDA is not available on this "
                                               "machine")


@pytest.mark.parametrize("device", ["cpu", GPU])
@pytest.mark.parametrize("regime", ["disk", "cpu"])
def test_a_cell_measures_offspec_and_the_peer_in_the_regime_on_the_device(pair, tmp_path, regime, device):
    """offspec at B=2 makes each prompt's tokens of B=1 (float32, greedy), streaming every layer every pass where
    the regime streams; the peer's left-padded batch of 2 makes the same tokens, up to an EOS (its min_new_tokens
    keeps EOS from being chosen; offspec ignores EOS but may pick it)."""
    target_dir, draft_dir = pair
    args = bench.parse_args(["--new-tokens", "8", "--dtype", "float32", "--device", device])
    models = bench.Models.open(target_dir, draft_dir)
    prompt_ids = [bench.encode_prompt(models.tokenizer, text) for text in ("a", "write two short things")]
    requests = [bench.GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=8, ignore_eos=True,
                                        tree=bench.TreeConfig()) for ids in prompt_ids]
    store = str(tmp_path / "store")
    alone = bench.offspec_cell(models, regime, requests, 1, args, store)
    together = bench.offspec_cell(models, regime, requests, 2, args, store)
    assert together["tokens"] == alone["tokens"] and together["rows_per_pass"] > 1
    streamed = regime == "disk" or device == "cuda"
    assert together["offload"] == (regime if streamed else "none")
    assert (together["gb_streamed_per_token"] > 0) == streamed
    assert together["device"].startswith(device)
    peer = bench.peer_cell(target_dir, regime, prompt_ids, 2, args, str(tmp_path / "hf-offload"))
    assert peer["passes"] == 8 and peer["generated_tokens"] == 16
    for i, ours in alone["tokens"].items():
        n = ours.index(EOS) if EOS in ours else len(ours)
        assert peer["tokens"][i][:n] == ours[:n]
