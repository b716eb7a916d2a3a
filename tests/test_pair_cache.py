"""The pair's cache of acceptance counts (engine/pair_cache.py), both kinds: Sequoia's acceptance by rank and
dyspec's calibration. Written at close, read back by the next engine, kept apart by pair and by greedy vs sampling,
frozen when full, a corrupt file only warned about; and end to end, --calibrate rows that start from what earlier
runs of the pair learned, their tokens still the target's greedy ones."""
import json

import pytest
import torch
from tiny import save_agreeing_pair

from offspec.config import OffloadConfig, RuntimeConfig, SamplingConfig, TreeConfig
from offspec.engine.generate import GenerationRequest
from offspec.engine.load import load_engine
from offspec.engine.pair_cache import CALIBRATION, SEQUOIA, Learned, pair_key
from offspec.formats import int4
from offspec.spec.calibrate import AcceptanceCounts, observe
from offspec.spec.sequoia import RankCounts
from offspec.spec.tree import TokenTree


def request(greedy=True):
    return GenerationRequest(prompt_ids=(1, 2), max_new_tokens=4,
                             tree=TreeConfig(policy="sequoia", branching=4, calibrate=True),
                             sampling=SamplingConfig(temperature=0.0 if greedy else 0.8))


def three_children() -> TokenTree:
    """root -> a, b, c (ranks 0, 1, 2); a -> d."""
    tree = TokenTree(1)
    for token, p in zip((2, 3, 4), (0.6, 0.3, 0.1)):
        tree.add(0, token, p, draft_prob=p, estimate=p)
    tree.add(1, 5, 0.3, draft_prob=0.5, estimate=0.5)
    return tree


def full_calibration() -> dict:
    counts = AcceptanceCounts.zeros()
    counts.draft_n[0, 5], counts.draft_hits[0, 5] = CALIBRATION.frozen_at, 100
    return counts.to_dict()


# Per kind: the learner a row takes, one verified tree's observations added to it (b accepted at the root: one
# judged node by rank, three observed children by bin), and a file holding enough to freeze it.
KINDS = {
    "sequoia": (SEQUOIA, lambda learned, req: learned.rank_learner(req),
                lambda learner, judged: learner.observe(three_children(), judged),
                lambda: {"tried": [SEQUOIA.frozen_at, 900], "hits": [1100, 300]}),
    "calibration": (CALIBRATION, lambda learned, req: learned.calibrator(req),
                    lambda learner, judged: learner.add(observe(three_children(), judged)),
                    full_calibration),
}


@pytest.mark.parametrize("name", KINDS)
def test_the_cache_is_written_at_close_read_back_and_frozen_when_full(tmp_path, capsys, name):
    kind, learner_of, add, full = KINDS[name]
    learned = Learned("pair", home=tmp_path)
    learner = learner_of(learned, request())
    for _ in range(3):
        add(learner, {0: 3})
    per_tree = learner.counts.observations // 3
    learned.save()
    learned.save()                                               # twice: nothing counted twice
    files = list((tmp_path / kind.folder).glob("*.json"))
    assert len(files) == 1 and per_tree > 0
    again = Learned("pair", home=tmp_path)
    assert learner_of(again, request()).counts.observations == 3 * per_tree       # a new engine starts there
    sampled = learner_of(again, request(greedy=False)).counts.observations          # its own file (and the seed)
    assert sampled == min(3 * per_tree, kind.seed_weight)
    assert learner_of(Learned("other", home=tmp_path), request()).counts.observations == 0
    # Full: frozen, not rewritten.
    files[0].write_text(json.dumps({"version": 1, **full()}))
    written = files[0].read_text()
    frozen = Learned("pair", home=tmp_path)
    learner = learner_of(frozen, request())
    before = learner.counts.observations
    add(learner, {0: None})
    frozen.save()
    assert learner.frozen and learner.counts.observations == before >= kind.frozen_at
    assert files[0].read_text() == written
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", KINDS)
def test_a_greedy_row_starts_from_what_earlier_rows_observed_a_sampled_row_from_the_snapshot(tmp_path, name):
    """Within one engine: a greedy row (its tokens the target's whatever the tree) starts where the rows before it
    left the counts; a sampled row starts from the snapshot, whatever ran before it."""
    kind, learner_of, add, _ = KINDS[name]
    learned = Learned("pair", home=tmp_path)
    for greedy in (True, False):
        first = learner_of(learned, request(greedy))
        add(first, {0: 3})
        seen = first.counts.observations
        assert seen > 0
        assert learner_of(learned, request(greedy)).counts.observations == (seen if greedy else 0)
        assert learned.observations(greedy)[kind.folder] == (seen if greedy else 0)


def test_a_learning_sampled_row_is_seeded_by_the_greedy_counts_the_engine_read(tmp_path):
    """Sequoia: a pair's sampled rows start from its greedy counts scaled to seed_weight observations (their
    hazards kept), not from the fixed prior; the seed is the greedy file as the engine read it, never written
    back, and a frozen sampled snapshot is used as it is. Calibration is not seeded."""
    greedy = {"tried": [1000.0, 20.0], "hits": [980.0, 15.0]}
    (tmp_path / "sequoia").mkdir()
    Learned("pair", home=tmp_path).ranks.snapshot(True).path.write_text(json.dumps({"version": 1, **greedy}))
    learned = Learned("pair", home=tmp_path)
    sampled = learned.rank_learner(request(greedy=False))
    cold = Learned("other", home=tmp_path).rank_learner(request(greedy=False))
    seeded = RankCounts.from_dict(greedy).at_most(SEQUOIA.seed_weight).resized(4)
    assert sampled.counts.observations == SEQUOIA.seed_weight == learned.observations(False)["sequoia"]
    assert sampled.vector() == seeded.vector() and sampled.vector()[0] > 0.9 > cold.vector()[0]
    add_greedy_row = learned.rank_learner(request())
    add_greedy_row.observe(three_children(), {0: 3})             # what greedy rows learn later is not a seed
    assert learned.rank_learner(request(greedy=False)).counts.observations == SEQUOIA.seed_weight
    sampled.observe(three_children(), {0: 3})
    learned.save()
    path = learned.ranks.snapshot(False).path
    assert RankCounts.from_dict(json.loads(path.read_text())).observations == 1   # the row's own, not the seed
    path.write_text(json.dumps({"version": 1, "tried": [SEQUOIA.frozen_at, 900], "hits": [1100, 300]}))
    frozen = Learned("pair", home=tmp_path).rank_learner(request(greedy=False))
    assert frozen.frozen and frozen.counts.observations == SEQUOIA.frozen_at
    assert Learned("pair", home=tmp_path).calibrator(request(greedy=False)).counts.observations == 0


