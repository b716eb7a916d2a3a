"""offspec.bench.runner's statistics (the runner's, which the scripts share): bootstrap intervals over prompts, paired
ratios, shuffled run orders, row stamps."""
import statistics

import numpy as np
import pytest


@pytest.fixture(scope="module")
def st():
    from offspec.bench import runner as bench
    return bench


def test_median_ci_brackets_the_median_and_is_reproducible(st):
    values = [0.21, 0.25, 0.19, 0.4, 0.22, 0.3, 0.26, 0.18, 0.23, 0.5]
    cell = st.median_ci(values)
    assert cell["median"] == pytest.approx(statistics.median(values)) and cell["n"] == 10
    assert min(values) <= cell["low"] <= cell["median"] <= cell["high"] <= max(values)
    assert cell["low"] < cell["high"]
    assert st.median_ci(values) == cell                      # fixed seed: the same rows print the same interval
    assert st.median_ci([0.3] * 7) == {"median": 0.3, "low": 0.3, "high": 0.3, "n": 7}
    assert st.median_ci([]) is None and st.median_ci([None]) is None


def test_median_ci_narrows_with_more_prompts(st):
    rng = np.random.default_rng(0)
    few = st.median_ci(rng.normal(1.0, 0.2, 8).tolist())
    many = st.median_ci(rng.normal(1.0, 0.2, 512).tolist())
    assert many["high"] - many["low"] < (few["high"] - few["low"]) / 3


def test_ratio_ci_is_paired(st):
    """Prompts differ tenfold in difficulty, but one system is always exactly 2x faster: paired resampling keeps
    the ratio at 2 in every resample (unpaired intervals of the two medians would overlap widely)."""
    slow = [0.1 * k for k in range(1, 21)]
    fast = [s / 2 for s in slow]
    r = st.ratio_ci(slow, fast)
    assert r == {"ratio": pytest.approx(2.0), "low": pytest.approx(2.0), "high": pytest.approx(2.0), "n": 20}
    a, b = st.median_ci(slow), st.median_ci(fast)
    assert a["low"] < b["high"]                               # the unpaired intervals overlap
    noisy = st.ratio_ci(slow, [s / 2 * (1.2 if k % 2 else 0.8) for k, s in enumerate(slow)])
    assert noisy["low"] < 2.0 < noisy["high"]
    assert st.ratio_ci([1.0, None], [None, 1.0]) is None      # only pairs where both systems ran count
    with pytest.raises(ValueError):
        st.ratio_ci([1.0], [1.0, 2.0])


def test_shuffled_order_is_a_reproducible_permutation_per_prompt_and_repeat(st):
    systems = ["hf-plain", "hf-assisted", "offspec-none", "offspec-tree", "offspec-chain"]
    orders = {(p, r): st.shuffled_order(systems, p, r) for p in ("a", "b", "c") for r in range(3)}
    assert all(sorted(o) == sorted(systems) for o in orders.values())
    assert st.shuffled_order(systems, "a", 1) == orders[("a", 1)]
    assert len({tuple(o) for o in orders.values()}) > 3       # not one fixed order
    assert len({o[0] for o in orders.values()}) > 1           # no system always first


def test_stamp_and_format(st):
    s = st.stamp()
    assert set(s) == {"commit", "time", "load_average", "machine"} and s["time"].endswith("Z")
    assert s["load_average"] is None or len(s["load_average"]) == 3
    assert st.fmt_ci({"median": 0.2634, "low": 0.2411, "high": 0.29, "n": 3}) == "0.263 [0.241, 0.290]"
    ratio = {"ratio": 1.5, "low": 1.2, "high": 1.8, "n": 3}
    assert st.fmt_ci(ratio, 2, key="ratio", suffix="x") == "1.50x [1.20, 1.80]"
    assert st.fmt_ci(None) == "–"
