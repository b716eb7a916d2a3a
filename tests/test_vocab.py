"""Padded vocabularies: draft and target share a tokenizer but not their embedding rows (Qwen2.5-0.5B has 151936
rows, Qwen2.5-7B 152064, for 151665 token ids). Here the tokenizer has 100 ids and the models 112 and 160 rows,
either way round. The padding rows are random like the others, so the target's own output contains padding
tokens, and a draft left alone would propose its padding rows too."""
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare
from tiny import hf_config, make_model, make_tokenizer, perturbed_copy, save_checkpoint, with_rows

from offspec.config import OffloadConfig, RuntimeConfig, SamplingConfig, TreeConfig
from offspec.engine.generate import Engine, GenerationRequest, run
from offspec.engine.load import load_engine
from offspec.errors import CheckpointError
from offspec.model.vocab import PLACEHOLDER_ID, SharedVocab, check_same_tokenizer
from offspec.spec.sampling import process_logits

RUNTIME = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32)
N_IDS = 100                                   # len(make_tokenizer()): ids 0..99; rows past them are padding
PROMPT = tuple(range(5, 25))


@pytest.fixture(scope="module", params=[(112, 160), (160, 112)], ids=["target-wider", "draft-wider"])
def padded(request, tmp_path_factory):
    """A target and a draft that agrees with it often (a noisy copy on the rows they share)."""
    draft_rows, target_rows = request.param
    root = tmp_path_factory.mktemp("padded")
    # Rows 0..99 are the tokenizer's; the padding rows' lm_head is scaled so they win about 15% of the time.
    base = make_model(hf_config("llama", n_layers=4, vocab=N_IDS), seed=7, scale=3.0)
    target = with_rows(base, target_rows, head_scale=0.85)
    draft = perturbed_copy(with_rows(target, draft_rows, head_scale=0.85), noise=0.02)
    t, d = save_checkpoint(target, root / "target"), save_checkpoint(draft, root / "draft")
    spec = load_engine(t, d, OffloadConfig(), RUNTIME, progress=False).engine
    plain = load_engine(t, None, OffloadConfig(), RUNTIME, progress=False).engine
    reference = generate(plain, TreeConfig(policy="none"))[0].tokens
    return SimpleNamespace(target=t, draft=d, draft_rows=draft_rows, target_rows=target_rows, engine=spec,
                           draft_model=draft, reference=reference)


def generate(eng, tree, sampling=SamplingConfig(), n=40, prompt=PROMPT):
    return run(eng, GenerationRequest(prompt_ids=prompt, max_new_tokens=n, tree=tree, sampling=sampling,
                                      ignore_eos=True))


def test_load_accepts_a_padded_pair(padded):
    eng = padded.engine
    assert eng.vocab == SharedVocab(n_shared=N_IDS, draft_rows=padded.draft_rows, target_rows=padded.target_rows)
    assert (eng.draft.cfg.vocab_size, eng.target.cfg.vocab_size) == (padded.draft_rows, padded.target_rows)


def test_the_targets_own_output_uses_padding_rows(padded):
    """Without this the tests below could not fail: the target's greedy output does pick padding rows, and
    (target wider) rows the draft has no embedding for."""
    assert any(t >= N_IDS for t in padded.reference)
    if padded.target_rows > padded.draft_rows:
        assert any(t >= padded.draft_rows for t in padded.reference)


@pytest.mark.parametrize("policy,budget", [("dyspec", 16), ("dyspec", 64), ("dyspec", None), ("heap", 32),
                                           ("chain", 4), ("static", 16)])
def test_speculative_greedy_equals_the_targets_own(padded, policy, budget):
    report, steps = generate(padded.engine, TreeConfig(policy=policy, budget=budget))
    assert report.tokens == padded.reference
    if budget is not None and budget >= 16:    # (auto may rightly choose plain decoding: tiny drafts cost what the target does)
        assert report.tokens_per_pass > 1.5, "the draft agrees often: trees must get accepted"


def record_trees(eng, monkeypatch) -> list:
    trees, grow = [], eng._grow_all

    def recording(*args, **kwargs):
        grown = grow(*args, **kwargs)                 # every row's tree of the round
        trees.extend(grown)
        return grown
    monkeypatch.setattr(eng, "_grow_all", recording)
    return trees


def test_the_draft_never_proposes_a_padding_row(padded, monkeypatch):
    # The draft alone ranks padding rows first at some positions: unrestricted, it would propose them.
    with torch.no_grad():
        raw_best = padded.draft_model(torch.randint(0, N_IDS, (4, 30), generator=torch.Generator().manual_seed(0)))
    assert (raw_best.logits.argmax(-1) >= N_IDS).any()

    trees = record_trees(padded.engine, monkeypatch)
    generate(padded.engine, TreeConfig(policy="dyspec", budget=64))
    greedy_trees = len(trees)
    generate(padded.engine, TreeConfig(policy="dyspec", budget=32), SamplingConfig(temperature=1.0, seed=1))
    assert greedy_trees > 3 and len(trees) > greedy_trees + 3
    # Draft nodes only: n-gram nodes repeat the sequence, which may hold the target's own padding-row tokens.
    proposed = torch.tensor([int(tree.tokens[n]) for tree in trees for n in range(1, tree.n_nodes)
                             if tree.ngram_match(n) == 0])
    assert proposed.numel() > 200 and int(proposed.max()) < N_IDS
    dists = [p for tree in trees[greedy_trees:] for p in tree.dists.values()]
    assert dists and all(p.shape == (padded.target_rows,) and not p[N_IDS:].any() for p in dists)


