"""Several drafts given (--draft DIR --draft self): the plan takes, of those that fit, each in turn until each has
been measured on this machine, then the fastest by its recorded seconds a token (engine/draft_records.py). The
engine records only decoding rounds; the output never depends on which draft ran."""
import json

import pytest
import torch
from test_cli import cli, ok
from tiny import save_agreeing_pair

from offspec.config import OffloadConfig, RuntimeConfig, TreeConfig
from offspec.engine import draft_records
from offspec.engine.draft_records import MIN_TOKENS, DraftLog, Measured, choose, read_record
from offspec.engine.generate import GenerationRequest, run
from offspec.engine.load import SELF_DRAFT, Models
from offspec.errors import BudgetError
from offspec.plan.machine import Machine

RUNTIME = RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    return save_agreeing_pair(tmp_path_factory.mktemp("choice"), n_layers=2)[:2]  # (target, draft) folders


def test_choose_measures_each_draft_in_turn_then_takes_the_fastest():
    few, slow, fast = Measured(1.0, MIN_TOKENS - 1, 3), Measured(4.0, 40, 9), Measured(2.0, 40, 9)
    assert choose(["a", "b"], [Measured(), Measured()])[0] == 0
    index, why = choose(["a", "b"], [slow, few])
    assert index == 1 and "to measure it" in why
    index, why = choose(["a", "b"], [slow, fast])
    assert index == 1 and "b: the fastest measured" in why and "0.05 s/token over 40 tokens" in why
    index, why = choose(["a", "b"], [Measured(40.0, 401, 90), slow])     # b looked slow once; a has > 10x its tokens
    assert index == 1 and "to measure it again" in why
    assert choose(["a", "b"], [Measured(20.0, 390, 90), slow])[0] == 0


def test_logs_add_up_in_one_file_and_a_bad_file_counts_as_none(capsys):
    for seconds, tokens in ((1.0, 10), (3.0, 30)):
        log = DraftLog("k", "self")
        log.add(seconds / 2, tokens // 2)
        log.add(seconds / 2, tokens - tokens // 2)
        log.save()
        log.save()                                      # nothing new: nothing added twice
    assert read_record("k") == Measured(4.0, 40, 4)
    (draft_records.records_dir() / "bad.json").write_text("{not json")
    assert read_record("bad") == Measured() and "ignoring the draft record" in capsys.readouterr().err


def test_an_engine_records_its_decoding_rounds_not_the_prefill(pair):
    target, draft = pair
    models = Models.open(target, draft)
    loaded = models.load(OffloadConfig(), RUNTIME, progress=False)
    try:
        request = GenerationRequest(prompt_ids=tuple(range(5, 20)), max_new_tokens=24, ignore_eos=True,
                                    tree=TreeConfig(policy="dyspec", budget=8))
        report, steps = run(loaded.engine, request)
    finally:
        loaded.engine.close()
    key = loaded.engine.draft_log.key
    assert read_record(key).tokens == report.new_tokens - len(steps[0].tokens)
    assert read_record(key).rounds == report.passes - 1
    assert read_record(key).seconds == pytest.approx(report.decode_seconds)


def test_the_plan_takes_each_draft_in_turn_then_the_fastest(pair):
    target, draft = pair

    def chosen():
        models = Models.open(target, [draft, SELF_DRAFT])
        plan = models.plan(OffloadConfig(), RUNTIME)
        (kept,) = models.drafts
        assert models.plan(OffloadConfig(), RUNTIME).draft_quant == plan.draft_quant     # planned again: the same
        key = models._record_key(kept, plan, RUNTIME)
        models.target.close()
        kept.ckpt.close()
        return kept.label, plan, key

    first, plan, key_a = chosen()
    assert first != SELF_DRAFT and plan.draft_quant == "none" and "to measure it" in plan.notes[-1]
    DraftLog(key_a, first).add(9.0, MIN_TOKENS)
    DraftLog(key_a, first).save()                       # nothing added: a log saves only its own rounds
    log = DraftLog(key_a, first)
    log.add(9.0, MIN_TOKENS)
    log.save()
    second, plan, key_b = chosen()
    assert second == SELF_DRAFT and plan.draft_quant == "int8"     # each draft held as it would be alone
    log = DraftLog(key_b, second)
    log.add(1.0, MIN_TOKENS)
    log.save()
    again, plan, _ = chosen()
    assert again == SELF_DRAFT and "self: the fastest measured" in plan.notes[-1]


def test_a_draft_that_does_not_fit_is_left_out_and_none_fitting_is_refused(pair):
    target, draft = pair
    alone = Models.open(target, None).plan(OffloadConfig(mode="cpu"), RUNTIME, machine=Machine("cpu", 8 << 30,
                                                                                                 8 << 30, "given"))
    need = alone.total("device") + alone.total("host")
    tight = Machine("cpu", need + (64 << 10), need + (64 << 10), "given")
    models = Models.open(target, [draft, SELF_DRAFT])
    with pytest.raises(BudgetError, match="no draft fits beside the target: draft .* does not fit"):
        models.plan(OffloadConfig(mode="cpu"), RUNTIME, machine=tight)
    models.target.close()


def test_cli_takes_each_draft_in_turn_with_the_same_output(pair, tmp_path):
    """The first runs measure the draft given first (until its record holds MIN_TOKENS: a run here stops at EOS
    after about 30), then the twin, then the fastest; every run writes the target's own greedy tokens."""
    target, draft = pair
    args = ["generate", "--target", target, "--draft", draft, "--draft", "self", "--device", "cpu", "--dtype",
            "float32", "--max-new-tokens", "40", "--tree-budget", "8", "--raw", "--json"]
    texts, twins, notes = [], [], []
    for i in range(5):
        out = ok(cli(*args, str(tmp_path / f"{i}.json"), "hello there"))
        report = json.loads((tmp_path / f"{i}.json").read_text())
        texts.append(out.stdout)
        twins.append(report["draft_twin"])
        notes.append(report["memory_plan"]["notes"][-1])
    assert len(set(texts)) == 1                              # greedy float32: the target's tokens, either way
    first_twin = twins.index(True)
    assert 0 < first_twin < 4 and not any(twins[:first_twin])
    assert "to measure it" in notes[0] and "the fastest measured" in notes[-1]


def test_the_demo_defaults_offer_the_twin_beside_the_draft_only_where_the_target_streams(pair):
    """No --target and no --draft: the demo draft and the demo target's twin, optional (cli.options.resolve_models):
    the twin is a candidate only where the target, planned alone, streams."""
    target, draft = pair
    roomy = Machine("cpu", 8 << 30, 8 << 30, "given")
    for offload, candidates in (("none", 1), ("cpu", 2)):
        models = Models.open(target, [draft, SELF_DRAFT], optional_twin=True)
        plan = models.plan(OffloadConfig(mode=offload), RUNTIME, machine=roomy)
        (kept,) = models.drafts
        assert not kept.twin                                      # the first given is measured first
        assert any("to measure it" in n for n in plan.notes) == (candidates == 2)
        assert not any("stays resident" in n for n in plan.notes)    # said only where the target runs alone
        models.target.close()
        kept.ckpt.close()
