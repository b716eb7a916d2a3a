"""Our functional forward against transformers' own models (fp32), prompt then token by token with the cache."""
import pytest
import torch
from drivers import forward_one
from tiny import hf_config, make_model, save_checkpoint

from offspec.formats.checkpoint import Checkpoint
from offspec.model.draft import load_resident
from offspec.model.forward import RowSpan
from offspec.model.kv_cache import KVCache

CPU = torch.device("cpu")

CONFIGS = {
    "llama": dict(arch="llama"),
    "llama3-rope": dict(arch="llama", rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
    "linear-rope": dict(arch="llama", rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2-bias": dict(arch="qwen2"),
    "qwen3-qk-norm": dict(arch="qwen3"),
    "tied": dict(arch="llama", tie=True),
    "mistral-mha": dict(arch="mistral", kv_heads=4),
}


def causal(n_new: int, start: int) -> torch.Tensor:
    """(n_new, start + n_new) mask: new token t sees every cached column and new tokens ≤ t."""
    S = start + n_new
    cols = torch.arange(S)
    rows = torch.arange(start, S)
    return cols[None, :] <= rows[:, None]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_match_transformers(tmp_path, name):
    hf = make_model(hf_config(**CONFIGS[name]), seed=3)
    ckpt = Checkpoint(save_checkpoint(hf, tmp_path / name))
    if name == "tied":
        assert ckpt.config.tie_word_embeddings
    ours = load_resident(ckpt, CPU, torch.float32)
    tokens = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))

    with torch.no_grad():
        ref_prompt = hf(tokens[:, :9]).logits
        ref_full = hf(tokens).logits
    cache = KVCache.for_model(ckpt.config, 32, torch.float32, CPU)
    pos = torch.arange(9)
    got = forward_one(ours, tokens[0, :9], pos, pos, causal(9, 0), cache)
    torch.testing.assert_close(got, ref_prompt[0], rtol=1e-4, atol=1e-4)
    for t in range(9, 12):  # token by token through the cache
        got = forward_one(ours, tokens[0, t:t + 1], torch.tensor([t]), torch.tensor([t]), causal(1, t), cache)
        torch.testing.assert_close(got[0], ref_full[0, t], rtol=1e-4, atol=1e-4)


def test_logit_rows_and_batch(tmp_path):
    hf = make_model(hf_config("qwen2"), seed=4)
    ckpt = Checkpoint(save_checkpoint(hf, tmp_path / "m"))
    ours = load_resident(ckpt, CPU, torch.float32)
    tokens = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(tokens).logits
    # Two sequences packed in one forward, each in its own cache row; their lengths differ (6 and 4 tokens).
    cache = KVCache.for_model(ckpt.config, 8, torch.float32, CPU, batch=2)
    rows = [RowSpan(0, 6, 0, torch.arange(6), causal(6, 0)), RowSpan(6, 10, 1, torch.arange(4), causal(4, 0))]
    got = ours.forward(torch.cat([tokens[0], tokens[1, :4]]), torch.cat([torch.arange(6), torch.arange(4)]), rows,
                       cache, logit_rows=torch.tensor([5, 9]))
    torch.testing.assert_close(got[0], ref[0, 5], rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        torch.testing.assert_close(got[1], hf(tokens[1:, :4]).logits[0, 3], rtol=1e-4, atol=1e-4)


def test_kv_compact_equals_recompute(tmp_path):
    """Write a 'tree' of 4 tokens after a prefix, keep slots [p, p+2], compare with computing that path directly."""
    hf = make_model(hf_config("llama"), seed=5)
    ckpt = Checkpoint(save_checkpoint(hf, tmp_path / "m"))
    ours = load_resident(ckpt, CPU, torch.float32)
    prefix = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    a, b, c, d = 10, 11, 12, 13
    cache = KVCache.for_model(ckpt.config, 16, torch.float32, CPU)
    forward_one(ours, prefix[0], torch.arange(5), torch.arange(5), causal(5, 0), cache)
    # tree: a(depth1) -> b(depth2); a -> c(depth2); d(depth1); slots 5..8
    tree_tokens = torch.tensor([a, b, c, d])
    depth = torch.tensor([1, 2, 2, 1]) - 1
    tree_mask = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 1]], dtype=torch.bool)
    mask = torch.cat([torch.ones(4, 5, dtype=torch.bool), tree_mask], 1)
    forward_one(ours, tree_tokens, 5 + depth, torch.arange(5, 9), mask, cache)
    cache.compact(torch.tensor([5, 7]), 5)   # keep a, c
    assert cache.length == 7
    ref = KVCache.for_model(ckpt.config, 16, torch.float32, CPU)
    forward_one(ours, torch.cat([prefix[0], torch.tensor([a, c])]), torch.arange(7), torch.arange(7), causal(7, 0), ref)
    torch.testing.assert_close(cache.k[:, :, :, :7], ref.k[:, :, :, :7], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cache.v[:, :, :, :7], ref.v[:, :, :, :7], rtol=1e-5, atol=1e-5)


