"""scripts/bench_batch.py's model-free parts: repeats in shuffled order, resume, and the table over repeats."""
import json
from types import SimpleNamespace

import pytest

from scripts_module import load_script

bench = load_script("bench_batch")
_stats = load_script("_stats")


@pytest.fixture
def fake_cells(monkeypatch):
    """measure_set without models: every cell returns a row whose tokens/s is its call number."""
    calls = []

    def offspec_cell(models, regime, requests, B, args, store_dir, plain=False):
        calls.append((regime, "offspec --tree none" if plain else "offspec", B))
        return {"tokens_per_second": float(len(calls)), "concurrency": B}

    def peer_cell(target_dir, regime, prompt_ids, B, args, offload_folder):
        calls.append((regime, "transformers", B))
        return {"tokens_per_second": float(len(calls)), "concurrency": B}

    monkeypatch.setattr(bench, "offspec_cell", offspec_cell)
    monkeypatch.setattr(bench, "peer_cell", peer_cell)
    monkeypatch.setattr(bench, "load_prompt_set", lambda name, n: [(f"{name}/{i}", "text") for i in range(n)])
    monkeypatch.setattr(bench, "encode_prompt", lambda tokenizer, text: [5, 6, 7])
    return calls


def test_every_cell_runs_once_a_repeat_in_a_shuffled_order_and_a_rerun_resumes(fake_cells, tmp_path):
    rows_path = tmp_path / "rows.jsonl"
    args = bench.parse_args(["--prompts", "2", "--concurrency", "1,2,auto", "--none-concurrency", "2",
                             "--peer-concurrency", "2", "--regimes", "cpu", "--repeats", "2", "--rows", str(rows_path)])
    models = SimpleNamespace(tokenizer=None)
    rows = bench.measure_set(models, "target", "code", args, [], str(tmp_path))
    cells = [("cpu", "offspec", 1), ("cpu", "offspec", 2), ("cpu", "offspec", "auto"),
             ("cpu", "offspec --tree none", 2), ("cpu", "transformers", 2)]
    assert fake_cells == _stats.shuffled_order(cells, "code", 0) + _stats.shuffled_order(cells, "code", 1)
    assert sorted(fake_cells, key=str) == sorted(cells * 2, key=str)
    assert [r["repeat"] for r in rows] == [0] * 5 + [1] * 5
    stored = bench.load_rows(rows_path)
    assert [(r["regime"], r["system"], r["concurrency"], r["repeat"]) for r in stored] == \
        [(r["regime"], r["system"], r["concurrency"], r["repeat"]) for r in rows]

    # a third repeat asked later: only it runs; the first two come from the rows file
    fake_cells.clear()
    args3 = bench.parse_args(["--prompts", "2", "--concurrency", "1,2,auto", "--none-concurrency", "2",
                              "--peer-concurrency", "2", "--regimes", "cpu", "--repeats", "3", "--rows", str(rows_path)])
    rows3 = bench.measure_set(models, "target", "code", args3, bench.load_rows(rows_path), str(tmp_path))
    assert fake_cells == _stats.shuffled_order(cells, "code", 2)
    assert len(rows3) == 15 and sorted(r["repeat"] for r in rows3) == [0] * 5 + [1] * 5 + [2] * 5


def row(system, B, speed, repeat, regime="disk", prompt_set="code", tokens=None, machine=None):
    stamp = {"stamp": {"machine": f"{machine}, 2 torch threads"}} if machine else {}
    return {"prompt_set": prompt_set, "regime": regime, "system": system, "concurrency": B, "repeat": repeat,
            "tokens_per_second": speed, "passes": 10, "rows_per_pass": 1.0, "tokens_per_pass": 4.0,
            "gb_streamed_per_token": 0.1, "median_prompt_seconds_per_token": 1 / speed, "most_in_flight": B,
            "tokens": tokens or {"0": [1, 2, 3, 4]}, **stamp}


def test_the_table_gives_each_cell_the_median_of_its_repeats_and_its_range():
    rows = [row("offspec", 1, s, k) for k, s in enumerate((1.0, 3.0, 2.0))]
    rows += [row("offspec", 8, s, k, tokens={"0": [1, 2, 9, 9]}) for k, s in enumerate((9.0, 6.0, 7.5))]
    rows += [row("transformers", 8, 2.0, 0)]
    headers, table = bench.report(rows, None)
    by_cell = {(line[3], line[4]): dict(zip(headers, line)) for line in table}
    assert by_cell[("offspec", 1)]["runs"] == "3"
    assert by_cell[("offspec", 1)]["tokens/s [min, max]"] == "2.000 [1.000, 3.000]"
    assert by_cell[("offspec", 8)]["tokens/s [min, max]"] == "7.500 [6.000, 9.000]"
    assert by_cell[("offspec", 8)]["× B=1"] == "3.75×"                   # 7.5 / 2.0: the medians' ratio
    assert by_cell[("offspec", 8)]["agrees with offspec B=1"] == "50%"
    assert by_cell[("transformers", 8)]["tokens/s [min, max]"] == "2.000"  # one run: no range
    assert bench.goal_lines(rows) == [
        "- code, cold disk (unrecorded): offspec B=8 7.50 tokens/s = 3.75× offspec B=1 (2.00); goal ≥ 3×: met",
        "- code, cold disk (unrecorded): offspec B=8 7.50 tokens/s = 3.75× transformers B=8 (2.00); goal ≥ 4×: NOT met"]


