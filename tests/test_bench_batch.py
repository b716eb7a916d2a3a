"""scripts/bench_batch.py's model-free parts: repeats in shuffled order, resume, and the table over repeats."""
import json
from types import SimpleNamespace

import pytest

from scripts_module import load_script
from offspec.errors import InputError

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
                             "--peer-concurrency", "2", "--regimes", "cpu", "--repeats", "2", "--rows", str(rows_path),
                             "--cell-process", "shared"])
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
                              "--peer-concurrency", "2", "--regimes", "cpu", "--repeats", "3", "--rows", str(rows_path),
                              "--cell-process", "shared"])
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
    by_cell = {(line[4], line[5]): dict(zip(headers, line)) for line in table}
    assert by_cell[("offspec", 1)]["runs"] == "3"
    assert by_cell[("offspec", 1)]["tokens/s [min, max]"] == "2.000 [1.000, 3.000]"
    assert by_cell[("offspec", 8)]["tokens/s [min, max]"] == "7.500 [6.000, 9.000]"
    assert by_cell[("offspec", 8)]["× B=1"] == "3.75×"                   # 7.5 / 2.0: the medians' ratio
    assert by_cell[("offspec", 8)]["agrees with offspec B=1"] == "50%"
    assert by_cell[("transformers", 8)]["tokens/s [min, max]"] == "2.000"  # one run: no range
    where = "- code, cold disk (unrecorded, cells sharing a process): offspec B=8 7.50 tokens/s = 3.75×"
    assert bench.goal_lines(rows) == [f"{where} offspec B=1 (2.00); goal ≥ 3×: met",
                                      f"{where} transformers B=8 (2.00); goal ≥ 4×: NOT met"]


def test_cells_never_pool_two_machines_and_each_has_its_own_baseline():
    """The same cell measured on two CPUs is two lines, each against its own machine's B=1, with goals apiece;
    unstamped rows are a machine of their own ("unrecorded") and sort last."""
    rows = [row("offspec", 1, 2.0, 0), row("offspec", 8, 8.0, 0),
            row("offspec", 1, 4.0, 0, machine="AMD EPYC"), row("offspec", 8, 6.0, 0, machine="AMD EPYC")]
    headers, table = bench.report(rows, None)
    by_cell = {(line[2], line[5]): dict(zip(headers, line)) for line in table}
    assert [(line[2], line[5]) for line in table] == [("AMD EPYC", 1), ("AMD EPYC", 8), ("unrecorded", 1),
                                                      ("unrecorded", 8)]
    assert by_cell[("AMD EPYC", 8)]["× B=1"] == "1.50×" and by_cell[("unrecorded", 8)]["× B=1"] == "4.00×"
    assert by_cell[("AMD EPYC", 8)]["runs"] == "1"
    assert [line.split(":")[0] for line in bench.goal_lines(rows)] == [
        "- code, cold disk (AMD EPYC, cells sharing a process)", "- code, cold disk (unrecorded, cells sharing a process)"]


def test_a_repeat_measured_on_another_machine_does_not_count_here(fake_cells, tmp_path, monkeypatch):
    """Resume skips only this machine's rows: another CPU's repeat 0 is measured again here."""
    args = bench.parse_args(["--prompts", "2", "--concurrency", "1", "--none-concurrency", "", "--no-peer",
                             "--regimes", "cpu", "--repeats", "1", "--rows", str(tmp_path / "rows.jsonl"),
                             "--cell-process", "shared", "--device", "cpu"])
    settings = {"prompts": 2, "new_tokens": 64, "tree_budget": "auto", "dtype": "bfloat16", "disk_io": "direct",
                "prompt_set": "code", "cell_process": "shared", "device": "cpu"}
    elsewhere = {**row("offspec", 1, 2.0, 0, regime="cpu", machine="Intel Xeon"), "settings": settings}
    from offspec.bench import runner
    monkeypatch.setattr(runner, "cpu_model", lambda: "AMD EPYC")           # this machine's, and its rows' stamps
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


