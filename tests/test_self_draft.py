"""--draft self: the target's own layers held quantized as its draft (model.draft.load_twin). It shares the
target's globals, is counted by the memory plan like any draft (its layers only), never changes the output
(greedy float32 == the target's own; sampling keeps the target's law; a batch keeps each prompt's tokens), and
works for published and GGUF targets."""
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_cli import cli, ok
from tiny import hf_config, make_model, save_agreeing_pair, save_gguf, save_published_checkpoint

from offspec.config import OffloadConfig, RunLimits, RuntimeConfig, SamplingConfig, TreeConfig
from offspec.engine.generate import GenerationRequest, run
from offspec.engine.load import SELF_DRAFT, Models, load_engine
from offspec.errors import BudgetError
from offspec.formats import int4
from offspec.formats.int4 import Int4Weight
from offspec.formats.open import open_checkpoint
from offspec.formats.weights import HeldWeight, Int8Weight
from offspec.plan.sizes import ModelSpec, draft_weights_nbytes, globals_nbytes, int8_copy_nbytes

RUNTIME = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32)
PROMPTS = (tuple(range(5, 25)), tuple(range(40, 47)), (3, 9, 27, 81 % 50, 11))
TREE = TreeConfig(policy="dyspec", budget=16)


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return save_agreeing_pair(tmp_path_factory.mktemp("twin"), n_layers=3)[0]


def tokens(engine, prompt, tree, n=30, sampling=SamplingConfig()):
    report, _ = run(engine, GenerationRequest(prompt_ids=prompt, max_new_tokens=n, tree=tree, sampling=sampling,
                                              ignore_eos=True))
    return report


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_twin_greedy_equals_the_targets_own_and_shares_its_weights(target, offload):
    """--draft-quant auto on a CPU: int8 copies of the resident target's own matrices; where the target streams,
    int8 layers of its own (int8-held)."""
    loaded = load_engine(target, SELF_DRAFT, OffloadConfig(mode=offload), RUNTIME, progress=False)
    engine = loaded.engine
    try:
        twin = engine.draft.model() if hasattr(engine.draft, "model") else engine.draft
        assert twin.globals.embed is engine.target.globals.embed              # shared, not copied
        if offload == "none":
            assert engine.draft_quant == "int8"
            for mine, its in zip(twin.layers.layers, engine.target.layers.layers):
                assert isinstance(mine.q_proj, Int8Weight) and mine.q_proj.full is its.q_proj
            assert twin.globals.lm_head.full is engine.target.globals.lm_head
        else:
            assert engine.draft_quant == "int8-held" and any("int8-held" in n for n in loaded.plan.notes)
            assert twin.globals is engine.target.globals
            assert all(isinstance(w.q_proj, HeldWeight) and w.q_proj.quant == "int8" for w in twin.layers.layers)
        greedy_equals_plain(engine, at_least=2)        # an int8 twin agrees with its target most of the time
    finally:
        engine.close()


@pytest.mark.parametrize("offload", ["none", "cpu"])
def test_int4_twin_equals_the_targets_greedy_and_holds_the_bytes_the_plan_counts(target, offload, monkeypatch):
    """--draft-quant int4 (the GPU's default): every layer's matrix in 4-bit groups read by PyTorch's int4 matmul
    (the lm_head: int4_twin_as_planned); built from one pass over the target's own layers, resident or streamed
    (the checkpoint's layers are not read a second time)."""
    from offspec.model import draft

    def second_read(*args):
        raise AssertionError("the twin read the checkpoint's layers again")

    def twin_without_layers(ckpt, *args, **kwargs):
        ckpt.layer_weights = second_read
        return load_twin(ckpt, *args, **kwargs)
    load_twin = draft.load_twin
    monkeypatch.setattr(draft, "load_twin", twin_without_layers)
    loaded = load_engine(target, SELF_DRAFT, OffloadConfig(mode=offload), replace(RUNTIME, draft_quant="int4"),
                         progress=False)
    engine = loaded.engine
    try:
        assert engine.draft_quant == "int4"
        assert int4_twin_as_planned(loaded).globals.embed is engine.target.globals.embed
        greedy_equals_plain(engine, at_least=1.5)      # 4 bits of a tiny random model: nf4 takes 1.9-3.8 here
    finally:
        engine.close()


