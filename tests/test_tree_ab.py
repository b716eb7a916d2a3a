"""scripts/devtools/tree_ab.py's model-free parts: the per-prompt table across commits, and its refusals."""
import pytest
from scripts_module import load_script

from offspec.errors import InputError

ab = load_script("tree_ab")
SETTINGS = {"policy": "dyspec", "budget": 64, "prompt_set": "code", "raw": True, "new_tokens": 96,
            "dtype": "bfloat16", "temperature": 0.0}


def row(commit, pid, accepted, generated=96):
    return {"commit": commit, "prompt_id": pid, "generated": generated, "passes": len(accepted),
            "accepted": accepted, "settings": SETTINGS}


def test_the_table_puts_each_commit_in_a_column_and_says_whether_its_rounds_are_the_first_commits():
    rows = [row("old", "p0", [30, 30, 30, 2]), row("old", "p1", [10] * 8 + [9]),
            row("new", "p0", [30, 30, 30, 2]), row("new", "p1", [12] * 8)]
    text = ab.table(rows)
    assert "dyspec budget 64, code (no template), 96 tokens, T = 0" in text
    assert "| prompt | old | new |" in text
    assert "| p0 | 24.00 (4) | 24.00 (4, same rounds) |" in text
    assert "| p1 | 10.67 (9) | 12.00 (8, other rounds) |" in text


def test_a_prompt_one_commit_lacks_shows_a_dash():
    text = ab.table([row("old", "p0", [47, 47]), row("new", "p1", [47, 47])])
    assert "| p0 | 48.00 (2) | – |" in text and "| p1 | – | 48.00 (2) |" in text


def test_no_checkout_is_one_line_and_exit_2(tmp_path, capsys):
    assert ab.main(["--budget", "64", "--rows", str(tmp_path / "r.jsonl")]) == 2
    assert "--checkout and --budget are required" in capsys.readouterr().err


def test_a_checkout_without_offspec_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    monkeypatch.setattr("offspec.formats.demo.ensure_demo_models", lambda: pytest.fail("models loaded"))
    with pytest.raises(InputError, match="no offspec package there"):
        ab.main(["--checkout", str(tmp_path), "--budget", "64", "--rows", str(tmp_path / "r.jsonl")])


def test_a_compressed_rows_file_is_refused_before_any_model_loads(tmp_path, monkeypatch):
    import gzip
    monkeypatch.setattr("offspec.formats.demo.ensure_demo_models", lambda: pytest.fail("models loaded"))
    (tmp_path / "r.jsonl.gz").write_bytes(gzip.compress(b""))
    with pytest.raises(InputError, match="r.jsonl.gz is a compressed archive; gunzip it to add rows"):
        ab.main(["--checkout", str(tmp_path), "--budget", "64", "--rows", str(tmp_path / "r.jsonl")])


def test_write_docs_puts_the_table_into_its_notes_entry(tmp_path, monkeypatch, capsys):
    """--write-docs writes into the tree_ab block of its notes entry (appended the first time, the entry's dated text
    left as it is), not into docs/benchmarks.md."""
    import json
    assert ab.NOTES.parent.name == "notes" and ab.NOTES.is_file()
    doc = tmp_path / "entry.md"
    doc.write_text("# Code against the issue's figures\n\nas written\n")
    monkeypatch.setattr(ab, "NOTES", doc)
    rows = tmp_path / "rows.jsonl"
    rows.write_text("".join(json.dumps({**row("old", "p0", [47, 47]), "stamp": {}}) + "\n" for _ in (0,)))
    assert ab.main(["--report-only", "--rows", str(rows), "--write-docs"]) == 0
    text = doc.read_text()
    assert text.startswith("# Code against the issue's figures\n\nas written\n\n<!-- tree_ab:start -->\n")
    assert "| p0 | 48.00 (2) |" in text and text.endswith("<!-- tree_ab:end -->\n")