def test_planner_trace_splits_the_job_into_tree_plain_and_prefill_rounds_and_the_drain():
    trace = load_script("planner_trace")
    log = [dict(rows=2, grown=2, timed=False, draft_s=1.0, catch_up_s=0.5, target_s=2.5, yielded=6),
           dict(rows=2, grown=2, timed=True, draft_s=0.2, catch_up_s=0.05, target_s=0.25, yielded=5),
           dict(rows=2, grown=0, timed=True, draft_s=0.0, catch_up_s=0.0, target_s=0.2, yielded=2),
           dict(rows=1, grown=0, timed=True, draft_s=0.0, catch_up_s=0.0, target_s=0.2, yielded=1)]
    assert trace.summary(log).splitlines() == [
        "tree rounds: 1 rounds, 5 tokens in 0.5 s (10.0 tokens/s); "
        "plain rounds: 2 rounds, 3 tokens in 0.4 s (7.5 tokens/s); "
        "prefill rounds: 1 rounds, 6 tokens in 4.0 s (1.5 tokens/s)",
        "all 2 rows in flight: 3 rounds, 13 tokens in 4.7 s (2.8 tokens/s); "
        "fewer (the drain): 1 rounds, 1 tokens in 0.2 s (5.0 tokens/s)"]


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
    assert "rows of these settings in" in capsys.readouterr().err


def test_a_cell_in_its_own_process_is_this_script_run_again_with_the_same_settings(tmp_path):
    args = bench.parse_args(["--prompts", "3", "--new-tokens", "16", "--tree-budget", "32", "--disk-io", "buffered",
                             "--dtype", "float32"])
    command = bench.cell_command(args, "chat", "disk", "offspec --tree none", "auto", str(tmp_path), "out.json")
    assert command[1] == str(bench.Path(bench.__file__).resolve())
    child = bench.parse_args(command[2:])
    assert bench.settings_of(child, "chat") == bench.settings_of(args, "chat")
    assert json.loads(child.one_cell) == {"prompt_set": "chat", "regime": "disk", "system": "offspec --tree none",
                                          "B": "auto", "dir": str(tmp_path), "out": "out.json"}


def test_one_cell_measures_the_named_cell_and_writes_its_dict(tmp_path, monkeypatch):
    measured = []
    monkeypatch.setattr(bench, "ensure_demo_models", lambda: ("target", "draft"))
    monkeypatch.setattr(bench.Models, "open", staticmethod(lambda target, draft: "models"))
    monkeypatch.setattr(bench, "cell_here", lambda models, target_dir, *cell: measured.append((models, *cell[:4]))
                        or {"tokens_per_second": 3.5})
    out = tmp_path / "cell.json"
    spec = {"prompt_set": "code", "regime": "cpu", "system": "offspec", "B": 4, "dir": str(tmp_path), "out": str(out)}
    assert bench.main(["--one-cell", json.dumps(spec)]) == 0
    assert measured == [("models", "code", "cpu", "offspec", 4)]
    assert json.loads(out.read_text()) == {"tokens_per_second": 3.5}