def test_cells_never_pool_two_machines_and_each_has_its_own_baseline():
    """The same cell measured on two CPUs is two lines, each against its own machine's B=1, with goals apiece;
    unstamped rows are a machine of their own ("unrecorded") and sort last."""
    rows = [row("offspec", 1, 2.0, 0), row("offspec", 8, 8.0, 0),
            row("offspec", 1, 4.0, 0, machine="AMD EPYC"), row("offspec", 8, 6.0, 0, machine="AMD EPYC")]
    headers, table = bench.report(rows, None)
    by_cell = {(line[2], line[4]): dict(zip(headers, line)) for line in table}
    assert [(line[2], line[4]) for line in table] == [("AMD EPYC", 1), ("AMD EPYC", 8), ("unrecorded", 1),
                                                      ("unrecorded", 8)]
    assert by_cell[("AMD EPYC", 8)]["× B=1"] == "1.50×" and by_cell[("unrecorded", 8)]["× B=1"] == "4.00×"
    assert by_cell[("AMD EPYC", 8)]["runs"] == "1"
    assert [line.split(":")[0] for line in bench.goal_lines(rows)] == ["- code, cold disk (AMD EPYC)",
                                                                       "- code, cold disk (unrecorded)"]


def test_a_repeat_measured_on_another_machine_does_not_count_here(fake_cells, tmp_path, monkeypatch):
    """Resume skips only this machine's rows: another CPU's repeat 0 is measured again here."""
    args = bench.parse_args(["--prompts", "2", "--concurrency", "1", "--none-concurrency", "", "--no-peer",
                             "--regimes", "cpu", "--repeats", "1", "--rows", str(tmp_path / "rows.jsonl")])
    settings = {"prompts": 2, "new_tokens": 64, "tree_budget": "auto", "dtype": "bfloat16", "disk_io": "direct",
                "prompt_set": "code"}
    elsewhere = {**row("offspec", 1, 2.0, 0, regime="cpu", machine="Intel Xeon"), "settings": settings}
    monkeypatch.setattr(bench._common, "cpu_model", lambda: "AMD EPYC")
    rows = bench.measure_set(SimpleNamespace(tokenizer=None), "target", "code", args, [elsewhere], str(tmp_path))
    assert fake_cells == [("cpu", "offspec", 1)]
    assert [bench.machine_of(r) for r in rows] == ["Intel Xeon", "AMD EPYC"]


def test_rows_from_before_repeats_count_as_repeat_0(tmp_path):
    old = row("offspec", 1, 2.0, 0)
    del old["repeat"], old["prompt_set"]
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps(old) + "\n")
    (loaded,) = bench.load_rows(path)
    assert loaded["repeat"] == 0 and loaded["prompt_set"] == "code"


def test_repeats_below_one_is_one_line_and_exit_2(capsys):
    assert bench.main(["--repeats", "0"]) == 2
    assert "--repeats must be at least 1" in capsys.readouterr().err


def test_planner_trace_splits_the_job_into_tree_plain_and_prefill_rounds():
    trace = load_script("planner_trace")
    log = [dict(grown=2, timed=False, draft_s=1.0, catch_up_s=0.5, target_s=2.5, yielded=6),
           dict(grown=2, timed=True, draft_s=0.2, catch_up_s=0.05, target_s=0.25, yielded=5),
           dict(grown=0, timed=True, draft_s=0.0, catch_up_s=0.0, target_s=0.2, yielded=2),
           dict(grown=0, timed=True, draft_s=0.0, catch_up_s=0.0, target_s=0.2, yielded=2)]
    assert trace.summary(log) == ("tree rounds: 1 rounds, 5 tokens in 0.5 s (10.0 tokens/s); "
                                  "plain rounds: 2 rounds, 4 tokens in 0.4 s (10.0 tokens/s); "
                                  "prefill rounds: 1 rounds, 6 tokens in 4.0 s (1.5 tokens/s)")


@pytest.mark.parametrize("args", [["--concurrency", "0"], ["--new-tokens", "0"], ["--tree", "nonsense"], ["--slots", "1"]])
def test_planner_trace_refuses_bad_arguments_in_one_line(args, capsys):
    trace = load_script("planner_trace")
    with pytest.raises(SystemExit) as stop:
        trace.main(args)
    assert stop.value.code == 2 and "Traceback" not in capsys.readouterr().err


def test_report_only_renders_the_rows_of_these_settings_without_loading_a_model(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(bench, "ensure_demo_models", lambda: pytest.fail("models loaded"))
    args = bench.parse_args(["--prompt-sets", "chat"])
    kept = [{**row("offspec", 1, 2.0, 0, prompt_set="chat"), "settings": bench.settings_of(args, "chat")},
            {**row("offspec", 8, 8.0, 0, prompt_set="chat"), "settings": bench.settings_of(args, "chat")}]
    other = {**row("offspec", 1, 9.0, 0), "settings": {**bench.settings_of(args, "code"), "new_tokens": 8}}
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in [*kept, other]))
    assert bench.main(["--report-only", "--prompt-sets", "chat,code", "--rows", str(path)]) == 0
    out = capsys.readouterr().out
    assert "4.00×" in out and "9.000" not in out            # the chat cells; the code row has other settings
    assert bench.main(["--report-only", "--prompt-sets", "code", "--rows", str(path)]) == 1
    assert "no rows of these settings" in capsys.readouterr().err