def greedy_equals_plain(engine, at_least: float) -> None:
    """Greedy with dyspec trees == plain greedy on two prompts, at more than at_least tokens a pass."""
    for prompt in PROMPTS[:2]:
        plain = tokens(engine, prompt, TreeConfig(policy="none"))
        spec = tokens(engine, prompt, TREE)
        assert spec.tokens == plain.tokens and spec.tokens_per_pass > at_least


def int4_twin_as_planned(loaded):
    """The loaded engine's twin: its layers' matrices int4; its lm_head the target's own, read as a dense draft's
    is on a CPU (draft_quant.draft_lm_head): beside an int8 copy in bfloat16, as it is in float32. The plan's
    draft bytes are theirs plus its norms and biases."""
    twin = loaded.engine.draft.model() if hasattr(loaded.engine.draft, "model") else loaded.engine.draft
    held = [getattr(w, f) for w in twin.layers.layers for f in
            ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")]
    assert all(isinstance(m, Int4Weight) for m in held)
    head, its = twin.globals.lm_head, loaded.engine.target.globals.lm_head
    copy = 0
    if loaded.engine.target.dtype == torch.bfloat16:
        assert loaded.plan.draft_head == "int8" and isinstance(head, Int8Weight) and head.full is its
        copy = sum(t.numel() * t.element_size() for t in (head.q, head.scale))
    else:
        assert loaded.plan.draft_head == "as is" and head is its
    dense = sum(t.numel() * t.element_size() for w in twin.layers.layers for t in vars(w).values()
                if isinstance(t, torch.Tensor))                                         # norms and biases
    planned = next(i for i in loaded.plan.items if i.what == "draft weights")
    assert planned.nbytes == sum(m.nbytes for m in held) + copy + dense and "layers held int4" in planned.note
    return twin


def test_an_int4_twin_in_bfloat16_on_a_cpu_reads_an_int8_copy_of_the_targets_lm_head(target):
    loaded = load_engine(target, SELF_DRAFT, OffloadConfig(), RuntimeConfig(device=torch.device("cpu"),
                         dtype=torch.bfloat16, draft_quant="int4"), progress=False)
    try:
        int4_twin_as_planned(loaded)
        assert tokens(loaded.engine, PROMPTS[0], TREE, n=8).tokens_per_pass > 1
    finally:
        loaded.engine.close()


def test_the_twin_of_a_split_ring_is_the_twin_of_its_layers():
    """quantized_pass over a split ring (each streamed layer handed over in its parts, from slots reused after)
    holds what quantizing each whole layer holds, bit for bit."""
    from test_split_ring import TINY, random_layers, split_plan

    from offspec.engine.load import open_target_layers
    from offspec.formats.layout import LayerWeights
    from offspec.formats.weights import with_quantized_matrices
    from offspec.model.draft import quantized_pass

    weights = random_layers(TINY)
    with open_target_layers(weights.__getitem__, TINY, split_plan(TINY, "cpu", n_resident=2), torch.device("cpu"),
                            torch.float32, progress=False) as source:
        twin = quantized_pass(source, TINY.n_layers, "int4", group=32)
    for i, mine in enumerate(twin):
        whole = with_quantized_matrices(LayerWeights(**weights[i]), "int4", 32)
        for name, t in vars(whole).items():
            m = getattr(mine, name)
            if isinstance(t, Int4Weight):
                assert torch.equal(m.packed, t.packed) and torch.equal(m.scales_zeros, t.scales_zeros), (i, name)
            elif isinstance(t, torch.Tensor):
                assert torch.equal(m, t), (i, name)


def test_twin_keeps_each_prompts_tokens_in_a_batch(target):
    engine = load_engine(target, SELF_DRAFT, OffloadConfig(), RUNTIME, progress=False,
                         limits=RunLimits(concurrency=3)).engine
    try:
        alone = [tokens(engine, p, TREE, n=20).tokens for p in PROMPTS]
        requests = [GenerationRequest(prompt_ids=p, max_new_tokens=20, tree=TREE, ignore_eos=True) for p in PROMPTS]
        together = {i: [] for i in range(len(requests))}
        for event in engine.run_batch(requests, concurrency=3):
            together[event.request] += event.step.tokens
        assert [together[i] for i in range(len(PROMPTS))] == alone
    finally:
        engine.close()


@pytest.mark.parametrize("quant, policy", [("nf4", "dyspec"), ("int4", "sequoia")])
def test_twin_sampling_keeps_the_targets_law(tmp_path, quant, policy):
    """The nf4 / int4 twin of a nearly context-free target (the next token's law depends on the last token only),
    growing dyspec / Sequoia trees: the second emitted token, reached through accepted twin tokens or residual
    samples, follows the target's law (chi-square, alpha 0.001; as test_generate.test_engine_sampling_is_lossless
    for a separate draft)."""
    import numpy as np
    from scipy.stats import chisquare
    from tiny import make_tokenizer, save_checkpoint

    from offspec.spec.sampling import process_logits
    if quant == "nf4":
        pytest.importorskip("bitsandbytes")
    model = make_model(hf_config("llama", n_layers=2, vocab=24), seed=11, scale=3.0)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
            layer.mlp.up_proj.weight.normal_()       # nf4's error shows in the MLP output of every row
    t_dir = save_checkpoint(model, tmp_path / "t", make_tokenizer(n_tokens=24))
    runtime = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32, draft_quant=quant)
    engine = load_engine(t_dir, SELF_DRAFT, OffloadConfig(), runtime, progress=False).engine
    sampling = SamplingConfig(temperature=1.0, top_p=0.95)
    with torch.no_grad():
        Q = process_logits(model(torch.arange(24)[:, None]).logits[:, 0], sampling).double()   # (V, V)
    prompt = (5, 9, 7)
    law2 = (Q[prompt[-1]] @ Q).numpy()
    second = []
    tree = TreeConfig(policy=policy, budget=6, branching=3, max_depth=3)
    for seed in range(800):
        req = GenerationRequest(prompt_ids=prompt, max_new_tokens=2, ignore_eos=True, tree=tree,
                                sampling=SamplingConfig(temperature=1.0, top_p=0.95, seed=seed))
        second.append([t for s in engine.generate(req) for t in s.tokens][1])
    engine.close()
    counts = np.bincount(second, minlength=24)
    support = law2 > 0
    assert counts[~support].sum() == 0
    expected = law2[support] / law2[support].sum() * len(second)
    assert chisquare(counts[support], expected).pvalue > 1e-3