def test_own_process_cells_run_as_child_processes_and_a_failed_one_is_one_line(tmp_path, monkeypatch, capsys):
    """The real subprocess plumbing with a stand-in child: its dict becomes the row; a child that dies ends the
    run with one line and exit 1, keeping the rows already measured."""
    def child(args, prompt_set, regime, system, B, tmp, out):
        cell = {k: v for k, v in row("offspec", B, float(B), 0).items() if k not in ("prompt_set", "regime", "system")}
        code = f"open({out!r}, 'w').write({json.dumps(cell)!r})" if B != 3 else "raise SystemExit(3)"
        return [bench.sys.executable, "-c", code]
    monkeypatch.setattr(bench, "cell_command", child)
    monkeypatch.setattr(bench, "ensure_demo_models", lambda: ("target", "draft"))
    monkeypatch.setattr(bench.Models, "open", staticmethod(lambda *a: pytest.fail("models opened in the parent")))
    rows_path = tmp_path / "rows.jsonl"
    argv = ["--prompts", "2", "--concurrency", "1,2", "--none-concurrency", "", "--no-peer", "--regimes", "cpu",
            "--repeats", "1", "--rows", str(rows_path)]
    assert bench.main(argv) == 0
    stored = bench.load_rows(rows_path)
    assert sorted(r["tokens_per_second"] for r in stored) == [1.0, 2.0]
    assert {r["settings"]["cell_process"] for r in stored} == {"own"}

    assert bench.main([*argv[:3], "1,3", *argv[4:]]) == 1
    err = capsys.readouterr().err
    assert "the code cpu offspec B=3 cell failed in its own process (exit 3)" in err and "Traceback" not in err
    assert len(bench.load_rows(rows_path)) == 2


def test_the_goal_cells_render_into_a_section_of_their_own(tmp_path, monkeypatch):
    written = {}
    paths = {}
    monkeypatch.setattr(bench._common, "write_doc_section",
                        lambda name, body, path: (written.setdefault(name, body), paths.setdefault(name, path.name)))
    args = bench.parse_args(["--prompt-sets", "chat"])
    rows = [{**row("offspec", B, speed, 1, prompt_set="chat", regime="disk"), "settings": bench.settings_of(args, "chat")}
            for B, speed in ((1, 2.0), (8, 7.0))]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    common = ["--report-only", "--prompt-sets", "chat", "--rows", str(path), "--write-docs"]
    assert bench.main(common + ["--doc-section", "goals"]) == 0
    assert list(written) == ["bench_batch_goals"]         # the main table's section is left as it was
    body = written["bench_batch_goals"]
    assert body.startswith("### Issue #11's goal cells") and "3.50× offspec B=1 (2.00); goal ≥ 3×: met" in body
    assert bench.main(common) == 0 and written["bench_batch"].startswith("## Batched speculation")
    assert paths == {"bench_batch_goals": "2026-11-25-batch-cold-disk-goals.md", "bench_batch": "benchmarks.md"}


def test_the_docs_table_is_tokens_per_second_by_B_for_one_machine_and_process_per_regime():
    """The section's headline: one line per (prompt set, regime, system), B in columns, each cell the median with its
    ratio to offspec B=1 of the same kind; a stamped machine's rows are shown before unstamped ones, cells in their
    own process before cells sharing one, and the goals are those of the rows shown."""
    own = {"settings": {"cell_process": "own"}}
    rows = [{**row("offspec", 1, s, k, machine="AMD EPYC"), **own} for k, s in enumerate((2.0, 4.0, 3.0))]
    rows += [{**row("offspec", 8, 9.0, 0, machine="AMD EPYC"), **own},
             {**row("transformers", 8, 2.0, 0, machine="AMD EPYC"), **own},
             row("offspec", 1, 1.0, 0), row("offspec", 8, 5.0, 0)]                    # unrecorded, shared: not shown
    headers, table, shown = bench.headline(rows)
    assert headers == ["prompts", "regime", "machine, process", "system", "runs", "B=1", "B=8"]
    assert table == [["code", "disk", "AMD EPYC, own", "offspec", "1–3", "3.00 (1.00×)", "9.00 (3.00×)"],
                     ["code", "disk", "AMD EPYC, own", "transformers", "1", "", "2.00 (0.67×)"]]
    assert len(shown) == 5
    assert bench.goal_lines(shown, compact=True) == [
        "- code, cold disk (AMD EPYC, each cell in its own process): offspec B=8 9.00 tokens/s = 3.00× offspec B=1 "
        "(3.00); goal ≥ 3×: met. 4.50× transformers B=8 (2.00); goal ≥ 4×: met"]


