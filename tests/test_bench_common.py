"""scripts/_common.py: a section's head says where and when its rows were measured (never the rendering's own time),
and a section is written between its markers; offspec.bench.runner's rows files, which every script reads and appends to,
are read plain or gzip-compressed and appended to only plain."""
import gzip
import json
import sys

import pytest
import torch
from scripts_module import load_script

from offspec.bench import runner as bench
from offspec.errors import InputError

common = load_script("_common")
CPU = torch.device("cpu")


def stamped(time, commit="abc", machine="AMD EPYC, 2 torch threads", load=1.5):
    return {"stamp": {"commit": commit, "time": time, "load_average": [load, 1.0, 1.0], "machine": machine}}


def test_the_measured_line_comes_from_the_rows_stamps():
    rows = [stamped("2026-11-25T08:43:19Z", load=1.83), stamped("2026-11-26T00:55:40Z", commit="def", load=5.09), {}]
    assert common.measured_line(rows) == ("Measured on AMD EPYC, 2 torch threads, 2026-11-25 08:43–2026-11-26 00:55 "
                                          "UTC, commits abc, def; 1-minute load 1.83–5.09; 1 of 3 rows carry no stamp.")
    one_day = [stamped("2026-11-25T22:25:44Z"), stamped("2026-11-25T23:54:26Z")]
    assert "2026-11-25 22:25–23:54 UTC, commit abc;" in common.measured_line(one_day)
    assert common.measured_line([{}, {"stamp": None}]) == ("Rows carry no stamp: where they were measured is not "
                                                           "recorded.")
    old = [{"time": "2026-11-22T05:03:49"}, {"time": "2026-11-22T05:35:15", "commit": "c0ffee"}]
    assert common.measured_line(old) == ("Rows carry no stamp (their own fields: times 2026-11-22 05:03–05:35 by the "
                                         "run's clock, commit c0ffee): where they were measured is not recorded.")
    assert common.measured_line([stamped("2026-11-25T08:43:19Z"), old[1]]).endswith(
        "; 1 of 2 rows carry no stamp (their own fields: times 2026-11-22 05:35 by the run's clock, commit c0ffee).")


def test_a_report_only_render_never_claims_its_own_machine_and_time(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["scripts/bench_x.py", "--report-only", "--write-docs"])
    head = common.run_header(CPU, 0.0, "9.99 / 9.99 / 9.99", [stamped("2026-11-23T18:27:35Z")])
    lines = head.splitlines()
    assert lines[0] == "```" and lines[1].endswith("--report-only --write-docs") and lines[2] == "```"
    assert lines[3].startswith("Measured on AMD EPYC, 2 torch threads, 2026-11-23 18:27 UTC") and len(lines) == 4
    assert "9.99" not in head and "1970" not in head
    assert common.run_header(CPU, 0.0, "9.99 / 9.99 / 9.99").splitlines()[3:] == []   # no rows given: the command alone


def test_a_measuring_run_names_this_machine_its_times_and_commit(monkeypatch):
    monkeypatch.setattr(sys, "argv", ["scripts/bench_x.py", "--write-docs"])
    monkeypatch.setattr(common, "git_commit", lambda: "1234567")
    monkeypatch.setattr(common, "load_average", lambda: "2.00 / 1.00 / 1.00")
    head = common.run_header(CPU, 1_700_000_000.0, "1.00 / 1.00 / 1.00")
    line = head.splitlines()[3]
    assert line.startswith(f"Measured on {common.cpu_model()}, {torch.get_num_threads()} torch threads, "
                           f"torch {torch.__version__}, 2023-11-14 22:13")
    assert "commit 1234567; 1-minute load 1.00 at the start, 2.00 at the end." in line


def test_rows_files_are_read_plain_or_gzip_compressed_and_appended_to_only_plain(tmp_path):
    plain = tmp_path / "rows.jsonl"
    bench.append_row(plain, {"n": 1})
    bench.append_row(plain, {"n": 2})
    assert plain.read_text() == '{"n": 1}\n{"n": 2}\n'
    packed = tmp_path / "packed.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"n": 1}\n') + gzip.compress(b'{"n": 2}\n'))   # two members: one stream
    for path in (plain, packed, tmp_path / "packed.jsonl"):   # naming x.jsonl finds x.jsonl.gz where only it exists
        assert bench.read_rows(path) == [{"n": 1}, {"n": 2}]
    assert bench.rows_file(tmp_path / "packed.jsonl") == packed and bench.rows_file(plain) == plain
    assert bench.rows_file(tmp_path / "none.jsonl") == tmp_path / "none.jsonl"
    assert bench.read_rows(tmp_path / "none.jsonl") == [] and bench.read_rows(None) == []


