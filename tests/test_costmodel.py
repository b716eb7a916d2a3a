"""The cost model's GPU inputs are the measured ones (docs/gpu_70b*.json), and its predictions use them."""
import json
import statistics
from pathlib import Path

import pytest

from offspec.plan.costmodel import (
    DEQUANT,
    GPUS,
    H100,
    GpuSetup,
    _at,
    dequant_figure,
    dequant_seconds,
    draft_call_seconds,
    find_gpu,
    pass_compute_seconds,
    predict_seconds_per_token,
    transfer_seconds,
)

DOCS = Path(__file__).resolve().parents[1] / "docs"


def runs() -> list[dict]:
    return [json.loads((DOCS / name).read_text()) for name in ("gpu_70b.json", "gpu_70b_run1.json")]


def test_the_h100_figures_are_the_committed_measurements():
    latest = runs()[0]
    assert latest["environment"]["gpu"] in H100.device and not latest["environment"]["tiny"]
    assert H100.spec.name in latest["environment"]["gpu"]
    rows = latest["pass70b"]["rows"]
    assert all(r["logits_equal"] for r in rows)
    assert H100.link_gb_per_s == pytest.approx(statistics.median(r["copy_gbps"] for r in rows), rel=0.01)
    assert dict(H100.layer_compute_s) == pytest.approx({r["tokens"]: r["compute_per_layer_s"] for r in rows}, rel=0.02)
    lowest = {}
    for run in runs():
        for r in run["drafts"]["rows"]:
            if r["draft"] == "1B":
                lowest[r["tokens"]] = min(lowest.get(r["tokens"], 1.0), r["call_s"])
    assert dict(H100.draft_call_s) == pytest.approx(lowest, rel=0.02)


def test_the_dequantization_figures_are_the_h200_kernels_measurement():
    """Each format's figure is its row in offspec's own tile (kernels.TILES) of the H200 session of 2026-11-28
    (docs/gpu/2026-11-28-h200/gpu_70b.json), every one of them equal to the torch path bit for bit; nf4 is
    bitsandbytes'. The record names that card."""
    from offspec.formats.kernels import TILES, tile_key
    h200 = json.loads((DOCS / "gpu" / "2026-11-28-h200" / "gpu_70b.json").read_text())
    assert "H200" in h200["environment"]["gpu"] and not h200["environment"]["tiny"]
    assert DEQUANT.spec.name in h200["environment"]["gpu"] and "H200" in DEQUANT.device
    rows = {}
    for r in h200["dequant"]["rows"]:
        if r["path"] == "kernel":
            assert r["equal"], r
        quant = {"gguf-q4_k+q6_k": "gguf:q4_k"}.get(r["quant"], r["quant"])
        if r["quant"] == "nf4" or (r["path"] == "kernel" and tuple(r["tile"]) == TILES[tile_key(quant)]):
            rows[r["quant"]] = r
    assert set(rows) == {q for q, _ in DEQUANT.s_per_gb}
    for quant, r in rows.items():
        assert dequant_seconds(quant, r["dense_bytes"]) == pytest.approx(r["seconds"], rel=0.01), quant


def test_every_format_dequantizes_within_twice_nf4_and_a_quantized_pass_costs_its_copies():
    """The issue's goals, as measured: every format's 70B layer in at most 2x nf4's time on the same card, and
    the streamed AWQ and Q4_K_M passes (dequantization on its own queue, by the kernels) within 1.15x their
    copies alone (docs/gpu/2026-11-28-h200/call1_gpu_70b.json)."""
    figures = dict(DEQUANT.s_per_gb)
    assert all(s <= 2 * figures["nf4"] for s in figures.values())
    call1 = json.loads((DOCS / "gpu" / "2026-11-28-h200" / "call1_gpu_70b.json").read_text())
    ours = [r for r in call1["passq"]["rows"] if r["queues"] == "two" and r["path"] == "kernel"]
    assert {r["quant"] for r in ours} == {"awq-g128", "gguf-q4_k+q6_k", "nf4"}
    assert all(r["pass_over_copies"] <= 1.15 for r in ours)


