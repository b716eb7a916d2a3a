"""An OpenAI request body -> the engine's GenerationRequest, or an ApiError naming the field.

Every field that would change the output is honoured or refused in one line, never ignored (NEUTRAL: refused
unless unset or sent as the value that changes nothing; `n`, `min_tokens`); a client's defaults are met where offspec can honour them: a `max_tokens` over the
server's cap is clamped to it (the answer ends with `length`), as llama.cpp's server does, and a stop list may be
long (MAX_STOP strings of at most MAX_STOP_CHARS characters each, which bound the engine's per-token check).
"""
from __future__ import annotations

import secrets
from dataclasses import dataclass, replace
from typing import Optional

from offspec.config import SamplingConfig, TreeConfig
from offspec.engine.request import GenerationRequest, check_messages
from offspec.errors import InputError

MAX_STOP = 64                     # stop strings a request may give
MAX_STOP_CHARS = 256              # characters a stop string may have
# Fields that would change the output in a way offspec does not implement: refused, not ignored, unless a client
# sends the value that changes nothing (many send their defaults: repetition_penalty 1, min_p 0, ...).
NEUTRAL = {
    "logprobs": (False,), "top_logprobs": (0,), "logit_bias": ({},), "tools": ([],), "tool_choice": ("none",),
    "functions": ([],), "function_call": ("none",), "best_of": (1,), "echo": (False,), "suffix": ("",),
    "min_p": (0,), "repetition_penalty": (1,), "repeat_penalty": (1,), "prompt_logprobs": (0,),
    "guided_json": (), "guided_regex": (), "guided_choice": (), "grammar": ("",), "json_schema": (),
    "stop_token_ids": ([],), "length_penalty": (1,), "use_beam_search": (False,), "typical_p": (1,), "tfs_z": (1,),
    "mirostat": (0,), "top_a": (0,), "dry_multiplier": (0,), "xtc_probability": (0,), "n_probs": (0,),
    "presence_penalty": (0,), "frequency_penalty": (0,),
}
UNSUPPORTED = tuple(NEUTRAL)


