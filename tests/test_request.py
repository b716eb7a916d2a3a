"""The request checks (request.py), each written once: what they refuse, and that every way in (the library's
encode_prompt and GenerationRequest, prompt files) gives the same message. The CLI's and the engine's: test_cli,
test_generate, test_batch_engine."""
import json

import pytest

from offspec.config import TreeConfig
from offspec.engine.prompt import encode_prompt
from offspec.engine.request import (
    GenerationRequest,
    RowLimits,
    check_max_new_tokens,
    check_messages,
    check_request,
    check_text,
)
from offspec.errors import InputError
from offspec.jobs.prompt_files import read_prompt_file

LIMITS = RowLimits(context=64, max_tree_budget=16, capacity=48)


@pytest.mark.parametrize("prompt,where,message", [
    ("  \n", None, "the prompt is empty$"),
    ("", "p.txt", r"the prompt is empty \(p.txt\)"),
    ([], None, "messages must be a non-empty list"),
    ([{"role": "user"}], None, "messages must be a non-empty list"),
    (7, None, "a prompt is text or a list of chat messages, not int"),
])
def test_check_text_refuses(prompt, where, message):
    with pytest.raises(InputError, match=message):
        check_text(prompt, where)


def test_check_text_takes_text_and_messages():
    check_text("hi")
    check_text([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("value", [0, -1, True, 2.0, None])
def test_check_max_new_tokens(value):
    with pytest.raises(InputError, match=f"--max-new-tokens must be a whole number >= 1, not {value!r}"):
        check_max_new_tokens(value, "--max-new-tokens")
    with pytest.raises(InputError, match="max_new_tokens must be a whole number >= 1"):
        GenerationRequest(prompt_ids=(1, 2), max_new_tokens=value)


@pytest.mark.parametrize("request_,speculative,row_tokens,message", [
    (GenerationRequest(prompt_ids=()), False, 2, "the prompt is empty"),
    (GenerationRequest(prompt_ids=(1,), tree=TreeConfig(budget=17)), True, 20,
     r"a tree budget of 17 is more than the engine was planned for \(16\)"),
    (GenerationRequest(prompt_ids=(1,) * 63), False, 70, "the prompt has 63 tokens but the context holds only 64"),
    (GenerationRequest(prompt_ids=(1,) * 10), False, 60, "the request needs 60 tokens a row but this batch's rows hold 48"),
])
def test_check_request_refuses(request_, speculative, row_tokens, message):
    with pytest.raises(InputError, match=message):
        check_request(request_, LIMITS, speculative=speculative, row_tokens=row_tokens)


def test_a_budget_above_the_plan_is_fine_without_speculation():
    request = GenerationRequest(prompt_ids=(1,), tree=TreeConfig(budget=17))
    check_request(request, LIMITS, speculative=False, row_tokens=10)


def test_every_way_in_says_the_same(tmp_path):
    """encode_prompt (the library) and a prompt file's line refuse an empty prompt in the same words."""
    with pytest.raises(InputError, match="^the prompt is empty$"):
        encode_prompt(None, " ")             # refused before the tokenizer is touched
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(json.dumps(line) for line in [
        {"id": "a", "prompt": " "},
        {"id": "b", "messages": []},
        {"id": "c", "prompt": "x", "max_new_tokens": 0},
        {"custom_id": "d", "body": {"messages": "hi"}},
        {"id": "e", "prompt": "fine"},
    ]))
    items, bad = read_prompt_file(f)
    assert [i.id for i in items] == ["e"]
    assert [b.reason for b in bad] == [
        "the prompt is empty",
        "messages must be a non-empty list of {role, content} objects",
        "max_new_tokens must be a whole number >= 1, not 0",
        "body.messages must be a non-empty list of {role, content} objects",
    ]
    with pytest.raises(InputError, match="body.messages"):
        check_messages("hi", "body.messages")