def test_a_compressed_rows_file_is_a_read_only_archive(tmp_path):
    packed = tmp_path / "rows.jsonl.gz"
    packed.write_bytes(gzip.compress(b'{"n": 1}\n'))
    for path in (packed, tmp_path / "rows.jsonl"):
        with pytest.raises(InputError) as refused:
            bench.append_row(path, {"n": 2})
        assert str(refused.value) == f"{packed} is a compressed archive; gunzip it to add rows"
        with pytest.raises(InputError, match="is a compressed archive"):
            bench.check_appendable(path)
    assert gzip.decompress(packed.read_bytes()) == b'{"n": 1}\n' and not (tmp_path / "rows.jsonl").exists()
    bench.check_appendable(tmp_path / "new.jsonl")                    # plain, absent, or None: fine
    bench.check_appendable(None)


def test_a_truncated_gzip_tail_keeps_the_rows_before_it_with_a_warning(tmp_path, capsys):
    lines = [json.dumps({"n": n, "pad": "x" * 50}) + "\n" for n in range(400)]
    whole = gzip.compress("".join(lines[:300]).encode()) + gzip.compress("".join(lines[300:]).encode())
    for cut in (len(whole) - 4, len(whole) - 30, len(whole) // 2, len(whole) - 9):
        path = tmp_path / f"cut{cut}.jsonl.gz"
        path.write_bytes(whole[:cut])
        rows = bench.read_rows(path)
        assert [r["n"] for r in rows] == list(range(len(rows))) and 0 < len(rows) <= 400
        assert f"warning: {path} ends early" in capsys.readouterr().err
    assert len(bench.read_rows(tmp_path / f"cut{len(whole) - 4}.jsonl.gz")) == 400   # only the trailer's CRC lost


def test_a_torn_last_json_line_is_skipped_with_a_warning(tmp_path, capsys):
    path = tmp_path / "rows.jsonl"
    path.write_text('{"n": 1}\n{"n": 2, "pa')
    assert bench.read_rows(path, torn="ignored (measured again)") == [{"n": 1}]
    assert capsys.readouterr().err.strip() == f"warning: {path}:2 is not a complete JSON line; ignored (measured again)"


def test_both_the_plain_and_the_compressed_file_is_one_clear_error(tmp_path):
    (tmp_path / "rows.jsonl").write_text('{"n": 1}\n')
    (tmp_path / "rows.jsonl.gz").write_bytes(gzip.compress(b'{"n": 2}\n'))
    for call in (bench.rows_file, bench.read_rows, bench.check_appendable, lambda p: bench.append_row(p, {})):
        with pytest.raises(InputError) as both:
            call(tmp_path / "rows.jsonl")
        assert str(both.value).startswith(f"both {tmp_path / 'rows.jsonl'} and {tmp_path / 'rows.jsonl.gz'} exist")
        assert "\n" not in str(both.value)
    assert bench.rows_file(tmp_path / "rows.jsonl.gz") == tmp_path / "rows.jsonl.gz"   # named outright: that one


def test_git_commit_and_cpu_model_are_offspec_benchs(monkeypatch):
    from offspec.bench import runner as bench
    monkeypatch.setenv("OFFSPEC_COMMIT", "feedbee")
    assert common.git_commit() == bench.git_commit() == "feedbee"
    assert common.cpu_model() == bench.cpu_model()


def test_a_rows_cpu_names_its_family_model_and_bf16_instructions(tmp_path, monkeypatch):
    """Two machines sold as "AMD EPYC" differ in their stamps, and a stamp says whether bf16 is native."""
    from offspec.bench import runner as bench
    block = "processor\t: {n}\nmodel name\t: AMD EPYC\ncpu family\t: {family}\nmodel\t\t: {model}\nflags\t\t: {flags}\n\n"
    for family, model, flags, want in ((23, 49, "fpu sse avx avx2 fma", "AMD EPYC (family 23 model 49; avx2)"),
                                       (25, 17, "avx2 avx512f avx512_bf16", "AMD EPYC (family 25 model 17; avx512f "
                                                                            "avx512_bf16)")):
        info = tmp_path / f"cpuinfo{family}"
        info.write_text("".join(block.format(n=n, family=family, model=model, flags=flags) for n in range(2)))
        monkeypatch.setattr(bench, "CPUINFO", str(info))
        assert bench.cpu_model() == want
    monkeypatch.setattr(bench, "CPUINFO", str(tmp_path / "none"))
    assert bench.cpu_model()                                               # the platform's name


def test_a_section_is_written_between_its_markers_of_the_file_named(tmp_path):
    doc = tmp_path / "entry.md"
    doc.write_text("# An entry\n\nas it was\n")
    common.write_doc_section("tool", "first", path=doc)
    common.write_doc_section("tool", "second", path=doc)
    assert doc.read_text() == "# An entry\n\nas it was\n\n<!-- tool:start -->\nsecond\n<!-- tool:end -->\n"
