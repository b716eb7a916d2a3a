"""The options named for a machine (offspec/plan/options.py): every target quantization and offload mode planned, the
one auto would use and the fastest marked, what does not fit named, and what would keep the layers in RAM."""
from __future__ import annotations

import pytest
import torch
from shapes import headers_only_checkpoint

from offspec.config import OffloadConfig, RunLimits, RuntimeConfig
from offspec.formats.checkpoint import Checkpoint
from offspec.plan.machine import GB, Machine
from offspec.plan.options import compare
from offspec.plan.passtime import predicted_pass_seconds
from offspec.plan.search import make_plan
from offspec.plan.sizes import ModelSpec


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("options")
    return tuple(ModelSpec.of(Checkpoint(headers_only_checkpoint(root, name), headers_only=True))
                 for name in ("Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct"))


def compared(pair, device_gb, host_gb, quant="none"):
    return compare(*pair, OffloadConfig(mode="auto"), RuntimeConfig(dtype=torch.bfloat16, target_quant=quant),
                   RunLimits(context=4096), Machine.given(device_gb * GB, host_gb * GB), 24.0, 3.0)


def test_a_70b_on_64gb_names_nf4_in_ram_as_the_fastest_and_bf16_tiers_as_auto(pair):
    c = compared(pair, 24, 64)
    fastest = c.options[0]
    assert (fastest.target_quant, fastest.plan.mode) == ("nf4", "cpu")
    assert (c.auto.target_quant, c.auto.plan.mode) == ("none", "cpu+disk")
    assert [o.pass_seconds for o in c.options] == sorted(o.pass_seconds for o in c.options)
    # each row is what make_plan gives for it, timed as models info predicts it
    for o in c.options:
        plan = make_plan(*pair, OffloadConfig(mode=o.mode), RuntimeConfig(dtype=torch.bfloat16,
                         target_quant=o.target_quant), RunLimits(context=4096), Machine.given(24 * GB, 64 * GB))
        assert plan.placement == o.plan.placement
        if not plan.placement.resident_held:
            assert o.pass_seconds == pytest.approx(predicted_pass_seconds(plan, 24.0, 3.0))
    assert "as stored cpu" in c.refused and "nf4 none" in c.refused
    table = c.table()
    lines = table.splitlines()
    assert any(line.split()[:2] == ["nf4", "cpu"] and line.rstrip().endswith("fastest") for line in lines)
    assert any(line.split()[:3] == ["as", "stored", "cpu+disk"] and line.rstrip().endswith("auto") for line in lines)
    assert "change the target" in table and "does not fit: " in table
    # the bf16 plan reads from disk: what would keep it in pinned RAM is said, and is right
    assert c.keep_in_ram is not None and "pinned RAM would take about" in table
    roomy = make_plan(*pair, OffloadConfig(mode="auto"), RuntimeConfig(dtype=torch.bfloat16), RunLimits(context=4096),
                      Machine.given(24 * GB, c.keep_in_ram))
    assert roomy.mode == "cpu" and roomy.host_pinned


def test_everything_in_ram_says_nothing_about_ram_and_marks_one_row_twice(pair):
    c = compared(pair, 24, 256, quant="nf4")
    assert c.keep_in_ram is None
    assert c.auto.key == c.options[0].key                  # nf4 in pinned RAM: auto is the fastest
    assert any(line.rstrip().endswith("auto, fastest") for line in c.table().splitlines())


def test_a_machine_nothing_fits_says_so_in_one_line(pair):
    c = compared(pair, 4, 16)
    assert not c.options and c.auto is None
    assert "\n" not in c.table() and "nothing fits" in c.table()


def test_models_info_prints_the_options_and_shows_them_before_a_refusal(tmp_path):
    import json

    from click.testing import CliRunner

    from offspec.cli.main import main
    t, d = (headers_only_checkpoint(tmp_path, name) for name in ("Llama-3.1-70B-Instruct", "Llama-3.2-1B-Instruct"))
    machine = ["--device-memory", "24GB", "--host-memory", "64GB"]
    out = tmp_path / "plan.json"
    r = CliRunner().invoke(main, ["models", "info", str(t), "--draft", str(d), *machine, "--json", str(out)])
    assert r.exit_code == 0, r.output
    assert "options (int8 / nf4 change the target" in r.output and "fastest" in r.output
    report = json.loads(out.read_text())
    assert report["models"] == {"target": str(t), "draft": str(d)} and report["offspec"]["command"].endswith("models info")
    rows = report["compared"]["options"]
    assert rows[0]["fastest"] and rows[0]["target_quant"] == "nf4"
    assert [row["mode"] for row in rows if row["auto"]] == ["cpu+disk"]
    r = CliRunner().invoke(main, ["models", "info", str(t), "--draft", str(d), *machine, "--offload", "cpu"])
    assert r.exit_code == 1 and "options (" in r.output and "offspec: error: the run needs" in r.output


def test_where_everything_fits_forced_offload_modes_are_not_rows_of_their_own(pair):
    """On an 80 GB GPU the 1B fits whole: cpu and disk plans keep every layer resident too, the "none" row again."""
    small = ModelSpec.of(Checkpoint(headers_only_checkpoint(pair_root(pair), "Llama-3.2-1B-Instruct"),
                                    headers_only=True))
    c = compare(small, None, OffloadConfig(mode="auto"), RuntimeConfig(dtype=torch.bfloat16), RunLimits(context=4096),
                Machine.given(80 * GB, 256 * GB), 24.0, 3.0)
    assert sorted((o.target_quant, o.mode) for o in c.options) == [("int8", "none"), ("nf4", "none"), ("none", "none")]


def pair_root(pair):
    from pathlib import Path
    return Path(pair[1].name).parent


def test_the_draft_choices_are_named_for_the_fastest_row(pair):
    """A draft held quantized leaves the device more room for resident target layers: the fastest row is planned
    again with the draft dense, int8-held, nf4 and int4, and the table names each with its predicted pass."""
    c = compared(pair, 24, 64)
    assert [o.plan_draft_quant for o in c.drafts] == ["none", "int8-held", "nf4", "int4"]
    resident = [len(o.plan.placement.resident) for o in c.drafts]
    assert resident[0] < resident[2] and c.drafts[2].pass_seconds < c.drafts[0].pass_seconds
    assert all(o.target_quant == c.options[0].target_quant for o in c.drafts)
    assert "the draft, for the fastest row (nf4 cpu): as stored" in c.table()
    assert [d["draft_quant"] for d in c.to_dict()["drafts"]] == ["none", "int8-held", "nf4", "int4"]
    alone = compare(pair[0], None, OffloadConfig(mode="auto"), RuntimeConfig(dtype=torch.bfloat16),
                    RunLimits(context=4096), Machine.given(24 * GB, 64 * GB), 24.0, 3.0)
    assert alone.drafts == () and "the draft" not in alone.table()
