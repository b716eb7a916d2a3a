"""Prompt files and the resumable result file (no models needed)."""
import json

import pytest

from offspec.errors import InputError
from offspec.jobs.prompt_files import ResultFile, read_prompt_file


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

    from offspec.jobs.prompt_files import result_record
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
    report = SimpleNamespace(text="t", tokens=[1], new_tokens=1, seconds_per_token=0.1, tokens_per_pass=1.0,
                             passes=1, prompt_tokens=3, finish_reason="eos")
    record = result_record(items[0], report)
    assert set(record) == {"id", "custom_id", "response", "error"} and record["error"] is None
    assert record["custom_id"] == "req-1" and record["id"].startswith("batch_req_")
    response = record["response"]
    assert response["status_code"] == 200 and isinstance(response["request_id"], str)
    body = response["body"]
    assert body["object"] == "chat.completion" and body["model"] == "x" and isinstance(body["created"], int)
    assert body["choices"] == [{"index": 0, "message": {"role": "assistant", "content": "t"}, "finish_reason": "stop"}]
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
    plain = result_record(items[2], report)
    assert "custom_id" not in plain and plain["id"] == "own" and plain["text"] == "t"


def test_openai_body_fields_honoured_or_refused_by_name(tmp_path):
    """temperature, top_p, seed and stop override the command's options for their line; fields that would change
    the output and that offspec cannot honour are refused by name; their neutral values pass."""
    from offspec.config import SamplingConfig
    messages = [{"role": "user", "content": "hi"}]

    def line(**body):
        return json.dumps({"custom_id": f"r{len(lines)}", "body": {"messages": messages, **body}})
    lines = []
    for body in [dict(temperature=0.7, top_p=0.9, seed=5, stop="END"), dict(stop=["a", "b"]), dict(),
                 dict(n=1, logprobs=False, response_format={"type": "text"}, presence_penalty=0, metadata={"k": 1}),
                 dict(n=2), dict(logprobs=True), dict(tools=[{"type": "function"}]),
                 dict(response_format={"type": "json_object"}), dict(temperature=3), dict(top_p=0),
                 dict(seed=1.5), dict(stop=[1]), dict(temperature=True)]:
        lines.append(line(**body))
    f = tmp_path / "p.jsonl"
    f.write_text("\n".join(lines))
    items, bad = read_prompt_file(f)
    assert [i.id for i in items] == ["r0", "r1", "r2", "r3"]
    default = SamplingConfig(temperature=0.0, top_p=1.0, top_k=4, seed=0)
    assert items[0].sampling(default) == SamplingConfig(temperature=0.7, top_p=0.9, top_k=4, seed=5)
    assert items[0].stop_strings(("X",)) == ("END",) and items[1].stop_strings(("X",)) == ("a", "b")
    assert items[2].sampling(default) == default and items[2].stop_strings(("X",)) == ("X",)
    reasons = [b.reason for b in bad]
    for name, reason in zip(["body.n", "body.logprobs", "body.tools", "body.response_format"], reasons):
        assert reason.startswith(name) and "not supported" in reason
    for name, reason in zip(["body.temperature", "body.top_p", "body.seed", "body.stop", "body.temperature"],
                            reasons[4:]):
        assert reason.startswith(name)
    assert len(bad) == 9


def test_resume_reads_custom_id_of_openai_shaped_lines(tmp_path):
    out = tmp_path / "out.jsonl"
    r = ResultFile(out)
    r.append({"id": "batch_req_1", "custom_id": "req-1", "response": {}, "error": None})
    r.append({"id": "plain"})
    r.close()
    assert ResultFile(out).done == {"req-1", "plain"}


def test_job_report_counts_a_shared_pass_once():
    """Two rows shared a pass (each Step carries the whole pass), a third ran a pass alone: 2 passes, and the
    per-pass costs are those two passes' means."""
    from offspec.engine.metrics import JobReport, Step
    from offspec.jobs.cluster import WorkerReport

    def step(rows, draft, target, wait, moved, nbytes):
        return Step(tokens=[1], accepted=1, tree_size=1, tree_depth=1, pass_tokens=2, draft_seconds=draft,
                    target_seconds=target, wait_seconds=wait, transfer_seconds=moved, bytes_streamed=nbytes,
                    rows_in_pass=rows)
    job = JobReport(concurrency=2)
    for s in [*[step(2, 1.0, 0.8, 0.2, 0.5, 2e9)] * 2, step(1, 0.6, 0.4, 0.0, 1.5, 2e9)]:
        job.add(s)
    d = job.to_dict()
    assert d["passes"] == 2 and d["rows_per_pass"] == pytest.approx(1.5)
    assert {k: d[k] for k in ("draft_seconds_per_pass", "target_seconds_per_pass", "wait_seconds_per_pass",
                              "stream_gb_per_second")} == pytest.approx(
        {"draft_seconds_per_pass": 0.8, "target_seconds_per_pass": 0.6, "wait_seconds_per_pass": 0.1,
         "stream_gb_per_second": 2.0})
    assert job.pass_line() == ("a pass: draft 0.80 s, target 0.60 s (0.10 s of it waiting for weights streamed at "
                               "2.00 GB/s)")
    assert d["peak_device_gb"] is None                                  # no device here, no workers
    workers = [WorkerReport("worker 0", peak_device_gb=3.5), WorkerReport("worker 1", peak_device_gb=None),
               WorkerReport("worker 2", peak_device_gb=4.25)]
    assert JobReport(concurrency=2, workers=workers).to_dict()["peak_device_gb"] == 4.25   # the largest worker's
    assert JobReport(concurrency=2, device="cpu").to_dict()["peak_device_gb"] is None
