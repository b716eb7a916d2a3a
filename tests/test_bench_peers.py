"""The pure helpers of scripts/bench_peers.py: the rows file (resume), divergence indices, the identity verdict
and the summary of rows that lack a system. No models are loaded."""
import json

import pytest
from scripts_module import load_script



@pytest.fixture(scope="module")
def bp():
    return load_script("bench_peers")


def cell(seconds, agreement=1.0, tokens=8, **extra):
    return {"seconds_per_token": seconds, "tokens": tokens, "agreement_with_hf_plain": agreement, **extra}


# What rows from before issue #13's statistics recorded (HumanEval, greedy, one run per system).
OLD_SETTINGS = {"new_tokens": 8, "dtype": "bfloat16", "policy": "dyspec", "budget": "auto", "slots": 8, "cold": True}


def row(bp, pid, regime="cpu", int8=True, divergence=None):
    tree = dict(tokens_per_pass=4.0, passes=2, draft_seconds=0.2, target_seconds=0.4, gb_streamed=1.0,
                wait_seconds=0.0, transfer_seconds=0.1, mean_tree_size=10.0, mean_depth=3.0)
    r = {"regime": regime, "id": pid, "prompt_tokens": 5, "first_divergence": divergence or {},
         "settings": dict(OLD_SETTINGS),
         "hf-plain": cell(0.4), "hf-assisted": cell(0.2),
         "offspec-none": cell(0.5, target_seconds=3.0, passes=8, gb_streamed=4.0, transfer_seconds=1.0),
         "offspec-tree": cell(0.1, **tree)}
    if int8:
        r[bp.INT8] = cell(0.08, **tree)
    return r


def test_first_divergence(bp):
    assert bp.first_divergence([1, 2, 3], [1, 2, 3]) is None
    assert bp.first_divergence([1, 2, 3], [1, 5, 3]) == 1
    assert bp.first_divergence([7], [8]) == 0
    assert bp.first_divergence([1, 2], [1, 2, 3]) == 2      # a length difference counts where it starts
    assert bp.first_divergence([], []) is None


def test_divergence_index_takes_the_latest_and_reads_old_rows(bp):
    assert bp.divergence_index(row(bp, "a")) is None
    assert bp.divergence_index(row(bp, "a", divergence={"offspec-tree": 3, "hf-assisted": 6})) == 6
    old = row(bp, "a")
    del old["first_divergence"]              # rows written before first_divergence existed
    old["offspec-tree"]["agreement_with_hf_plain"] = 0.25   # 2 of 8 tokens agree
    assert bp.row_divergences(old) == {"offspec-tree": 2}


