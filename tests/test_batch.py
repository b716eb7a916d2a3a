"""Prompt files and the resumable result file (no models needed)."""
import json

import pytest

from offspec.batch import ResultFile, read_prompt_file
from offspec.errors import InputError


def test_txt_one_prompt_per_line(tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("first\n\nsecond\n")
    items, bad = read_prompt_file(f)
    assert [(i.id, i.prompt, i.line) for i in items] == [("line-1", "first", 1), ("line-3", "second", 3)]
    assert bad == []


def test_jsonl_prompts_messages_and_bad_lines(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join([
        json.dumps({"id": "a", "prompt": "hello", "max_new_tokens": 5}),
        json.dumps({"id": "b", "messages": [{"role": "user", "content": "hi"}]}),
        "{not json",
        json.dumps({"id": "c"}),
        json.dumps({"id": "a", "prompt": "dup"}),
        json.dumps({"id": "d", "prompt": "x", "max_new_tokens": -1}),
        json.dumps(["list"]),
    ]))
    items, bad = read_prompt_file(f)
    assert [i.id for i in items] == ["a", "b"]
    assert items[0].max_new_tokens == 5 and isinstance(items[1].prompt, list)
    assert [b.line for b in bad] == [3, 4, 5, 6, 7]
    assert "line 3: not valid JSON" in str(bad[0])


@pytest.mark.parametrize("content,name", [("", "empty.txt"), ("x", "p.csv")])
def test_unusable_prompt_files(tmp_path, content, name):
    f = tmp_path / name
    f.write_text(content)
    with pytest.raises(InputError):
        read_prompt_file(f)


def test_missing_prompt_file(tmp_path):
    with pytest.raises(InputError, match="cannot read"):
        read_prompt_file(tmp_path / "nope.txt")


def test_result_file_resume_and_torn_line(tmp_path):
    out = tmp_path / "out.jsonl"
    r = ResultFile(out)
    r.append({"id": "a", "text": "x"})
    r.append({"id": "b", "text": "y"})
    r.close()
    with open(out, "ab") as f:          # a kill in the middle of a write
        f.write(b'{"id": "c", "te')
    r = ResultFile(out)
    assert r.done == {"a", "b"}
    r.append({"id": "c", "text": "z"})
    r.close()
    lines = out.read_text().splitlines()
    assert [json.loads(l)["id"] for l in lines] == ["a", "b", "c"]


def test_openai_batch_format(tmp_path):
    """Lines of the OpenAI batch format (as vLLM's run-batch reads them) beside offspec's own; results keep custom_id."""
    from types import SimpleNamespace

    from offspec.batch import result_record
    f = tmp_path / "p.jsonl"
    line = {"custom_id": "req-1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "x", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 7}}
    f.write_text("\n".join([
        json.dumps(line),
        json.dumps({**line, "custom_id": "req-2", "body": {**line["body"], "max_tokens": None,
                                                            "max_completion_tokens": 9}}),
        json.dumps({**line, "custom_id": "req-3", "body": {"messages": []}}),
        json.dumps({**line, "custom_id": 4}),
        json.dumps({"custom_id": "req-5"}),
        json.dumps({"id": "own", "prompt": "plain"}),
    ]))
    items, bad = read_prompt_file(f)
    assert [(i.id, i.max_new_tokens, i.openai) for i in items] == [("req-1", 7, True), ("req-2", 9, True),
                                                                    ("own", None, False)]
    assert items[0].prompt == [{"role": "user", "content": "hi"}]
    assert [b.line for b in bad] == [3, 4, 5] and "body.messages" in bad[0].reason
    report = SimpleNamespace(text="t", tokens=[1], seconds_per_token=0.1, tokens_per_pass=1.0, passes=1,
                             prompt_tokens=3, finish_reason="eos")
    assert result_record(items[0], report)["custom_id"] == "req-1"
    assert "custom_id" not in result_record(items[2], report)