def test_shared_vocab_restricts_p_before_top_k_and_widens_it():
    vocab = SharedVocab(n_shared=4, draft_rows=6, target_rows=8)
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0, 9.0, 9.0]])          # (1, draft_rows): padding rows loudest
    p = vocab.draft_distribution(logits, SamplingConfig(temperature=1.0, top_k=2))
    assert p.shape == (1, 8)
    assert torch.equal(p[0] > 0, torch.tensor([False, True, True, False, False, False, False, False]))
    assert torch.allclose(p.sum(), torch.tensor(1.0))
    greedy = vocab.draft_distribution(logits, SamplingConfig())
    assert int(greedy.argmax()) == 1 and not greedy[0, 4:].any()
    assert vocab.draft_input(torch.tensor([0, 5, 6, 7])).tolist() == [0, 5, PLACEHOLDER_ID, PLACEHOLDER_ID]


# ------------------------------------------------------------------ sampling: the target's extra rows keep their mass
RUNS = 2000
# Power: each check compares the counts of one emitted position over RUNS = 2000 generations with its exact law
# (support <= 24 tokens, df <= 23) at alpha = 0.001. A sampler at total-variation distance >= 0.1 from it gives a
# noncentrality >= RUNS * (2 * 0.1)^2 = 80 (Cauchy-Schwarz) and P(ncx2(23, 80) > chi2.ppf(0.999, 23)) = 0.9995.
# Dropping the target's extra rows moves about a third of the mass (TV ~ 0.3).


@pytest.fixture(scope="module")
def context_free(tmp_path_factory):
    """16 token ids; the draft has 20 rows, the target 24. The target is made context-free (attention and MLP
    outputs zeroed, so the residual stream is the embedding): its next-token law depends on the last token only,
    and the law of the k-th emitted token is a matrix power."""
    root = tmp_path_factory.mktemp("context_free")
    target = make_model(hf_config("llama", n_layers=2, vocab=24), seed=11, scale=3.0)
    with torch.no_grad():
        for layer in target.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    draft = perturbed_copy(with_rows(target, 20), noise=0.3)
    tok = make_tokenizer(n_tokens=16)
    t, d = save_checkpoint(target, root / "t", tok), save_checkpoint(draft, root / "d", tok)
    eng = load_engine(t, d, OffloadConfig(), RUNTIME, progress=False).engine
    assert eng.vocab == SharedVocab(n_shared=16, draft_rows=20, target_rows=24)
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    with torch.no_grad():
        Q = process_logits(target(torch.arange(24)[:, None]).logits[:, 0], sampling).double()   # (V, V) next | last
    return SimpleNamespace(engine=eng, Q=Q, sampling=sampling)


PROMPT_CF = (5, 9, 7)


