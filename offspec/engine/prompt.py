"""Prompts -> token ids: the chat template for chat models, stop tokens from the tokenizer (never literals)."""
from __future__ import annotations

from typing import Optional, Sequence, Union

from offspec.engine.request import check_text
from offspec.errors import InputError

Messages = list[dict]


def encode_prompt(tokenizer, prompt: Union[str, Messages], raw: bool = False) -> list[int]:
    """Text or chat messages -> ids. Chat models get their template (with the assistant turn opened)
    unless `raw`; raw text and models without a template are tokenized as is."""
    check_text(prompt)
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
    """Turns a growing list of token ids into text deltas that are safe to print: a trailing partial UTF-8
    character, or a tail that might still become a stop string, is held back until resolved.

    Each delta() decodes only the tokens since the last settled boundary, together with the few tokens before it
    (so a tokenizer that drops a leading space at the start of a decode drops it on both sides of the
    difference): time proportional to the new tokens, not to the text. Settled: the decode of the tokens so far
    does not end inside a character (no trailing U+FFFD).

    Example: tokens [A, B] decoded "ab" and settled; C arrives: decode([A, B, C]) - decode([A, B]) is C's text.
    (A settled boundary moves the window's start to the previous boundary, so the window stays short.)"""

    def __init__(self, tokenizer, stop_strings: Sequence[str] = ()):
        self.tokenizer = tokenizer
        self.stop_strings = [s for s in stop_strings if s]
        self.hold = max((len(s) for s in self.stop_strings), default=1) - 1
        self.settled = ""       # the text of tokens[:read]
        self.start = 0          # tokens[start:read] are decoded again with the new ones, for context
        self.read = 0           # tokens whose text is in `settled`
        self.searched = 0       # characters of `settled` already searched for stop strings (ends excluded)
        self.cut: Optional[int] = None   # where the earliest stop string found begins
        self.printed = 0        # characters handed out by delta()

    def text(self, tokens: list[int]) -> str:
        """The full text of `tokens`, cut before the earliest stop string (one decode of them all)."""
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        cuts = [text.find(s) for s in self.stop_strings if s in text]
        return text[: min(cuts)] if cuts else text

    def delta(self, tokens: list[int], final: bool) -> str:
        """The text `tokens` (the whole list so far, grown since the last call) adds to what was handed out;
        final: the last call, which hands out everything, a partial character included."""
        tail = self._advance(tokens, final)
        end = len(self.settled) + len(tail)
        if self.cut is not None:
            end = min(end, self.cut)
        elif not final:
            end -= len(tail) + self.hold
        if end <= self.printed:
            return ""
        out = (self.settled + tail)[self.printed: end]
        self.printed = end
        return out

    def _advance(self, tokens: list[int], final: bool) -> str:
        """Settle what the new tokens decode to; -> the text of the tokens not settled (a partial character),
        which only a final call hands out."""
        decode = lambda ids: self.tokenizer.decode(ids, skip_special_tokens=True)   # noqa: E731
        tail = ""
        if len(tokens) > self.read:
            before = decode(tokens[self.start: self.read])
            after = decode(tokens[self.start:])
            new = after[len(before):] if after.startswith(before) else None
            if new is not None and not after.endswith("\ufffd"):
                self.settled += new
                self.start, self.read = self.read, len(tokens)
            elif new is None:       # the context changed the earlier text: settle from scratch (rare)
                self.settled, self.start, self.read = decode(tokens), len(tokens), len(tokens)
                self.searched = 0
            elif final:
                tail = new
        self._find_stops(tail)
        return tail

    def _find_stops(self, tail: str) -> None:
        """Look for stop strings in the text not searched yet (and the longest stop string's length before it)."""
        if not self.stop_strings or self.cut is not None:
            return
        text = self.settled + tail
        longest = max(len(s) for s in self.stop_strings)
        lo = max(0, self.searched - longest + 1)
        found = [lo + text[lo:].find(s) for s in self.stop_strings if s in text[lo:]]
        if found:
            self.cut = min(found)
        self.searched = len(text)
