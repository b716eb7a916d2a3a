"""`offspec doctor` on this CPU-only machine: every section runs or says why not, the drive is measured, and the
advice for a target comes from its memory plan."""
import json

import pytest
import torch
from click.testing import CliRunner
from tiny import hf_config, make_model, perturbed_copy, save_checkpoint

from offspec.cli.doctor import check, link
from offspec.cli.main import main
from offspec.formats import cpu_bf16


@pytest.fixture(autouse=True)
def offspec_home(tmp_path, monkeypatch):
    """doctor keeps the rates it measured under $OFFSPEC_HOME: a test's own, never the user's."""
    monkeypatch.setenv("OFFSPEC_HOME", str(tmp_path / "home"))
    return tmp_path / "home"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("doctor")
    target = make_model(hf_config("qwen2", n_layers=2), seed=7)
    return save_checkpoint(target, root / "t"), save_checkpoint(perturbed_copy(target, 0.02), root / "d")


def test_doctor_cli_reports_every_section(pair, tmp_path):
    out = tmp_path / "doctor.json"
    r = CliRunner().invoke(main, ["doctor", "--target", str(pair[0]), "--draft", str(pair[1]), "--device", "cpu",
                                  "--store-dir", str(tmp_path / "stores"), "--quick", "--json", str(out)])
    assert r.exit_code == 0, r.output
    report = json.loads(out.read_text())
    assert report["models"] == {"target": str(pair[0]), "draft": str(pair[1])}        # provenance, as every report
    assert report["offspec"]["command"].endswith("doctor") and report["options"]["quick"] is True
    assert report["devices"]["cuda"] is False and report["pinning"]["status"] == "skipped"
    assert report["devices"]["cpu_bf16"] is cpu_bf16.native_bf16()        # says whether bf16 trees run in float32
    assert ("with" if cpu_bf16.native_bf16() else "without") + " bfloat16 instructions" in r.output
    assert report["host"]["usable_bytes"] > 0 and report["host"]["default_pinned_budget_bytes"] < report["host"]["usable_bytes"]
    assert report["link"]["pageable_gbps"] > 0
    drive = report["drive"]
    assert drive["status"] == "ok" and drive["read_gbps"] > 0 and drive["buffered_gbps"] > 0
    assert not list((tmp_path / "stores").iterdir()), "the probe file is removed"
    advice = report["advice"]
    assert advice["plan"]["mode"] == "none" and "--offload none --tree-budget auto" in advice["recommended_flags"]
    for needle in ("device: none (CPU only", "host:", "pinning: skipped", "link: host -> device", "drive (",
                   "memory plan: cpu", "recommended: offspec generate --target"):
        assert needle in r.output, needle


def test_doctor_without_a_target_still_checks_the_machine(monkeypatch, tmp_path):
    monkeypatch.setenv("OFFSPEC_HOME", str(tmp_path))         # no demo models prepared here
    report = check(None, None, torch.device("cpu"), str(tmp_path / "s"), quick=True)
    assert report["advice"]["status"] == "skipped" and report["drive"]["status"] == "ok"


def test_a_failing_section_is_recorded_and_the_rest_still_run(pair, tmp_path, monkeypatch):
    import offspec.cli.doctor as doctor_mod

    def broken(*args):
        raise OSError(5, "Input/output error")

    monkeypatch.setattr(doctor_mod, "drive", broken)
    from offspec.formats.checkpoint import Checkpoint
    report = check(Checkpoint(pair[0], headers_only=True), None, torch.device("cpu"), str(tmp_path), quick=True)
    assert report["drive"]["status"] == "failed" and "Input/output error" in report["drive"]["error"]
    assert report["link"]["status"] == "ok" and report["advice"]["status"] == "ok"
    r = CliRunner().invoke(main, ["doctor", "--target", str(pair[0]), "--device", "cpu", "--quick"])
    assert r.exit_code == 1 and "drive failed" in r.output


def test_link_probe_runs_through_the_transfer_backend():
    rates = link(torch.device("cpu"), quick=True)
    assert rates["pageable_gbps"] > 0.1 and "pinned_gbps" not in rates


def test_a_target_that_cannot_be_read_fails_the_advice_not_the_checks(tmp_path):
    r = CliRunner().invoke(main, ["doctor", "--target", str(tmp_path / "nowhere"), "--device", "cpu", "--quick",
                                  "--store-dir", str(tmp_path / "stores")])
    assert r.exit_code == 1 and "Traceback" not in r.output
    assert "link: host -> device" in r.output and "advice: failed" in r.output and "advice failed" in r.output


def test_models_info_predicts_with_the_drive_doctor_measured_here(pair, tmp_path, offspec_home):
    """doctor keeps the drive's measured rate (and, on CUDA, the pinned link's); `models info` planning for this
    machine predicts with it and says so, one planning for another machine (--host-memory, --device-memory, --gpu)
    keeps the assumed rate."""
    r = CliRunner().invoke(main, ["doctor", "--target", str(pair[0]), "--device", "cpu", "--quick",
                                  "--store-dir", str(tmp_path / "stores")])
    assert r.exit_code == 0, r.output
    saved = json.loads((offspec_home / "measured_rates.json").read_text())
    assert saved["disk_gbps"] > 0 and "link_gbps" not in saved          # a CPU's "link" is a memcpy: not kept
    here = CliRunner().invoke(main, ["models", "info", str(pair[0])])
    assert here.exit_code == 0, here.output
    assert f"drive {saved['disk_gbps']:g} GB/s (measured by offspec doctor, {saved['measured']})" in here.output
    there = CliRunner().invoke(main, ["models", "info", str(pair[0]), "--host-memory", "8GB"])
    assert "drive 2 GB/s (assumed" in there.output
    given = CliRunner().invoke(main, ["models", "info", str(pair[0]), "--disk-gbps", "5.5"])
    assert "drive 5.5 GB/s (given)" in given.output