def test_attention_in_bounded_query_blocks_equals_one_call(tmp_path, monkeypatch):
    """With the score budget so small that every attention call takes 3 query rows, a prompt's logits equal
    the one-call ones (to float32 rounding: the kernel's blocking follows its query count) and transformers';
    the plan counts the smaller scores."""
    import offspec.config as config
    from offspec.plan.sizes import activation_nbytes
    hf = make_model(hf_config("llama"), seed=5)
    ckpt = Checkpoint(save_checkpoint(hf, tmp_path / "m"))
    ours = load_resident(ckpt, CPU, torch.float32)
    tokens = torch.randint(0, 128, (20,), generator=torch.Generator().manual_seed(2))
    pos = torch.arange(20)

    def logits():
        cache = KVCache.for_model(ckpt.config, 32, torch.float32, CPU)
        return forward_one(ours, tokens, pos, pos, causal(20, 0), cache)
    whole = logits()
    heads = ckpt.config.n_heads
    plan_whole = activation_nbytes(ckpt.config, torch.float32, 20, 1024, 20)
    monkeypatch.setattr(config, "ATTENTION_SCORE_BYTES", 3 * heads * 20 * 8)
    assert config.attention_rows(heads, 20, 4) == 3
    torch.testing.assert_close(logits(), whole, rtol=1e-5, atol=1e-5)
    with torch.no_grad():
        torch.testing.assert_close(whole, hf(tokens[None]).logits[0], rtol=1e-4, atol=1e-4)
    assert plan_whole - activation_nbytes(ckpt.config, torch.float32, 20, 1024, 20) == heads * 17 * 20 * 8


def test_attention_never_asks_for_cudnn(tmp_path, monkeypatch):
    """Every attention call of a pass runs with cuDNN's SDPA backend off and the others on: cuDNN plans each new
    query and key length anew, and a tree pass brings new lengths on nearly every call (docs/streaming.md §9).
    The flags are PyTorch's global ones, so a CPU run sees what a GPU run would ask."""
    import offspec.model.forward as model
    hf = make_model(hf_config("llama"), seed=5)
    ckpt = Checkpoint(save_checkpoint(hf, tmp_path / "m"))
    ours = load_resident(ckpt, CPU, torch.float32)
    seen, sdpa = [], model.F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        b = torch.backends.cuda
        seen.append((b.cudnn_sdp_enabled(), b.flash_sdp_enabled(), b.mem_efficient_sdp_enabled(),
                     b.math_sdp_enabled()))
        return sdpa(*args, **kwargs)
    monkeypatch.setattr(model.F, "scaled_dot_product_attention", recording)
    tokens, pos, before = torch.arange(5), torch.arange(5), torch.backends.cuda.cudnn_sdp_enabled()
    forward_one(ours, tokens, pos, pos, causal(5, 0), KVCache.for_model(ckpt.config, 8, torch.float32, CPU))
    assert seen and set(seen) == {(False, True, True, True)}
    assert torch.backends.cuda.cudnn_sdp_enabled() == before            # the caller's setting, restored after


def test_logits_from_an_lm_head_in_chunks_equal_one_matmul(monkeypatch):
    """model.chunked_logits (an lm_head in host memory crossing a chunk at a time): the same logits as one
    matmul, with a chunk that does not divide the vocabulary; the chunk size is LM_HEAD_CHUNK_BYTES."""
    import offspec.model.forward as model_module
    g = torch.Generator().manual_seed(3)
    x, head = torch.randn(5, 16, generator=g), torch.randn(100, 16, generator=g)
    monkeypatch.setattr(model_module, "LM_HEAD_CHUNK_BYTES", 7 * 16 * 4)      # 7 rows of float32 a chunk
    got = model_module.chunked_logits(x, head)
    assert got.dtype == torch.float32 and got.shape == (5, 100)
    torch.testing.assert_close(got, x @ head.T, rtol=1e-6, atol=1e-6)
