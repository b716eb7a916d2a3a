"""The cost model's GPU inputs are the measured ones (docs/gpu_70b*.json), and its predictions use them."""
import json
import statistics
from pathlib import Path

import pytest

from offspec.plan.costmodel import (
    H100,
    GpuSetup,
    _at,
    dequant_seconds,
    draft_call_seconds,
    pass_compute_seconds,
    predict_seconds_per_token,
)

DOCS = Path(__file__).resolve().parents[1] / "docs"


def runs() -> list[dict]:
    return [json.loads((DOCS / name).read_text()) for name in ("gpu_70b.json", "gpu_70b_run1.json")]


def test_the_h100_figures_are_the_committed_measurements():
    latest = runs()[0]
    assert latest["environment"]["gpu"] in H100.device and not latest["environment"]["tiny"]
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
    for r in latest["dequant"]["rows"]:
        assert dequant_seconds(r["quant"], r["dense_bytes"]) == pytest.approx(r["seconds"], rel=0.02)


def test_the_published_formats_dequantization_is_the_h200_measurement():
    """The published formats' figures are the H200 session's (docs/gpu/2026-11-27-h200/gpu_70b.json), where int8
    and nf4 ran within 13% of the H100's."""
    h200 = json.loads((DOCS / "gpu" / "2026-11-27-h200" / "gpu_70b.json").read_text())
    assert "H200" in h200["environment"]["gpu"] and not h200["environment"]["tiny"]
    for r in h200["dequant"]["rows"]:
        if r["quant"] in ("int8", "nf4"):
            assert dequant_seconds(r["quant"], r["dense_bytes"]) == pytest.approx(r["seconds"], rel=0.15)
        else:
            assert dequant_seconds(r["quant"], r["dense_bytes"]) == pytest.approx(r["seconds"], rel=0.01)
    assert {r["quant"] for r in h200["dequant"]["rows"]} == {q for q, _ in H100.dequant_s_per_gb}


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
    assert held["pass_seconds"] == pytest.approx(1.0 + 10 * 1.06e-3, rel=0.01)
