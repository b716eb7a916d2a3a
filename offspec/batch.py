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
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

from .errors import InputError
from .request import check_max_new_tokens, check_messages, check_text


@dataclass(frozen=True)
class PromptItem:
    id: str                                   # unique within the file; the resume key
    prompt: Union[str, list]                  # text, or chat messages [{"role", "content"}]
    max_new_tokens: Optional[int]             # per-prompt override
    line: int                                 # 1-based line number in the prompt file
    openai: bool = False                      # an OpenAI batch line: the id is its custom_id, and results say so


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


def _parse_openai_line(obj: dict, number: int, bad: list) -> Optional[PromptItem]:
    """A line of the OpenAI batch format, as vLLM's run-batch reads it:
    {"custom_id": "...", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": "...", "messages": [...], "max_tokens": 256}}  (max_completion_tokens also read)."""
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
        check_messages(messages, "body.messages")
        if max_new is not None:
            check_max_new_tokens(max_new, "body.max_tokens")
    except InputError as e:
        bad.append(BadLine(number, str(e)))
        return None
    return PromptItem(id=custom_id, prompt=messages, max_new_tokens=max_new, line=number, openai=True)


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
        """Ids already finished; a torn last line (killed mid-write) is truncated away."""
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
                done.add(str(json.loads(raw)["id"]))
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
    """A finished prompt's line in the result file (report: its metrics.RunReport); OpenAI lines keep custom_id."""
    return {
        **({"custom_id": item.id} if item.openai else {}),
        "id": item.id,
        "text": report.text,
        "tokens": report.tokens,
        "seconds_per_token": report.seconds_per_token,
        "tokens_per_pass": report.tokens_per_pass,
        "passes": report.passes,
        "prompt_tokens": report.prompt_tokens,
        "finish_reason": report.finish_reason,
    }