def test_read_rows_file_skips_a_torn_line_and_separates_checks(bp, tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    check = {"kind": bp.FP32_CHECK, "id": "p1", "checked_tokens": 4, "result": "identical"}
    path.write_text(json.dumps(row(bp, "p0")) + "\n" + json.dumps(check) + "\n" + '{"regime": "cpu", "id": "p1", "hf-')
    rows, checks = bp.read_rows_file(path)
    assert [r["id"] for r in rows] == ["p0"]             # the fp32 check is not a timing row
    assert checks == {"p1": check}
    assert "not a complete JSON line" in capsys.readouterr().err
    # Appending after the torn line starts a new line, so the new row is read back.
    bp.append_line(path, row(bp, "p2"))
    rows, _ = bp.read_rows_file(path)
    assert [r["id"] for r in rows] == ["p0", "p2"]


def test_read_rows_file_missing(bp, tmp_path):
    assert bp.read_rows_file(None) == ([], {})
    assert bp.read_rows_file(tmp_path / "absent.jsonl") == ([], {})


def test_rows_by_key_selects_regime_prompt_seed_and_kind_last_wins(bp):
    first, second = row(bp, "p0"), row(bp, "p0")
    second["prompt_tokens"] = 99
    seeded = dict(row(bp, "p0"), seed=1)
    sweep = dict(row(bp, "p0"), kind=bp.SWEEP_KIND)
    rows = [first, row(bp, "p0", regime="disk"), second, row(bp, "p9"), seeded, sweep]
    chosen = bp.rows_by_key(rows, "cpu", [("p0", None), ("p1", None)])
    assert list(chosen) == [("p0", None)] and chosen[("p0", None)]["prompt_tokens"] == 99
    assert list(bp.rows_by_key(rows, "cpu", [("p0", 1)])) == [("p0", 1)]      # a sampled row is its own key
    assert bp.rows_by_key(rows, "cpu", [("p0", None)], kind=bp.SWEEP_KIND)[("p0", None)] is sweep


def test_move_aside(bp, tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("x\n")
    bp.move_aside(path)
    assert not path.exists() and (tmp_path / "rows.jsonl.bak").read_text() == "x\n"
    bp.move_aside(path)                      # nothing to move: no error


def test_settings_mismatches(bp):
    settings = {"new_tokens": 4, "dtype": "bfloat16"}
    rows = [{"settings": {"new_tokens": 4, "dtype": "bfloat16"}}, {}]   # {} = a row from before settings
    assert bp.settings_mismatches(rows, settings) == []
    rows.append({"settings": {"new_tokens": 128, "dtype": "bfloat16"}})
    assert bp.settings_mismatches(rows, settings) == ["new_tokens: the file has 128, this run 4"]


def test_identity_verdicts(bp):
    rows = [row(bp, "same"), row(bp, "rounded", divergence={"offspec-tree": 5}),
            row(bp, "bad", divergence={"hf-assisted": 2}), row(bp, "new", divergence={"offspec-tree": 1})]
    checks = {"rounded": {"checked_tokens": 6, "result": "identical"},
              "bad": {"checked_tokens": 3, "result": "differs"}}
    summary = bp.identity_summary(rows, checks, fp32_run=False)
    assert summary == {"identical": 1, "rounding": 1, "fail": 1, "unchecked": 1, "prompts": 4}
    assert "FAIL" in bp.identity_text(summary) and "identical in fp32 (checked)" in bp.identity_text(summary)
    # In a float32 run there is nothing to explain: every difference fails.
    assert bp.identity_summary(rows, checks, fp32_run=True)["fail"] == 3
    # A stored check that stops before the divergence does not cover it.
    assert bp.prompt_verdict(row(bp, "rounded", divergence={"offspec-tree": 6}), checks, False) == "unchecked"


def test_fp32_todo_covers_the_latest_divergence_across_regimes(bp):
    results = [{"rows": [row(bp, "a", divergence={"offspec-tree": 3}), row(bp, "b")]},
               {"rows": [row(bp, "a", regime="disk", divergence={"hf-assisted": 7}),
                         row(bp, "c", divergence={"offspec-none": 0})]}]
    assert bp.fp32_todo(results, {}) == {"a": 8, "c": 1}
    checks = {"a": {"checked_tokens": 8, "result": "identical"}, "c": {"checked_tokens": 0, "result": "identical"}}
    assert bp.fp32_todo(results, checks) == {"c": 1}


def render(bp, *summaries, checks=None):
    for s in summaries:
        s["identity"] = bp.identity_summary(s["rows"], checks or {}, fp32_run=False)
    return bp.markdown(list(summaries), "header", "")


def test_summary_and_markdown_with_a_missing_system(bp, tmp_path):
    old_rows = [row(bp, "p0", int8=False), row(bp, "p1", int8=False)]
    summary = bp.summarize_group(old_rows)
    assert bp.INT8 not in summary["systems"] and summary["default"] == "offspec-tree"
    speedups = {(c["system"], c["baseline"]): c["speedup"] for c in summary["comparisons"]}
    assert speedups[("offspec-tree", "hf-assisted")]["ratio"] == pytest.approx(2.0)
    assert (bp.INT8, "hf-assisted") not in speedups
    mixed = bp.summarize_group([row(bp, "p0", regime="disk"), row(bp, "p1", regime="disk", int8=False)])
    assert mixed["rows_with_system"][bp.INT8] == 1 and mixed["default"] == bp.INT8
    vs_peer = next(c for c in mixed["comparisons"] if c["system"] == bp.INT8 and c["baseline"] == "hf-assisted")
    assert vs_peer["speedup"]["ratio"] == pytest.approx(0.2 / 0.08) and vs_peer["speedup"]["n"] == 1
    assert vs_peer["goal"] == bp.GOAL_VS_PEER_DISK          # the peer goal is the cold-disk regime's

    text = render(bp, mixed, summary)
    assert "| cpu, code | offspec-tree | 0.100 [0.100, 0.100] | 4.00x | 2/2 |" in text
    assert f"| disk, code | {bp.INT8} | 0.080 [0.080, 0.080] | 5.00x | 1/1 |" in text
    # 2.5x over hf-assisted's 0.2 s/token would need 0.08: met exactly; --tree none at 0.5 / 0.08 = 6.25x: met
    assert f"| disk, code | {bp.INT8} | hf-assisted | 2.50x [2.50, 2.50] | ≥ 2.5x: met |" in text
    assert f"| disk, code | {bp.INT8} | offspec-none | 6.25x [6.25, 6.25] | ≥ 3x: met |" in text
    assert "cpu, code: identical 2/2" in text
    assert bp.fmt(None, ".2f") == "-"
    bp.plot([summary, mixed], str(tmp_path / "plot.png"))


def test_a_missed_goal_shows_its_arithmetic(bp):
    rows = [row(bp, f"p{k}", regime="disk") for k in range(3)]
    for r in rows:
        r[bp.INT8]["seconds_per_token"] = 0.16          # vs hf-assisted 0.2: 1.25x, needs 0.08 for 2.5x
    text = render(bp, bp.summarize_group(rows))
    assert ("≥ 2.5x: missed (would need ≤ 0.080 s/token = 0.200 / 2.5; measured 0.160, 2.00x too slow)") in text


def test_markdown_labels_hf_assisted_by_what_each_row_read_back(bp):
    """Rows from before issue #13 (no peer_settings) are labelled as transformers' defaults, never as the settings
    they recorded; newer rows by the settings transformers reported using, with their counted tokens per pass."""
    old = [row(bp, "p0"), row(bp, "p1")]
    for r in old:
        r["settings"] = {**OLD_SETTINGS, "assist_tokens": 5}
    used = {"num_assistant_tokens": 4, "num_assistant_tokens_schedule": "constant",
            "assistant_confidence_threshold": 0.0, "num_assistant_tokens_final": 4,
            "assistant_confidence_threshold_final": 0.0, "transformers": "5.23.0"}
    new = [row(bp, "p0", regime="disk"), row(bp, "p1", regime="disk")]
    for r, passes in zip(new, (2, 4)):
        r["hf-assisted"].update(peer_passes=passes, tokens_per_pass=8 / passes, peer_max_draft_tokens=4,
                                peer_draft_tokens=3 * passes, peer_settings=used)

    text = render(bp, bp.summarize_group(old))
    assert f"hf-assisted settings, as each row stores them: {bp.UNAPPLIED_LABEL} (every row)." in text
    assert "num_assistant_tokens 20, schedule constant, assistant_confidence_threshold 0.4" in text
    assert "not the 5 draft tokens, confidence threshold 0" in text and "Not a tuned peer." in text
    assert "| cpu, code | 4.00 | 4.00 | - | - | - | - |" in text     # no hf-assisted passes were counted

    text = render(bp, bp.summarize_group(new))
    assert ("hf-assisted settings, as each row stores them: 4 draft tokens per pass, constant schedule, "
            "confidence threshold 0 (every row).") in text
    assert bp.UNAPPLIED_LABEL not in text and "Not a tuned peer." not in text
    assert "| disk, code | 4.00 | 4.00 | - | - | - | 3.00 |" in text   # median of 4 and 2 tokens a pass

    text = render(bp, bp.summarize_group(new), bp.summarize_group(old))
    assert (f"disk, code: 4 draft tokens per pass, constant schedule, confidence threshold 0 (2 rows); "
            f"cpu, code: {bp.UNAPPLIED_LABEL} (2 rows).") in text


def test_the_sweep_report_names_a_best_setting_per_regime_and_prompt_set(bp, tmp_path, capsys):
    """Code and chat sweeps of one regime are two groups, each with its own best setting, never pooled."""
    labels = [bp.assist_label(a) for a in bp.SWEEP]

    def sweep_row(prompt_set, pid, best):
        cells = {label: {"seconds_per_token": 0.1 if label == best else 0.2, "tokens_per_pass": 4.0}
                 for label in labels}
        return {"kind": bp.SWEEP_KIND, "regime": "cpu", "prompt_set": prompt_set, "id": pid, "prompt_id": pid,
                "seed": None, "cells": cells}
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps(sweep_row(s, f"{s}{i}", labels[1 if s == "code" else 2])) + "\n"
                            for s in ("code", "chat") for i in range(3)))
    assert bp.main(["--report-only", "--assist-sweep", "--rows", str(path), "--regimes", "cpu"]) == 0
    err = capsys.readouterr().err
    assert f"cpu, code: {labels[1]}:" in err and f"cpu, chat: {labels[2]}:" in err


