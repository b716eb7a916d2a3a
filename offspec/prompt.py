"""Prompts -> token ids: the chat template for chat models, stop tokens from the tokenizer (never literals)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

from .errors import InputError

Messages = list[dict]


def encode_prompt(tokenizer, prompt: Union[str, Messages], raw: bool = False) -> list[int]:
    """Text or chat messages -> ids. Chat models get their template (with the assistant turn opened)
    unless `raw`; raw text and models without a template are tokenized as is."""
    if isinstance(prompt, str) and not prompt.strip():
        raise InputError("the prompt is empty")
    if not raw and getattr(tokenizer, "chat_template", None):
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        if hasattr(ids, "keys"):          # some tokenizers return a BatchEncoding
            ids = ids["input_ids"]
        return list(ids)
    if not isinstance(prompt, str):
        if raw:
            raise InputError("--raw needs a plain text prompt, not chat messages")
        raise InputError("chat messages given but the tokenizer has no chat template")
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])


def stop_token_ids(tokenizer, generation_eos: Optional[Union[int, Sequence[int]]] = None) -> list[int]:
    """Every id that ends a turn: the tokenizer's EOS, the model's generation_config eos ids, and chat end
    tokens the tokenizer knows (e.g. <|im_end|>, <|eot_id|>, <|end|>)."""
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if generation_eos is not None:
        ids.update(int(i) for i in ([generation_eos] if isinstance(generation_eos, int) else generation_eos))
    vocab = tokenizer.get_vocab()
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<|endoftext|>", "</s>"):
        if name in vocab and name in tokenizer.all_special_tokens:
            ids.add(int(vocab[name]))
    return sorted(ids)


class IncrementalText:
    """Turns a growing list of token ids into text deltas that are safe to print: a trailing partial
    UTF-8 character, or a tail that might still become a stop string, is held back until resolved."""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.printed = 0

    def text(self, tokens: list[int]) -> str:
        """The full text of `tokens`, cut before the earliest stop string."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stop_strings if s in text]
        return text[: min(cuts)] if cuts else text

    def delta(self, tokens: list[int], final: bool) -> str:
        text = self.text(tokens)
        end = len(text)
        if not final:
            end -= self.hold
            while end > 0 and text[end - 1] == "\ufffd":
                end -= 1
        if end <= self.printed:
            return ""
        out, self.printed = text[self.printed: end], end
        return out
