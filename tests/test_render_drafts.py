"""scripts/render_drafts.py on hand-made bench_accept rows (no model): a ratio pairs the prompts both cells
measured, a missing cell is listed as not measured, and cells of different settings are refused."""
import json

import pytest
from scripts_module import load_script

from offspec.errors import InputError


@pytest.fixture(scope="module")
def rd():
    return load_script("render_drafts")


def rows_file(path, draft, cells, new_tokens=64, prompt_set="chat", temperature=0.0, mode="w"):
    """cells: {prompt id: {system: tokens per pass}}; mode "a" adds the rows of another temperature."""
    settings = {"prompt_set": prompt_set, "new_tokens": new_tokens, "dtype": "bfloat16", "offload": "none",
                "device": "cpu", "seed": 0, "models": ["target", draft]}
    with open(path, mode) as f:
        for pid, systems in cells.items():
            f.write(json.dumps({"prompt_set": prompt_set, "settings": settings, "id": pid,
                                "seed": None if temperature == 0 else 0, "temperature": temperature,
                                "draft_quant": "int4" if draft == "self" else "int8",
                                "command": f"python scripts/bench_accept.py --rows {path}",
                                "systems": {s: {"tokens_per_pass": v, "mean_tree_size": 1.0}
                                            for s, v in systems.items()}}) + "\n")
    return str(path)


def test_pairs_common_prompts_and_lists_what_is_missing(rd, tmp_path, capsys):
    twin = rows_file(tmp_path / "self.jsonl", "self", {"a": {"dyspec-64": 8.0}, "b": {"dyspec-64": 12.0},
                                                       "c": {"dyspec-64": 30.0}})
    small = rows_file(tmp_path / "small.jsonl", "small", {"a": {"dyspec-64": 4.0}, "b": {"dyspec-64": 6.0}})
    got = rd.compared(rd.Compare("twin / small", rd.Cell(twin, "dyspec-64"), rd.Cell(small, "dyspec-64")))
    assert got["num"] == [8.0, 12.0] and got["den"] == [4.0, 6.0]          # prompt c: the twin's alone, left out
    line = rd.table_line(rd.Compare("twin / small", rd.Cell(twin, "dyspec-64"), rd.Cell(small, "dyspec-64")), got)
    assert line[5].startswith("twin int4, dyspec-64: 10.00") and line[6].startswith("small int8, dyspec-64: 5.00")
    assert line[4] == "0" and line[7].startswith("2.00x") and line[8] == "2"
    assert rd.main(["--compare", f"{twin}:dyspec-256", f"{small}:dyspec-64"]) == 0
    out = capsys.readouterr().out
    assert "twin int4, dyspec-256: not measured" in out and "not measured" in out.splitlines()[-1]
    unmeasured = rd.Compare("x", rd.Cell(str(tmp_path / "none.jsonl"), "dyspec-64"), rd.Cell(small, "dyspec-64"))
    missing = rd.table_line(unmeasured, rd.compared(unmeasured))           # a GRID file not yet measured
    assert missing[5] == "–, dyspec-64: not measured" and missing[7] == "not measured" and missing[8] == "0"
    assert missing[6].startswith("small int8, dyspec-64: 5.00") and missing[6].endswith("(2 prompts, unpaired)")
    with pytest.raises(InputError, match="no rows file"):                  # ... but a typed one is a mistake
        rd.main(["--compare", f"{tmp_path / 'none.jsonl'}:dyspec-64", f"{small}:dyspec-64"])


def test_refuses_cells_of_different_settings(rd, tmp_path):
    a = rows_file(tmp_path / "a.jsonl", "self", {"a": {"dyspec-64": 8.0}})
    b = rows_file(tmp_path / "b.jsonl", "small", {"a": {"dyspec-64": 4.0}}, new_tokens=256)
    with pytest.raises(InputError, match="differ in new_tokens"):
        rd.main(["--compare", f"{a}:dyspec-64", f"{b}:dyspec-64"])
    with pytest.raises(InputError, match="FILE:SYSTEM"):
        rd.main(["--compare", a, f"{b}:dyspec-64"])


def test_the_published_grid_renders_from_the_committed_rows(rd):
    lines, rows = rd.render(rd.GRID)
    assert len(lines) == len(rd.GRID) and rows
    measured = [line for line in lines if line[7] != "not measured"]
    assert measured and all(line[7].endswith("]") for line in measured)


def test_a_cell_takes_its_temperature(rd, tmp_path):
    path = rows_file(tmp_path / "t.jsonl", "self", {"a": {"sequoia-64": 9.0, "dyspec-64": 3.0}})
    rows_file(path, "self", {"a": {"sequoia-64": 4.0, "dyspec-64": 8.0}}, temperature=0.6, mode="a")
    sampled = rd.compared(rd._trees(path, 64, temperature=0.6))
    assert sampled["num"] == [4.0] and sampled["den"] == [8.0]
    assert rd.compared(rd._trees(path, 64))["num"] == [9.0]
    line = rd.table_line(rd._trees(path, 64, temperature=0.6), sampled)
    assert line[4] == "0.6" and line[7].startswith("0.50x")
    with pytest.raises(InputError, match="differ in temperature"):
        rd.compared(rd.Compare("x", rd.Cell(path, "sequoia-64", 0.6), rd.Cell(path, "dyspec-64")))