@pytest.mark.parametrize("kind, quant", [("awq", "auto"), ("gguf", "auto"), ("gguf", "int4")])
def test_twin_of_a_published_or_gguf_target_equals_its_own_greedy(tmp_path, kind, quant):
    """The twin is built from the dequantized layers: the output is the published target's own. An int4 twin of
    a GGUF target holds its matrices in the blocks' groups of 32 (int4.source_group), as the plan counts them."""
    pytest.importorskip("gguf") if kind == "gguf" else None
    model = make_model(hf_config("llama", n_layers=2, hidden=256, vocab=300), seed=5, scale=3.0)
    path = (save_published_checkpoint(model, tmp_path / "awq", "awq-g32") if kind == "awq" else
            save_gguf(model, tmp_path / "t.gguf", {"q_proj": "Q4_K", "down_proj": "Q6_K"}))
    loaded = load_engine(path, SELF_DRAFT, OffloadConfig(), replace(RUNTIME, draft_quant=quant), progress=False)
    engine = loaded.engine
    try:
        if quant == "int4":
            assert int4_twin_as_planned(loaded).layers.layers[0].q_proj.group == 32
        plain = tokens(engine, PROMPTS[0], TreeConfig(policy="none"), n=20)
        spec = tokens(engine, PROMPTS[0], TREE, n=20)
        assert spec.tokens == plain.tokens and spec.tokens_per_pass > 1.5
    finally:
        engine.close()


