"""scripts/peer_hf.py, the transformers peer, on tiny random models (CPU, seconds): the assisted settings reach
transformers (read back from the candidate generator it built), the target's passes are counted, the old way of
passing them (on the target's generation_config) is shown to leave transformers' defaults in force, and the sweep's
best setting is the one with the lowest median."""

import pytest
import torch
from scripts_module import load_script
from tiny import hf_config, make_model, perturbed_copy

PROMPT = [1, 10, 11, 12, 13, 14, 15]
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def bp():
    return load_script("peer_hf")


@pytest.fixture(scope="module")
def models():
    """A target with peaked logits and a draft that mostly agrees with it (as the demo 0.5B does with the 1.5B)."""
    target = make_model(hf_config("llama", n_layers=2), scale=4.0)
    return target, perturbed_copy(target, noise=0.01)


@pytest.fixture(scope="module")
def plain(bp, models):
    return bp.hf_generate(models[0], PROMPT, NEW_TOKENS)


def test_plain_generate_counts_one_pass_per_token(bp, plain):
    run = plain
    assert 0 < len(run.tokens) <= NEW_TOKENS
    assert run.passes == len(run.tokens) and run.max_draft_tokens == 0 and run.settings is None
    cell = bp.peer_cell(run)
    assert cell["passes"] == run.passes and cell["tokens_per_pass"] == 1.0 and "peer_settings" not in cell


@pytest.mark.parametrize("k, threshold", [(2, 0.0), (4, 0.0), (8, 0.25)])
def test_assisted_settings_reach_transformers_and_are_read_back(bp, models, plain, k, threshold):
    target, draft = models
    asked = bp.AssistSettings(num_assistant_tokens=k, schedule="constant", confidence_threshold=threshold)
    run = bp.hf_generate(target, PROMPT, NEW_TOKENS, draft, asked)
    assert run.tokens == plain.tokens                  # greedy and lossless, in float32
    used = run.settings
    assert (used["num_assistant_tokens"], used["num_assistant_tokens_schedule"],
            used["assistant_confidence_threshold"]) == (k, "constant", threshold)
    assert used["num_assistant_tokens_final"] == k
    # Passes: at least one, fewer than tokens (the draft helps), and never more than k + 1 tokens a pass.
    assert 0 < run.passes < len(run.tokens)
    assert len(run.tokens) <= run.passes * (k + 1)
    assert 0 < run.max_draft_tokens <= k
    if threshold == 0.0:                               # nothing cuts a draft short of k (nor re-fits a threshold)
        assert run.max_draft_tokens == k and used["assistant_confidence_threshold_final"] == 0.0
    cell = bp.peer_cell(run)
    assert cell["peer_settings"] == used and cell["passes"] == run.passes
    assert cell["tokens_per_pass"] == pytest.approx(len(run.tokens) / run.passes) and cell["tokens_per_pass"] <= k + 1
    assert draft.generation_config.num_assistant_tokens is None     # the assistant's own config is left as it was
    assert draft.generation_config.assistant_confidence_threshold is None


def test_heuristic_schedule_is_read_back_and_does_not_leak_into_the_next_call(bp, models):
    target, draft = models
    asked = bp.AssistSettings(num_assistant_tokens=3, schedule="heuristic", confidence_threshold=0.0)
    first = bp.hf_generate(target, PROMPT, NEW_TOKENS, draft, asked)
    assert first.settings["num_assistant_tokens_schedule"] == "heuristic"
    assert first.settings["num_assistant_tokens"] == 3
    assert first.settings["num_assistant_tokens_final"] != 3     # the schedule moved it during the run
    # transformers writes the final count back into the assistant's config (persistent "heuristic"); hf_generate
    # ran on a copy, so the next call starts from 3 again.
    second = bp.hf_generate(target, PROMPT, NEW_TOKENS, draft, asked)
    assert second.settings["num_assistant_tokens"] == 3
    assert second.tokens == first.tokens and second.passes == first.passes