BAD = ["{not json", "[]", json.dumps({"version": 2}),
       json.dumps({"version": 1, "tried": [1], "hits": [5]}),                              # more hits than tries
       json.dumps({"version": 1, **{k: [[0.0]] for k in AcceptanceCounts.zeros().to_dict()}})]   # wrong shapes


@pytest.mark.parametrize("name", KINDS)
@pytest.mark.parametrize("text", BAD)
def test_a_corrupt_file_is_a_warning_line_not_a_traceback(tmp_path, capsys, name, text):
    kind, learner_of, add, _ = KINDS[name]
    learned = Learned("pair", home=tmp_path)
    path = (learned.ranks if kind is SEQUOIA else learned.calibration).snapshot(True).path
    path.parent.mkdir(parents=True)
    path.write_text(text)
    fresh = Learned("pair", home=tmp_path)
    learner = learner_of(fresh, request())
    assert learner.counts.observations == 0
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"offspec: warning: ignoring the {kind.folder} cache")
    add(learner, {0: 2})
    fresh.save()                                                 # replaced by what this run learned
    assert kind.from_dict(json.loads(path.read_text())).observations == learner.counts.observations > 0


def test_acceptance_counts_round_trip_through_their_dict():
    counts = observe(three_children(), {0: 2, 1: None})
    back = AcceptanceCounts.from_dict(json.loads(json.dumps(counts.to_dict())))
    assert all(torch.equal(a, b) for a, b in zip(back._fields(), counts._fields()))
    assert (counts - counts).observations == 0 and (counts + counts).observations == 2 * counts.observations


def test_pair_key_names_weights_and_how_they_are_held(monkeypatch):
    class Ckpt:
        def __init__(self, fp, quant="none"):
            self.fp, self.quant = fp, quant

        def fingerprint(self):
            return self.fp

    a, b = Ckpt("a:1"), Ckpt("b:2")
    key = pair_key(a, b, target_quant="none", draft_quant="none", dtype=torch.float32)
    assert key == pair_key(a, b, target_quant="none", draft_quant="none", dtype=torch.float32)
    assert key != pair_key(a, b, target_quant="none", draft_quant="int8", dtype=torch.float32)
    assert key != pair_key(a, a, target_quant="none", draft_quant="none", dtype=torch.float32)
    assert key != pair_key(a, b, target_quant="none", draft_quant="none", dtype=torch.float32, twin=True)
    assert pair_key(a, None, target_quant="none", draft_quant="none", dtype=torch.float32) is None
    held = pair_key(a, b, target_quant="none", draft_quant="int4", dtype=torch.float32, twin=True)
    monkeypatch.setattr(int4, "GROUP", 64)      # an int4 draft in other groups accepts otherwise: its own caches
    assert held != pair_key(a, b, target_quant="none", draft_quant="int4", dtype=torch.float32, twin=True)
    awq_128, awq_64 = Ckpt("c:3", quant="awq-g128"), Ckpt("c:3", quant="awq-g64")   # a twin in the source's groups
    assert pair_key(a, awq_128, target_quant="none", draft_quant="int4", dtype=torch.float32, twin=True) != \
        pair_key(a, awq_64, target_quant="none", draft_quant="int4", dtype=torch.float32, twin=True)


def test_calibrated_rows_start_from_the_pairs_earlier_runs(tmp_path):
    """Two engines of one pair, one after the other, dyspec with --calibrate: the second's rows start from the
    counts the first's rows observed (saved at close), and both emit the target's plain greedy tokens."""
    target, draft, _ = save_agreeing_pair(tmp_path, n_layers=2)
    runtime = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32)
    tree = TreeConfig(policy="dyspec", budget=8, calibrate=True)
    prompts = [tuple(range(5, 25)), (7, 9, 11)]
    observed, outputs = [], []
    for _ in range(2):
        engine = load_engine(target, draft, OffloadConfig(mode="none"), runtime, progress=False).engine
        try:
            start = engine.learned.calibrator(GenerationRequest(prompt_ids=(1,), tree=tree)).counts.observations
            assert start == sum(observed)
            for p in prompts:
                req = GenerationRequest(prompt_ids=p, max_new_tokens=12, tree=tree, ignore_eos=True)
                steps = list(engine.generate(req))
                observed.append(sum(s.acceptance_counts.observations for s in steps if s.acceptance_counts))
                plain = engine.generate(GenerationRequest(prompt_ids=p, max_new_tokens=12, ignore_eos=True,
                                                          tree=TreeConfig(policy="none")))
                outputs.append(([t for s in steps for t in s.tokens], [t for s in plain for t in s.tokens]))
        finally:
            engine.close()
    assert sum(observed) > 0 and all(spec == plain for spec, plain in outputs)
