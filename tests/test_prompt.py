"""Streaming text: IncrementalText hands out exactly the final text, never a partial character or a possible stop
string early, and decodes each token a bounded number of times (time proportional to the new tokens)."""
import random

import pytest

from offspec.engine.prompt import IncrementalText

TEXT = ("Prime numbers: 2, 3, 5, 7. Café au lait, naïve résumé. 中文字符测试, 日本語のテキスト. "
        "Emoji 🙂🚀 and math ∑∫√. def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, n))\n")


@pytest.fixture(scope="module")
def byte_tokenizer():
    """A byte-level BPE (GPT-2 / Qwen style) with a small vocabulary, so multi-byte characters span tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([TEXT] * 4, trainers.BpeTrainer(vocab_size=300, show_progress=False,
                                                            initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=tok)


def stream(tokenizer, tokens, stop_strings=(), seed=0):
    """Feed `tokens` in blocks of 1-5 (as passes accept them): -> the deltas handed out."""
    rng, text, out, at = random.Random(seed), IncrementalText(tokenizer, stop_strings), [], 0
    while at < len(tokens):
        at = min(len(tokens), at + rng.randint(1, 5))
        out.append(text.delta(tokens[:at], final=at == len(tokens)))
    return out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_deltas_add_up_to_the_text_and_hold_back_partial_characters(byte_tokenizer, seed):
    tokens = byte_tokenizer(TEXT * 3)["input_ids"]
    assert any("\ufffd" in byte_tokenizer.decode(tokens[:i]) for i in range(len(tokens)))   # partial chars occur
    deltas = stream(byte_tokenizer, tokens, seed=seed)
    assert "".join(deltas) == byte_tokenizer.decode(tokens)
    assert not any("\ufffd" in d for d in deltas)


@pytest.mark.parametrize("stop", ["résumé", "中文", "🚀", "\n    return"])
def test_nothing_from_a_stop_string_on_is_handed_out(byte_tokenizer, stop):
    tokens = byte_tokenizer(TEXT * 2)["input_ids"]
    text = IncrementalText(byte_tokenizer, [stop, "never there"]).text(tokens)
    assert text == TEXT[: TEXT.index(stop)]
    for seed in range(3):
        deltas = stream(byte_tokenizer, tokens, [stop, "never there"], seed)
        assert "".join(deltas) == text


def test_each_token_is_decoded_a_bounded_number_of_times(byte_tokenizer):
    """One token at a time over ~2,000 tokens: a whole-text decode per token would decode ~2,000,000 ids."""
    decoded = []

    class Counting:
        def decode(self, ids, skip_special_tokens=True):
            decoded.append(len(ids))
            return byte_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    tokens = byte_tokenizer(TEXT * 12)["input_ids"]
    text = IncrementalText(Counting(), ["never there"])
    out = "".join(text.delta(tokens[:i], final=i == len(tokens)) for i in range(1, len(tokens) + 1))
    assert out == byte_tokenizer.decode(tokens)
    assert sum(decoded) <= 8 * len(tokens), (sum(decoded), len(tokens))