def test_transformers_defaults_when_nothing_is_applied(bp, models):
    target, draft = models
    run = bp.hf_generate(target, PROMPT, NEW_TOKENS, draft, None)
    used = run.settings
    assert (used["num_assistant_tokens"], used["num_assistant_tokens_schedule"],
            used["assistant_confidence_threshold"]) == (20, "constant", 0.4)


def test_negative_control_settings_on_the_targets_config_are_not_used(bp, models, plain):
    """The code before issue #13 put the settings on the config passed to the TARGET's generate. transformers reads
    them from the assistant's generation_config, so the assistant ran its defaults: 20 tokens, threshold 0.4."""
    from transformers import GenerationConfig

    target, draft = models
    old_config = GenerationConfig(max_new_tokens=NEW_TOKENS, min_new_tokens=0, do_sample=False, eos_token_id=None,
                                  pad_token_id=0, num_assistant_tokens=4, num_assistant_tokens_schedule="constant",
                                  assistant_confidence_threshold=0.0)
    inputs = torch.tensor([PROMPT])
    with bp.PeerWatch(target) as watch, torch.no_grad():
        out = target.generate(inputs, attention_mask=torch.ones_like(inputs), generation_config=old_config,
                              assistant_model=draft)
    used = bp.peer_settings(watch.generators[0])
    assert (used["num_assistant_tokens"], used["assistant_confidence_threshold"]) == (20, 0.4)
    assert (used["num_assistant_tokens"], used["assistant_confidence_threshold"]) != (4, 0.0)
    # What the audit saw in the timings: passes that verified more draft tokens than the 4 asked for.
    assert max(watch.draft_tokens(len(PROMPT))) > 4
    assert out[0, len(PROMPT):].tolist() == plain.tokens


def test_best_setting_is_the_lowest_median_over_the_prompts_every_setting_ran(bp):
    def row(pid, regime, times):
        return {"kind": bp.SWEEP_KIND, "regime": regime, "prompt_set": "code", "id": pid,
                "systems": {label: {"seconds_per_token": t} for label, t in times.items()}}

    defaults, four = bp.assist_label(None), bp.assist_label(bp.SWEEP[1])
    rows = [row("a", "cpu", {defaults: 0.30, four: 0.20}), row("b", "cpu", {defaults: 0.10, four: 0.25}),
            row("c", "cpu", {defaults: 0.12, four: 0.22}), row("a", "disk", {defaults: 0.1})]
    best = bp.best_setting(rows, "cpu", "code")
    assert best["label"] == defaults and best["prompts"] == 3                  # medians 0.12 against 0.22
    assert best["assist"] == "transformers defaults" and bp.assist_of(best["assist"]) is None
    assert bp.assist_of(bp.assist_record(bp.SWEEP[1])) == bp.SWEEP[1]
    assert bp.best_setting(rows, "cpu", "chat") is None


def test_runner_cells_are_offspec_bench_cells(bp, models):
    """HfSystems.runner's cells carry what offspec.bench.runner.measure and the tables read."""
    from offspec.bench import runner as bench

    target, draft = models
    hf = bp.HfSystems.__new__(bp.HfSystems)
    hf.target, hf.draft, hf.eos_ids = target, draft, None
    rows = bench.measure([("p", PROMPT)], {"hf-plain": hf.runner(False), "hf-assisted": hf.runner(True, bp.SWEEP[1])},
                         8)
    cells = rows[0]["systems"]
    assert cells["hf-plain"]["tokens"] == cells["hf-assisted"]["tokens"] and len(cells["hf-plain"]["tokens"]) <= 8
    assert cells["hf-assisted"]["peer_settings"]["num_assistant_tokens"] == 4
    assert cells["hf-plain"]["passes"] == len(cells["hf-plain"]["tokens"]) and cells["hf-plain"]["seconds_per_token"] > 0