def test_the_plan_counts_the_twins_own_bytes_only(target):
    """int8: the int8 copies of the target's matrices (its dense ones are the target's); int8-held and nf4:
    its layers, not the globals it shares."""
    models = Models.open(target, SELF_DRAFT)
    spec = ModelSpec.of(models.target)
    try:
        plan = models.plan(OffloadConfig(), RUNTIME)
        items = {i.what: i for i in plan.items}
        assert plan.draft_quant == "int8" and items["draft weights"].nbytes == 0
        assert items["draft int8 copy"].nbytes == int8_copy_nbytes(spec.cfg, torch.float32)
        for quant in ("int8-held", "nf4"):
            plan = models.plan(OffloadConfig(), replace(RUNTIME, draft_quant=quant))
            item = next(i for i in plan.items if i.what == "draft weights")
            own = draft_weights_nbytes(spec, torch.float32, quant, "as is")  # its layers + globals of its own
            assert item.nbytes == own - globals_nbytes(spec, torch.float32)
            assert "--draft self" in item.note and quant in item.note
    finally:
        models.target.close()
        models.draft.close()


def test_the_auto_tree_is_sequoias_for_the_twin_and_dyspecs_for_a_separate_draft(tmp_path):
    """TreeConfig's default policy (auto) is resolved by the engine's draft (sequoia.chosen_policy): the twin's rows
    grow Sequoia's tree (and learn the pair's acceptance by rank), a separate draft's grow dyspec's; a policy
    given is kept; the output is the target's own either way."""
    target, draft, _ = save_agreeing_pair(tmp_path, n_layers=2)
    auto, given = TreeConfig(budget=8), TreeConfig(policy="dyspec", budget=8)
    for draft_path, want in ((SELF_DRAFT, "sequoia"), (draft, "dyspec")):
        engine = load_engine(target, draft_path, OffloadConfig(mode="none"), RUNTIME, progress=False).engine
        try:
            report = tokens(engine, PROMPTS[0], auto, n=12)
            assert report.tree_policy == want and tokens(engine, PROMPTS[0], given, n=12).tree_policy == "dyspec"
            assert report.tokens == tokens(engine, PROMPTS[0], TreeConfig(policy="none"), n=12).tokens
            assert bool(engine.learned.ranks._modes) == (want == "sequoia")     # only sequoia reads the ranks
        finally:
            engine.close()


def test_cli_self_draft_runs_and_refuses_a_dense_twin(target):
    out = ok(cli("generate", "--target", target, "--draft", "self", "--device", "cpu", "--dtype", "float32",
                 "--max-new-tokens", "8", "--raw", "hello"))
    assert "draft self (int8)" in out.stderr and "tree sequoia (budget auto)" in out.stderr    # --tree auto's pick
    bad = cli("generate", "--target", target, "--draft", "self", "--draft-quant", "none", "--device", "cpu",
              "--max-new-tokens", "4", "hello")
    assert bad.exit_code == 1 and "--draft self reads the target's layers quantized" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_a_target_without_draft_drafts_for_itself_where_it_streams_and_the_twin_fits(target):
    """No --draft with a --target: the twin, optional (Models.open(optional_twin=True)). Kept where the target,
    planned alone, streams and the twin fits beside it; dropped, with the plan's note saying why, where every
    target layer stays resident or it does not fit. Asked for (--draft self), a twin that does not fit is refused."""
    from offspec.plan.machine import Machine

    roomy = Machine("cpu", 8 << 30, 8 << 30, "given")
    streamed = OffloadConfig(mode="cpu")
    alone = Models.open(target, None).plan(streamed, RUNTIME, machine=roomy)
    need = alone.total("device") + alone.total("host")
    tight = Machine("cpu", need + (64 << 10), need + (64 << 10), "given")
    cases = [(roomy, streamed, "int8-held", None), (roomy, OffloadConfig(mode="none"), None, "stays resident"),
             (tight, streamed, None, "does not fit")]
    for machine, offload, held, why in cases:
        models = Models.open(target, SELF_DRAFT, optional_twin=True)
        plan = models.plan(offload, RUNTIME, machine=machine)
        if held:
            assert models.twin and plan.draft_quant == held
            models.draft.close()
        else:
            assert models.draft is None and not models.twin and why in plan.notes[-1]
        models.target.close()
    asked = Models.open(target, SELF_DRAFT)
    with pytest.raises(BudgetError):
        asked.plan(streamed, RUNTIME, machine=tight)
    asked.target.close()
    asked.draft.close()