def test_cards_are_found_by_the_names_people_and_torch_use():
    assert find_gpu("NVIDIA GeForce RTX 4090") == find_gpu("4090") == find_gpu("rtx 4090")
    assert find_gpu("NVIDIA H100 80GB HBM3").name == "NVIDIA H100" and find_gpu("NVIDIA H200").name == "NVIDIA H200"
    assert find_gpu("RTX 4070 Ti SUPER") is None and find_gpu("H100 PCIe") is None and find_gpu("Tesla T4") is None
    assert {"rtx3090", "rtx4070ti", "rtx4080", "rtx4090", "rtx5090"} <= {g.key for g in GPUS}


def test_a_consumer_card_scales_compute_and_dequantization():
    """Reading the weights once scales by memory bandwidth, what more tokens add by the bf16 rate, and the
    dequantization kernels by memory bandwidth; the reference cards themselves are unscaled."""
    rtx4090, h100 = find_gpu("4090"), find_gpu("h100")
    L = H100.layer_params
    one = pass_compute_seconds(L, 1, 1, rtx4090)
    assert one == pytest.approx(0.85e-3 * 3352 / 1008)
    assert pass_compute_seconds(L, 1, 1024, rtx4090) == pytest.approx(one + (3.34e-3 - 0.85e-3) * 989.4 / 165.2)
    assert pass_compute_seconds(L, 80, 1024, h100) == pytest.approx(pass_compute_seconds(L, 80, 1024))
    assert dequant_seconds("awq-g128", 10**9, rtx4090) == pytest.approx(dequant_seconds("awq-g128", 10**9) * 4800 / 1008)
    # a format whose kernel is measured in another variant takes that variant's figure
    assert dequant_figure("awq-g64")[0] == "awq-g128" and dequant_figure("gguf:q8_0,q8_0,q8_0,q8_0,q8_0,q8_0,q8_0")
    assert dequant_figure("none") is None and dequant_seconds("none", 10**9) == 0.0


def test_dequantization_runs_beside_the_copies():
    """A pass's transfer is max(copies, dequantization, drive), not copies + dequantization."""
    assert transfer_seconds(24 * 10**9, 0, 0, 24.0, 9.0, None, dequant_s=0.5) == pytest.approx(1.0)
    assert transfer_seconds(24 * 10**9, 0, 0, 24.0, 9.0, None, dequant_s=1.5) == pytest.approx(1.5)
    assert transfer_seconds(0, 0, 4 * 10**9, 24.0, 9.0, 2.0) == pytest.approx(2.0)


def test_interpolation_is_exact_at_the_points_and_linear_between():
    points = ((1, 1.0), (64, 2.0), (256, 4.0))
    assert [_at(points, x) for x in (1, 64, 256)] == [1.0, 2.0, 4.0]
    assert _at(points, 160) == pytest.approx(3.0)
    assert _at(points, 448) == pytest.approx(6.0)       # beyond: along the last segment
    assert _at(points, 0) == 1.0                         # below: the first point


def test_a_70b_pass_is_its_layers_times_the_measured_layer():
    seventy_b = 80
    assert pass_compute_seconds(H100.layer_params, seventy_b, 1024) == pytest.approx(80 * 3.34e-3)
    assert pass_compute_seconds(H100.layer_params // 2, seventy_b, 1024) == pytest.approx(40 * 3.34e-3)
    assert dequant_seconds("none", 10**9) == 0.0 and draft_call_seconds(64) == pytest.approx(11.4e-3)


def test_held_layers_add_their_dequantization_to_the_pass():
    setup = GpuSetup(link_gb_per_s=24.0, dequant_s_per_layer=dequant_seconds("nf4", 1_711_308_800))
    plain = predict_seconds_per_token(24 * 10**9, setup, tokens_per_pass=8, draft_seconds_per_round=0.0)
    held = predict_seconds_per_token(24 * 10**9, setup, tokens_per_pass=8, draft_seconds_per_round=0.0, held_layers=10)
    assert plain["pass_seconds"] == pytest.approx(1.0)
    assert held["pass_seconds"] == pytest.approx(1.0 + 10 * dequant_seconds("nf4", 1_711_308_800), rel=0.01)
