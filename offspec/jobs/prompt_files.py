"""Prompt files in (.txt / .jsonl), one JSON line per prompt out: resumable, and safe to interrupt.

Each finished prompt is appended to OUT as one complete line with a single write, flushed and fsynced, so
Ctrl-C or a kill loses no finished line; a torn last line (a kill inside the write) is cut away on the next
run. Rerunning skips ids already in OUT.

This module holds the two file formats only: the prompt file (PromptItem, read_prompt_file) and the result file
(ResultFile, result_record). Running the prompts is jobs.py's (one process) and cluster.py's (Ray workers).
"""
from __future__ import annotations

import json
import os
import time
import uuid
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Optional, Union

from offspec.engine.request import check_max_new_tokens, check_messages, check_text
from offspec.errors import InputError


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a prompt file. The overrides (None: the command's option) come from OpenAI batch lines."""
    id: str                                   # unique within the file; the resume key
    prompt: Union[str, list]                  # text, or chat messages [{"role", "content"}]
    max_new_tokens: Optional[int]             # per-prompt override
    line: int                                 # 1-based line number in the prompt file
    openai: bool = False                      # an OpenAI batch line: the id is its custom_id, results in its shape
    temperature: Optional[float] = None       # per-prompt override of --temperature
    top_p: Optional[float] = None             # per-prompt override of --top-p
    seed: Optional[int] = None                # per-prompt override of --seed
    stop: Optional[tuple[str, ...]] = None    # per-prompt stop strings, in place of --stop
    model: Optional[str] = None               # an OpenAI line's body.model, echoed in its result

    def sampling(self, default):
        """`default` (the command's config.SamplingConfig) with this prompt's overrides."""
        given = {"temperature": self.temperature, "top_p": self.top_p, "seed": self.seed}
        return replace(default, **{k: v for k, v in given.items() if v is not None})

    def stop_strings(self, default: tuple[str, ...]) -> tuple[str, ...]:
        return self.stop if self.stop is not None else tuple(default)


@dataclass(frozen=True)
class BadLine:
    line: int
    reason: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.reason}"


def read_prompt_file(path: str | Path) -> tuple[list[PromptItem], list[BadLine]]:
    """Parse a .txt (one prompt per line) or .jsonl file; malformed lines come back separately."""
    path = Path(path)
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise InputError(f"cannot read prompt file {path}: {e}") from None
    suffix = path.suffix.lower()
    if suffix not in (".txt", ".jsonl"):
        raise InputError(f"{path}: unknown prompt file type {suffix!r}; use .txt (one prompt per line) or .jsonl")
    items, bad, seen = [], [], set()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        if suffix == ".txt":
            item = PromptItem(id=f"line-{number}", prompt=line, max_new_tokens=None, line=number)
        else:
            item = _parse_json_line(line, number, bad)
            if item is None:
                continue
        if item.id in seen:
            bad.append(BadLine(number, f"duplicate id {item.id!r}"))
            continue
        seen.add(item.id)
        items.append(item)
    if not items and not bad:
        raise InputError(f"{path}: no prompts in the file")
    return items, bad


def _parse_json_line(line: str, number: int, bad: list) -> Optional[PromptItem]:
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        bad.append(BadLine(number, f"not valid JSON ({e.msg})"))
        return None
    if not isinstance(obj, dict):
        bad.append(BadLine(number, "expected a JSON object"))
        return None
    if "custom_id" in obj:
        return _parse_openai_line(obj, number, bad)
    item_id = obj.get("id", f"line-{number}")
    if not isinstance(item_id, (str, int)) or isinstance(item_id, bool):
        bad.append(BadLine(number, "id must be a string or an integer"))
        return None
    prompt = obj.get("prompt", obj.get("messages"))
    if "prompt" in obj and "messages" in obj:
        bad.append(BadLine(number, "give either prompt or messages, not both"))
        return None
    if prompt is None:
        bad.append(BadLine(number, "needs a 'prompt' string or a 'messages' list"))
        return None
    max_new = obj.get("max_new_tokens")
    try:
        check_text(prompt)
        if max_new is not None:
            check_max_new_tokens(max_new)
    except InputError as e:
        bad.append(BadLine(number, str(e)))
        return None
    return PromptItem(id=str(item_id), prompt=prompt, max_new_tokens=max_new, line=number)


# Body fields of an OpenAI chat request that change its output and that offspec cannot honour, each with the
# values that leave the output as offspec makes it; a line giving any other value is refused by the field's name.
UNHONOURED_BODY_FIELDS = {
    "n": (None, 1), "logprobs": (None, False), "top_logprobs": (None, 0),
    "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []), "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}), "logit_bias": (None, {}),
    "presence_penalty": (None, 0), "frequency_penalty": (None, 0),
    "audio": (None,), "modalities": (None, ["text"]), "prediction": (None,),
}


