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