def test_rows_of_a_gpu_never_pool_with_the_cpus_and_name_it(bp, tmp_path, capsys):
    """A GPU's rows (settings device cuda, the GPU's model in "gpu") are a group of their own, in the timing
    tables and in the sweep, named by the GPU; rows from before --device ran on the CPU and resume into a CPU run."""
    cpu = {**row(bp, "p0"), "settings": {**OLD_SETTINGS, "device": "cpu"}}
    gpu = {**row(bp, "p0"), "settings": {**OLD_SETTINGS, "device": "cuda"}, "gpu": "NVIDIA H100"}
    groups = bp.group_rows([gpu, cpu, row(bp, "p1")])
    assert [[r.get("gpu") for r in g] for g in groups] == [[None, None], ["NVIDIA H100"]]
    assert bp.group_name(bp.summarize_group(groups[1])) == "cpu, code, on NVIDIA H100"
    assert bp.group_name(bp.summarize_group(groups[0])) == "cpu, code"
    assert bp.settings_mismatches([row(bp, "p1")], {**OLD_SETTINGS, "device": "cpu"}) == []
    assert bp.settings_mismatches([gpu], {**OLD_SETTINGS, "device": "cpu"}) == [
        "device: the file has 'cuda', this run 'cpu'"]

    labels = [bp.assist_label(a) for a in bp.SWEEP]
    sweep = [{"kind": bp.SWEEP_KIND, "regime": "disk", "prompt_set": "code", "id": "p0", "prompt_id": "p0",
              "seed": None, **extra, "cells": {label: {"seconds_per_token": 0.1 if label == best else 0.2,
                                                       "tokens_per_pass": 4.0} for label in labels}}
             for extra, best in (({}, labels[1]), ({"gpu": "NVIDIA H100"}, labels[3]))]
    path = tmp_path / "sweep.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in sweep))
    assert bp.main(["--report-only", "--assist-sweep", "--rows", str(path), "--regimes", "disk"]) == 0
    err = capsys.readouterr().err
    assert f"disk, code: {labels[1]}:" in err and f"disk on NVIDIA H100, code: {labels[3]}:" in err


def test_device_cuda_without_cuda_is_one_line_and_on_a_gpu_the_int8_draft_is_left_out(bp, monkeypatch, capsys):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit) as exit_:
        bp.parse_args(["--device", "cuda"])
    assert exit_.value.code == 2
    assert "--device: device 'cuda' requested but CUDA is not available on this machine" in capsys.readouterr().err
    assert bp.parse_args(["--device", "auto"])[1].device.type == "cpu"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)      # parsing touches no GPU
    _, args = bp.parse_args(["--device", "cuda"])
    assert args.device.type == "cuda" and not args.int8_draft
    assert bp.INT8 not in bp.regime_systems(args, "disk")