def _parse_openai_line(obj: dict, number: int, bad: list) -> Optional[PromptItem]:
    """A line of the OpenAI batch format, as vLLM's run-batch reads it:
    {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 256}}  (max_completion_tokens also read).
    body.temperature, top_p, seed and stop (a string or a list of them) override the command's options for this
    line; UNHONOURED_BODY_FIELDS are refused; other fields (metadata, user, ...) change nothing and are ignored."""
    custom_id, body = obj.get("custom_id"), obj.get("body")
    if not isinstance(custom_id, str) or not custom_id:
        bad.append(BadLine(number, "custom_id must be a non-empty string"))
        return None
    if not isinstance(body, dict):
        bad.append(BadLine(number, "an OpenAI batch line needs a 'body' object"))
        return None
    messages = body.get("messages")
    max_new = body.get("max_completion_tokens", body.get("max_tokens"))
    try:
        for name, neutral in UNHONOURED_BODY_FIELDS.items():
            if name in body and body[name] not in neutral:
                raise InputError(f"body.{name} = {json.dumps(body[name])[:40]} is not supported by offspec")
        check_messages(messages, "body.messages")
        if max_new is not None:
            check_max_new_tokens(max_new, "body.max_tokens")
        temperature, top_p, seed = body.get("temperature"), body.get("top_p"), body.get("seed")
        if temperature is not None and not (_is_number(temperature) and 0 <= temperature <= 2):
            raise InputError(f"body.temperature must be a number in [0, 2], not {temperature!r}")
        if top_p is not None and not (_is_number(top_p) and 0 < top_p <= 1):
            raise InputError(f"body.top_p must be a number in (0, 1], not {top_p!r}")
        if seed is not None and not (isinstance(seed, int) and not isinstance(seed, bool)):
            raise InputError(f"body.seed must be a whole number, not {seed!r}")
        stop = body.get("stop")
        if isinstance(stop, str):
            stop = [stop]
        if stop is not None and not (isinstance(stop, list) and all(isinstance(s, str) and s for s in stop)):
            raise InputError("body.stop must be a string or a list of non-empty strings")
    except InputError as e:
        bad.append(BadLine(number, str(e)))
        return None
    model = body.get("model")
    return PromptItem(id=custom_id, prompt=messages, max_new_tokens=max_new, line=number, openai=True,
                      temperature=None if temperature is None else float(temperature),
                      top_p=None if top_p is None else float(top_p), seed=seed,
                      stop=None if stop is None else tuple(stop), model=model if isinstance(model, str) else None)


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class ResultFile:
    """Append-only JSONL of finished prompts."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if self.path.exists() and self.path.is_dir():
            raise InputError(f"cannot write {self.path}: it is a folder")
        parent = self.path.expanduser().resolve().parent
        if not parent.is_dir():
            raise InputError(f"cannot write {self.path}: folder {parent} does not exist")
        self.done = self._recover()
        try:
            self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        except OSError as e:
            raise InputError(f"cannot write {self.path}: {e.strerror}") from None

    def _recover(self) -> set[str]:
        """Ids already finished (a line's custom_id where it has one: an OpenAI-shaped line's id is its own, not
        the prompt's); a torn last line (killed mid-write) is truncated away."""
        if not self.path.exists():
            return set()
        try:
            data = self.path.read_bytes()
        except OSError as e:
            raise InputError(f"cannot read {self.path}: {e.strerror}") from None
        done, good_end = set(), 0
        for raw in data.splitlines(keepends=True):
            try:
                if not raw.endswith(b"\n"):
                    raise ValueError("torn line")
                record = json.loads(raw)
                done.add(str(record["custom_id"] if "custom_id" in record else record["id"]))
            except (ValueError, KeyError, TypeError):
                break
            good_end += len(raw)
        if good_end < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(good_end)
        return done

    def append(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode()
        written = os.write(self._fd, line)   # O_APPEND: one write of the whole line
        if written != len(line):
            raise OSError(f"short write to {self.path}")
        os.fsync(self._fd)

    def close(self) -> None:
        os.close(self._fd)


def result_record(item: PromptItem, report) -> dict:
    """A finished prompt's line in the result file (report: its metrics.RunReport): an OpenAI line's in OpenAI's
    batch output shape (openai_record), any other in offspec's own."""
    if item.openai:
        return openai_record(item, report)
    return {
        "id": item.id,
        "text": report.text,
        "tokens": report.tokens,
        "seconds_per_token": report.seconds_per_token,
        "tokens_per_pass": report.tokens_per_pass,
        "passes": report.passes,
        "prompt_tokens": report.prompt_tokens,
        "finish_reason": report.finish_reason,
    }


# offspec's finish reasons -> OpenAI's: the turn ended (EOS or a stop string), or a token limit was reached
# (max_tokens, or the model's context).
OPENAI_FINISH = {"eos": "stop", "stop": "stop", "length": "length", "context": "length"}


def openai_record(item: PromptItem, report) -> dict:
    """A finished OpenAI batch line's result, in OpenAI's batch output shape: {"id", "custom_id", "response":
    {"status_code": 200, "request_id", "body": a chat.completion}, "error": null}. The ids are fresh ones (as
    OpenAI's are); custom_id is the resume key."""
    request_id = uuid.uuid4().hex
    body = {
        "id": f"chatcmpl-{request_id}",
        "object": "chat.completion",
        "created": int(time.time()),
        "model": item.model,
        "choices": [{"index": 0, "message": {"role": "assistant", "content": report.text},
                     "finish_reason": OPENAI_FINISH.get(report.finish_reason, report.finish_reason)}],
        "usage": {"prompt_tokens": report.prompt_tokens, "completion_tokens": report.new_tokens,
                  "total_tokens": report.prompt_tokens + report.new_tokens},
    }
    return {"id": f"batch_req_{request_id}", "custom_id": item.id,
            "response": {"status_code": 200, "request_id": request_id, "body": body}, "error": None}