class ApiError(Exception):
    """An OpenAI-style error answer: status, one-sentence message, type, the offending field."""

    def __init__(self, status: int, message: str, param: Optional[str] = None, kind: str = "invalid_request_error",
                 code: Optional[str] = None, headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.param, self.kind, self.code = status, message, param, kind, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class ServeConfig:
    """What the server was started with."""
    model: str                    # the name /v1/models lists and requests must use
    tree: TreeConfig              # every request's tree (the command's --tree options)
    sampling: SamplingConfig      # defaults a request's own temperature / top_p / top_k / seed replace
    max_tokens: int               # the most new tokens a request gets (a larger max_tokens is clamped), the default
    max_waiting: int              # requests that may wait for a row; one more gets 429
    context: int                  # tokens a request may reach (the engine's): a longer prompt is refused, and
                                  # generation ends there (finish_reason "length")
    api_key: Optional[str] = None
    loopback: bool = True         # listening on this machine's loopback only (then, without a key, only
                                  # loopback Host values are served: guard.py)
    access_log: str = "info"      # the level of the one access line a request (guard.py): info | warning | off


def model_not_found(model) -> ApiError:
    return ApiError(404, f"the model {model!r} does not exist here", "model", code="model_not_found")


def _number(body: dict, name: str, low: float, high: float, default):
    value = body.get(name, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not low <= value <= high:
        raise ApiError(400, f"{name} must be a number from {low:g} to {high:g}, not {value!r}", name)
    return value


def _max_tokens(body: dict, cfg: ServeConfig) -> int:
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    value = body.get(name)
    if value is None:
        return cfg.max_tokens
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ApiError(400, f"{name} must be a positive integer, not {value!r}", name)
    return min(value, cfg.max_tokens)


def _stop(body: dict) -> tuple[str, ...]:
    stop = body.get("stop")
    if stop is None:
        return ()
    stop = [stop] if isinstance(stop, str) else stop
    if (not isinstance(stop, list) or len(stop) > MAX_STOP
            or not all(isinstance(s, str) and 0 < len(s) <= MAX_STOP_CHARS for s in stop)):
        raise ApiError(400, f"stop must be a string or a list of at most {MAX_STOP}, each of 1 to {MAX_STOP_CHARS} "
                       f"characters", "stop")
    return tuple(stop)


def _top_k(body: dict, cfg: ServeConfig) -> int:
    value = body.get("top_k")
    if value is None:
        return cfg.sampling.top_k
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ApiError(400, f"top_k must be an integer, 0 or -1 for none, not {value!r}", "top_k")
    return max(value, 0)


def _same(value, neutral) -> bool:
    """value is `neutral` (true and false only as themselves; 1 and 1.0 alike)."""
    if isinstance(value, bool) or isinstance(neutral, bool):
        return value is neutral
    if isinstance(value, (int, float)) and isinstance(neutral, (int, float)):
        return value == neutral
    return type(value) is type(neutral) and value == neutral


def _check_supported(body: dict) -> None:
    if body.get("n") not in (None, 1):
        raise ApiError(400, f"n must be 1: offspec returns one choice a request (asked for {body.get('n')!r})", "n")
    for name, neutral in NEUTRAL.items():
        value = body.get(name)
        if value is not None and not any(_same(value, n) for n in neutral):
            raise ApiError(400, f"{name} is not supported by offspec (it would change the output); send it "
                           f"unset" + (f" or as {neutral[0]!r}" if neutral else ""), name)
    if body.get("min_tokens") not in (None, 0):
        raise ApiError(400, "min_tokens is not supported by offspec (it would change where the answer ends)",
                       "min_tokens")
    if not isinstance(body.get("ignore_eos", False), bool):
        raise ApiError(400, "ignore_eos must be true or false", "ignore_eos")
    fmt = body.get("response_format")
    if fmt not in (None, {"type": "text"}):
        raise ApiError(400, "response_format other than text is not supported by offspec", "response_format")
    stream_options = body.get("stream_options")
    if stream_options is not None and not isinstance(stream_options, dict):
        raise ApiError(400, "stream_options must be an object", "stream_options")


def _messages(body: dict) -> list[dict]:
    """OpenAI messages -> [{role, content}] with text content (a list of text parts is joined)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ApiError(400, "messages must be a non-empty list of {role, content} objects", "messages")
    out = []
    for m in messages:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list):
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ApiError(400, "message content parts must be text ({type: text, text}); offspec reads text",
                               "messages")
            content = "".join(p["text"] for p in content)
        out.append({"role": m.get("role") if isinstance(m, dict) else None, "content": content})
    try:
        check_messages(out)
    except InputError as e:
        raise ApiError(400, str(e), "messages") from None
    return out


def _prompt(body: dict, chat: bool):
    if chat:
        return _messages(body)
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if not isinstance(prompt, str) or not prompt:
        raise ApiError(400, "prompt must be a non-empty string", "prompt")
    return prompt


def _sampling(body: dict, cfg: ServeConfig) -> SamplingConfig:
    sampling = SamplingConfig(temperature=_number(body, "temperature", 0, 2, cfg.sampling.temperature),
                              top_p=_number(body, "top_p", 0, 1, cfg.sampling.top_p), top_k=_top_k(body, cfg),
                              seed=cfg.sampling.seed)
    if sampling.top_p <= 0:
        raise ApiError(400, "top_p must be above 0", "top_p")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise ApiError(400, f"seed must be an integer, not {seed!r}", "seed")
    # No seed: a fresh one, as OpenAI draws (the same sampled request twice gives two answers).
    return replace(sampling, seed=secrets.randbits(63) if seed is None else seed % 2**63)


def parse_request(body: dict, cfg: ServeConfig, tokenizer, chat: bool) -> tuple[GenerationRequest, bool]:
    """An OpenAI request body -> (the engine's request, stream?), or ApiError naming the field. (stream_options is
    checked and otherwise not needed: the last chunk always carries usage.)"""
    from offspec.engine.prompt import encode_prompt

    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    if body.get("model") != cfg.model:
        raise model_not_found(body.get("model"))
    _check_supported(body)
    prompt, sampling = _prompt(body, chat), _sampling(body, cfg)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise ApiError(400, "stream must be true or false", "stream")
    field = "messages" if chat else "prompt"
    max_tokens, stop = _max_tokens(body, cfg), _stop(body)
    try:
        ids = encode_prompt(tokenizer, prompt, raw=not chat)
    except Exception as e:       # InputError, or the chat template's own refusal (roles must alternate, ...)
        raise ApiError(400, f"{field} cannot be encoded: {(str(e).splitlines() or [type(e).__name__])[0]}",
                       field) from None
    if len(ids) + 1 >= cfg.context:
        raise ApiError(400, f"the prompt is {len(ids)} tokens; this server's context holds {cfg.context} (prompt and "
                       f"new tokens together)", field, code="context_length_exceeded")
    request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=min(max_tokens, cfg.context - len(ids) - 1),
                                stop_strings=stop, tree=cfg.tree, sampling=sampling,
                                ignore_eos=body.get("ignore_eos", False))
    return request, stream