def test_cli_target_without_draft_uses_its_twin_where_it_streams(target):
    out = ok(cli("generate", "--target", target, "--offload", "cpu", "--device", "cpu", "--dtype", "float32",
                 "--max-new-tokens", "8", "--raw", "hello"))
    assert "the target drafts for itself" in out.stderr and "draft self (int8-held)" in out.stderr
    alone = ok(cli("generate", "--target", target, "--device", "cpu", "--dtype", "float32", "--max-new-tokens", "8",
                   "--raw", "hello"))
    assert "draft self (" not in alone.stderr and alone.stdout == out.stdout
    assert "plan note: the target runs alone: every target layer stays resident" in alone.stderr


def test_an_int4_twin_built_on_a_cpu_is_kept_and_read_back_bit_for_bit(target, monkeypatch, capsys):
    """twin_store: the first load quantizes and keeps the twin's int4 matrices on disk; the next reads them (no
    quantization) into the same bytes beside the new target's own vectors; a file that does not load is rebuilt."""
    from offspec.model import draft, twin_store

    def matrices(loaded):
        twin = int4_twin_as_planned(loaded)
        return twin, [(m.packed, m.scales_zeros, m.group, m.shape) for m in
                      [w.q_proj for w in twin.layers.layers] + [w.down_proj for w in twin.layers.layers]]

    def load():
        return load_engine(target, SELF_DRAFT, OffloadConfig(), replace(RUNTIME, draft_quant="int4"), progress=False)

    stale = twin_store.twins_dir() / f"{Path(target).name}-int4-0123456789abcdef.safetensors"   # another version's
    stale.parent.mkdir(parents=True, exist_ok=True)
    stale.write_bytes(bytes(2048))
    first = load()
    built = matrices(first)[1]
    greedy_equals_plain(first.engine, at_least=1.5)
    first.engine.close()
    (kept,) = set(twin_store.twins_dir().iterdir()) - {stale}
    err = capsys.readouterr().err
    assert "are kept in" in err and "1 other twin file of this target there (2 kB)" in err and stale.exists()

    def no_quantizing(*args, **kwargs):
        raise AssertionError("the kept twin was quantized again")
    with monkeypatch.context() as m:
        m.setattr(draft, "quantized_pass", no_quantizing)
        again = load()
        twin, read = matrices(again)
        assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) and a[2:] == b[2:] for a, b in zip(built, read))
        assert twin.layers.layers[0].input_norm is again.engine.target.layers.layers[0].input_norm
        greedy_equals_plain(again.engine, at_least=1.5)
        again.engine.close()
    kept.write_bytes(kept.read_bytes()[:1000])                              # truncated: rebuilt, with a warning
    rebuilt = load()
    assert all(torch.equal(a[0], b[0]) for a, b in zip(built, matrices(rebuilt)[1]))
    rebuilt.engine.close()
    err = capsys.readouterr().err
    assert "rebuilding the twin" in err and "are kept in" in err and len(kept.read_bytes()) > 1000
    assert twin_store.twin_path(open_checkpoint(target), RUNTIME.dtype) == kept
    monkeypatch.setattr(int4, "GROUP", 64)                  # other groups: another file, the kept one never read
    assert twin_store.twin_path(open_checkpoint(target), RUNTIME.dtype) != kept
