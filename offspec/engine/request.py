"""What a generation request is, and every check a request passes, each written once.

Where each check is called (the input is checked where it enters, before any model is loaded when it can be):
  check_text            a prompt's text or chat messages: the CLI's prompt (cli.read_prompt), each line of a
                        prompt file (batch.read_prompt_file), and the library's encode_prompt (prompt.py)
  check_max_new_tokens  the CLI's --max-new-tokens, a prompt file's per-line override, GenerationRequest itself
  check_request         a tokenized request against the engine that runs it: Engine._admit, which every route
                        reaches (Engine.generate, run_batch, `offspec batch`, Ray workers through run_prompts)
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from offspec.config import SamplingConfig, TreeConfig
from offspec.errors import InputError


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]                 # the tokenized prompt (chat template already applied)
    max_new_tokens: int = 128                   # stop after this many generated tokens
    stop_strings: tuple[str, ...] = ()          # stop when the text contains one (not emitted)
    tree: TreeConfig = TreeConfig()             # growth policy, budget, threshold
    sampling: SamplingConfig = SamplingConfig()  # temperature, top-p, top-k, seed
    ignore_eos: bool = False                    # benchmarks: always generate max_new_tokens

    def __post_init__(self):
        check_max_new_tokens(self.max_new_tokens)


@dataclass(frozen=True)
class RowLimits:
    """What one request's cache row on an engine may hold (Engine._admit fills it in)."""
    context: int            # the engine's context: prompt + generated tokens stay below it (Engine.max_context)
    max_tree_budget: int    # the largest tree the engine was planned for
    capacity: int           # cache slots each row of the running batch holds (run_batch sized them)


def check_text(prompt: Union[str, list], where: Optional[str] = None) -> None:
    """A prompt before tokenizing: text with something besides white space, or chat messages (a non-empty list
    of {"role": str, "content": str}). where: the file it came from, named in the message."""
    if isinstance(prompt, str):
        if not prompt.strip():
            raise InputError(f"the prompt is empty{f' ({where})' if where else ''}")
    elif isinstance(prompt, list):
        check_messages(prompt)
    else:
        raise InputError(f"a prompt is text or a list of chat messages, not {type(prompt).__name__}")


def check_messages(messages, name: str = "messages") -> None:
    """Chat messages: a non-empty list of {"role": str, "content": str}. name: what the message calls them."""
    if not isinstance(messages, list) or not messages or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
            for m in messages):
        raise InputError(f"{name} must be a non-empty list of {{role, content}} objects")


def check_max_new_tokens(value, name: str = "max_new_tokens") -> None:
    """A whole number >= 1 (not a bool). name: the option or field the message names."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise InputError(f"{name} must be a whole number >= 1, not {value!r}")


def check_request(request: GenerationRequest, limits: RowLimits, *, speculative: bool, row_tokens: int) -> None:
    """A tokenized request against the engine about to run it. speculative: the request grows trees there
    (Engine.speculative); row_tokens: the cache slots a row of it may need, its prompt, new tokens and one
    round's tree with its root (Engine._row_tokens)."""
    n_prompt = len(request.prompt_ids)
    if n_prompt == 0:
        raise InputError("the prompt is empty")
    budget = request.tree.budget
    if speculative and budget is not None and budget > limits.max_tree_budget:
        raise InputError(f"a tree budget of {budget} is more than the engine was planned for "
                         f"({limits.max_tree_budget}); load it with a larger tree budget")
    if n_prompt + 1 >= limits.context:
        raise InputError(f"the prompt has {n_prompt} tokens but the context holds only {limits.context}")
    needed = min(row_tokens, limits.context)
    if needed > limits.capacity:   # an open feed's tokens_a_row was too small for this request
        raise InputError(f"the request needs {needed} tokens a row but this batch's rows hold {limits.capacity}")