def test_a_compressed_rows_file_is_read_and_never_appended_to(tmp_path, capsys):
    """load_rows reads a .jsonl.gz (a command naming the .jsonl finds it); append_row, and a measuring run at its
    arguments (before any model loads), refuse it in one line; --report-only and --predict read it."""
    import gzip
    packed = tmp_path / "rows.jsonl.gz"
    with gzip.open(packed, "wt") as f:
        f.write(json.dumps(row("offspec", 1, 2.0, 0)) + "\n")
    assert [r["concurrency"] for r in bench.load_rows(tmp_path / "rows.jsonl")] == [1]
    assert [r["concurrency"] for r in bench.load_rows(packed)] == [1]
    for rows in (packed, tmp_path / "rows.jsonl"):
        with pytest.raises(InputError, match=f"^{packed} is a compressed archive; gunzip it to add rows$"):
            bench.append_row(str(rows), row("offspec", 8, 8.0, 0))
        with pytest.raises(InputError, match="is a compressed archive"):
            bench.parse_args(["--rows", str(rows)])
    assert not (tmp_path / "rows.jsonl").exists()
    for ok in (["--report-only"], ["--predict"]):
        assert bench.parse_args([*ok, "--rows", str(packed)]).rows == str(packed)


def test_a_torn_last_line_is_skipped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(row("offspec", 1, 2.0, 0)) + "\n" + json.dumps(row("offspec", 8, 8.0, 0))[:20])
    assert [r["concurrency"] for r in bench.load_rows(path)] == [1]
    assert f"{path}:2 is not a complete JSON line" in capsys.readouterr().err


def test_the_section_says_where_the_rows_it_shows_were_measured_and_the_table_explains_its_columns(
        tmp_path, monkeypatch, capsys):
    """The "Measured on" line is that of the rows the section's table shows, not of every row kept (here the
    unstamped shared-process rows the table leaves out); the printed table comes with what its columns are."""
    written = {}
    monkeypatch.setattr(bench._common, "write_doc_section", lambda name, body, path: written.setdefault(name, body))
    args = bench.parse_args(["--prompt-sets", "code"])
    own = {"settings": {**bench.settings_of(args, "code"), "cell_process": "own"}}
    shared = {"settings": {**bench.settings_of(args, "code"), "cell_process": "shared"}}
    stamp = {"commit": "abc1234", "time": "2026-11-25T08:43:19Z", "load_average": [1.5, 1.0, 1.0],
             "machine": "AMD EPYC, 2 torch threads"}
    rows = [{**row("offspec", B, speed, 0), **own, "stamp": stamp} for B, speed in ((1, 2.0), (8, 7.0))]
    rows += [{**row("offspec", B, speed, 0), **shared, "time": "2026-11-23T10:46:00", "commit": "old0000"}
             for B, speed in ((1, 1.0), (8, 5.0))]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert bench.main(["--report-only", "--prompt-sets", "code", "--rows", str(path), "--write-docs"]) == 0
    measured = written["bench_batch"].splitlines()[4]
    assert measured == "Measured on AMD EPYC, 2 torch threads, 2026-11-25 08:43 UTC, commit abc1234; 1-minute load 1.50–1.50."
    out = capsys.readouterr().out
    assert bench.COLUMN_NOTES.startswith("Columns of the printed table") and bench.COLUMN_NOTES in out
    for words in ("draft s/pass", "pass s", "stream GB/s", "these three are medians", "prompt s/token", "`unrecorded`",
                  "agrees", "bf16: batched matmuls round differently"):
        assert words.lower() in bench.COLUMN_NOTES.lower(), words
    assert out.index("agrees with offspec B=1") < out.index("Columns of the")          # beneath the table


def test_the_prediction_names_its_command_and_says_why_a_B_does_not_fit(capsys):
    assert bench.main(["--predict", "--rows", "/nonexistent.jsonl"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("### Prediction: a 70B on one 24 GB GPU, by prompts in flight\n```\npython ")
    assert "PREDICTED from measured parts, not measured." in out
    assert "| 64 | does not fit | – |" in out and "B=64 does not fit: " in out
