"""scripts/devtools/sequoia_depth_plan.py and tree_values.py: their model-free parts."""
import json

import pytest
from scripts_module import load_script

plan = load_script("sequoia_depth_plan")
CHAIN = (0.98, 0.01)       # a twin-like vector: its best trees are long chains


def test_a_dear_pass_goes_deep_and_a_dear_call_stays_shallow():
    seconds, n, depth, tokens = plan.best_round(CHAIN, a=2.0, b=0.0, c0=0.001, bound=1024)
    assert depth > 32 and tokens > 1 + sum(0.98 ** d for d in range(1, 33))
    bounded = plan.best_round(CHAIN, a=2.0, b=0.0, c0=0.001, bound=32)
    assert bounded[2] == 32 and bounded[0] > seconds
    assert plan.best_round(CHAIN, a=0.01, b=0.0, c0=0.05, bound=1024)[2] < 32


def test_the_table_from_a_cache_file(tmp_path, capsys):
    path = tmp_path / "pair.json"
    path.write_text(json.dumps({"version": 1, "tried": [100.0, 2.0], "hits": [98.0, 1.0]}))
    assert plan.main([str(path), "--pass", "2", "--call-ms", "1"]) == 0
    row = capsys.readouterr().out.splitlines()[-1].split("|")
    assert row[1].strip() == "2" and float(row[-2].strip().rstrip("x")) > 1.0


def test_a_missing_or_malformed_vector_is_one_line(tmp_path):
    with pytest.raises(SystemExit, match="cannot read an acceptance vector from .*missing.json"):
        plan.main([str(tmp_path / "missing.json")])
    (tmp_path / "bad.json").write_text('{"tried": [1.0], "hits": [2.0]}')
    with pytest.raises(SystemExit, match="hits <= tried"):
        plan.main([str(tmp_path / "bad.json")])


# ------------------------------------------------------------------------------------------------ tree_values.py
def test_tree_values_sets_both_models_beside_the_accepted_tokens():
    from offspec.spec.tree import TokenTree

    values = load_script("tree_values")
    tree = TokenTree(0, capacity=4)
    a = tree.add(0, 1, 0.9, draft_prob=0.5, estimate=0.9)      # grown as Sequoia grows: f = 0.9, 0.81, 0.01
    tree.add(a, 2, 0.81, draft_prob=0.4, estimate=0.9)
    tree.add(0, 3, 0.01, draft_prob=0.2, estimate=0.01)
    assert values.draft_values(tree) == pytest.approx([1.0, 0.5, 0.2, 0.2])
    r = values.round_record(tree, accepted=2)
    assert r["grown"] == pytest.approx(1.72) and r["draft"] == pytest.approx(0.9)
    assert r["by_depth"] == [pytest.approx([0.91, 0.7]), pytest.approx([0.81, 0.2])]
    lines = values.summary([r, values.round_record(tree, accepted=0)])
    assert "accepted 1.00" in lines[0] and lines[-1] == "| 2 | 0.500 | 0.810 | 0.200 |"