def emitted_first_two(eng, sampling, runs: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Runs of two tokens each, seeds 0..runs-1: (first tokens, second tokens, widest tree)."""
    from dataclasses import replace

    first, second, widest = [], [], 0
    for seed in range(runs):
        req = GenerationRequest(prompt_ids=PROMPT_CF, max_new_tokens=2, ignore_eos=True,
                                sampling=replace(sampling, seed=seed),
                                tree=TreeConfig(policy="dyspec", budget=6, threshold=None, branching=3, max_depth=3))
        steps = list(eng.generate(req))
        tokens = [t for s in steps for t in s.tokens]
        first.append(tokens[0])
        second.append(tokens[1])
        widest = max(widest, steps[0].tree_size)
    return np.array(first), np.array(second), widest


def chi_square_pvalue(samples: np.ndarray, law: np.ndarray) -> float:
    """The chi-square test's p-value; 0 when a token the law cannot produce (after top-p) came out."""
    counts = np.bincount(samples, minlength=len(law))
    support = law > 0
    if counts[~support].sum() > 0:
        return 0.0
    return chisquare(counts[support], law[support] / law[support].sum() * len(samples)).pvalue


def test_sampling_keeps_the_targets_extra_rows(context_free):
    cf = context_free
    law1 = cf.Q[PROMPT_CF[-1]].numpy()                                   # first token's exact law
    law2 = (cf.Q[PROMPT_CF[-1]] @ cf.Q).numpy()                          # second token's
    assert law1[16:].sum() > 0.15 and law2[16:].sum() > 0.15, "the extra rows must carry real mass"
    first, second, widest = emitted_first_two(cf.engine, cf.sampling, RUNS)
    assert widest >= 3
    assert (second >= 16).sum() > 100 and (second >= 20).any()          # extra rows, some past the draft's rows
    assert chi_square_pvalue(first, law1) > 1e-3
    assert chi_square_pvalue(second, law2) > 1e-3


def test_chi_square_catches_a_truncated_target_distribution(context_free, monkeypatch):
    """Negative control: verification with q cut to the shared ids (what a loop that cut the target's logits to
    the draft's vocabulary would do) never emits the target's extra rows, and the same test sees it at once."""
    cf = context_free
    n = cf.engine.vocab.n_shared

    def accept_with_truncated_q(tree, q_logits, sampling, generator):
        from offspec.spec.accept import verify_stochastic
        from offspec.spec.calibrate import judged_path
        q = process_logits(q_logits[:, :n], sampling)                                    # (N, n): WRONG
        verdict = verify_stochastic(tree, torch.nn.functional.pad(q, (0, q_logits.shape[-1] - n)).__getitem__, generator)
        return verdict, judged_path(tree, verdict.nodes)
    monkeypatch.setattr(Engine, "_accept", staticmethod(accept_with_truncated_q))
    law1 = cf.Q[PROMPT_CF[-1]].numpy()
    law2 = (cf.Q[PROMPT_CF[-1]] @ cf.Q).numpy()
    first, second, _ = emitted_first_two(cf.engine, cf.sampling, 300)
    assert (first >= n).sum() == 0 and (second >= n).sum() == 0
    assert chi_square_pvalue(first, law1) < 1e-6
    assert chi_square_pvalue(second, law2) < 1e-6


# ------------------------------------------------------------------ what load accepts and refuses
def test_tokenizers_may_extend_each_other_past_the_shared_ids():
    plain = make_tokenizer()
    assert check_same_tokenizer(plain, plain) == N_IDS
    assert check_same_tokenizer(plain, make_tokenizer(padding_tokens=12)) == N_IDS     # GGUF-style '[PAD100]'...
    assert check_same_tokenizer(make_tokenizer(padding_tokens=60), plain) == N_IDS
    assert check_same_tokenizer(plain, make_tokenizer(n_tokens=50)) == 50
    extended = make_tokenizer()
    extended.add_tokens(["<tool>"])                                                   # a fine-tune's new token: id 100
    assert check_same_tokenizer(extended, plain) == N_IDS
    # Inside the shared ids every token must match: ids 50..99 are characters in one, '[PAD50]'... in the other.
    with pytest.raises(CheckpointError, match=r"tokenizers differ \(100 vs 100 tokens, 100 with different ids"):
        check_same_tokenizer(plain, make_tokenizer(n_tokens=50, padding_tokens=50))


def test_a_gguf_style_draft_tokenizer_loads(tmp_path):
    """Draft tokenizer with '[PAD<id>]' entries up to its 112 rows, target tokenizer without them: accepted."""
    target = with_rows(make_model(hf_config("llama", n_layers=1), seed=3), 160)
    draft = with_rows(target, 112)
    t = save_checkpoint(target, tmp_path / "t")
    d = save_checkpoint(draft, tmp_path / "d", make_tokenizer(padding_tokens=12))
    eng = load_engine(t, d, OffloadConfig(), RUNTIME, progress=False).engine
    assert eng.vocab == SharedVocab(n_shared=N_IDS, draft_rows=112, target_rows=160)
    report, _ = generate(eng, TreeConfig(policy="dyspec", budget=8), n=8)
    assert len(report.tokens) == 8


@pytest.mark.parametrize("which", ["target", "draft"])
def test_a_model_with_fewer_rows_than_token_ids_is_refused(tmp_path, which):
    good = save_checkpoint(make_model(hf_config("llama", n_layers=1), seed=3), tmp_path / "good")
    short = save_checkpoint(make_model(hf_config("llama", n_layers=1, vocab=64), seed=3), tmp_path / "short")
    with pytest.raises(CheckpointError) as caught:
        if which == "target":
            load_engine(short, None, OffloadConfig(), RUNTIME, progress=False)
        else:
            load_engine(good, short, OffloadConfig(), RUNTIME, progress=False)
    message = str(caught.value)
    assert "\n" not in message
    assert message.startswith(f"{which} {short}: 64 embedding rows") and "100 token ids" in message


def test_a_draft_with_the_targets_tokenizer_files_shares_its_tokenizer(tmp_path):
    """Tokenizer files equal byte for byte: the draft's tokenizer is not read again (one object serves both); one
    byte different, or a file in one folder only: each folder's own tokenizer is read and compared."""
    import shutil

    from tiny import save_agreeing_pair

    from offspec.engine.load import Models
    from offspec.formats.open import same_tokenizer_files
    target, draft = save_agreeing_pair(tmp_path, n_layers=1)[:2]
    assert same_tokenizer_files(target, draft)
    models = Models.open(target, draft)
    assert models.n_shared == max(models.tokenizer.get_vocab().values()) + 1
    other = tmp_path / "other"
    shutil.copytree(draft, other)
    config = other / "tokenizer_config.json"
    config.write_text(config.read_text() + " ")
    assert not same_tokenizer_files(target, other)
    assert Models.open(target, other).n_shared == models.n_shared       # read and compared: the same ids
    (other / "tokenizer_config.json").unlink()
    assert not same_tokenizer_files(target, other)
