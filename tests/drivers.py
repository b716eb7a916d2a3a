"""Drivers the tests run offspec's pieces with, where the product only runs them batched: one sequence's forward
(the engine packs many rows into Model.forward), one tree's growth answered by a callback (the engine grows
every row's tree in lockstep with grow.grow_steps)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from offspec.config import SamplingConfig, TreeConfig
from offspec.model.forward import MaskRows, Model, RowSpan
from offspec.model.kv_cache import KVCache
from offspec.spec.calibrate import Calibration
from offspec.spec.grow import grow_steps
from offspec.spec.ngram import NgramChain
from offspec.spec.tree import TokenTree

DraftStep = Callable[[TokenTree, torch.Tensor], torch.Tensor]   # (working tree, frontier (F,)) -> (F, V)


def forward_one(model: Model, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: Union[torch.Tensor, MaskRows], cache: KVCache, logit_rows: Optional[torch.Tensor] = None,
                chunk: Optional[int] = None, cache_row: int = 0) -> torch.Tensor:
    """Model.forward for one sequence: tokens, positions, slots (T,), mask (T, S) -> logits (R, V)."""
    spans = [RowSpan(0, slots.numel(), cache_row, slots, mask)]
    return model.forward(tokens, positions, spans, cache, logit_rows, chunk)


def grow(tree_cfg: TreeConfig, sampling: SamplingConfig, root_token: int, root_dist: torch.Tensor,
         draft_step: DraftStep, budget: int, generator: torch.Generator, expand_floor: float = 0.0, *,
         calibration: Optional[Calibration] = None, ngram: Sequence[NgramChain] = (),
         rank_acceptance: Optional[Sequence[float]] = None) -> TokenTree:
    """Grow one round's token tree with at most `budget` nodes besides the root, calling draft_step for every
    draft call (grow_steps' requests, answered one at a time)."""
    steps = grow_steps(tree_cfg, sampling, root_token, root_dist, budget, generator, expand_floor,
                       calibration=calibration, ngram=ngram, rank_acceptance=rank_acceptance)
    try:
        request = next(steps)
        while True:
            request = steps.send(draft_step(*request))
    except StopIteration as done:
        return done.value


def on_a_side_stream_without_syncs(work: Callable[[], None]) -> None:
    """work() issued on a CUDA side stream (as the ring's copy queue runs dequantization) with the sync debug mode
    at "error", so any hidden host synchronization inside it raises; then the stream is waited for."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    torch.cuda.set_sync_debug_mode("error")
    try:
        with torch.cuda.stream(side):
            work()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    side.synchronize()


def loaded_prompt_logits(model, prompt: Sequence[int], offload=None, resident_quant: str = "auto"):
    """The target `model` (a folder or file) loaded alone in float32 on the CPU as `offload` (default resident)
    says -> (its logits over `prompt` in one pass, (T, V); the load.Loaded, closed)."""
    from offspec.config import OffloadConfig, RuntimeConfig
    from offspec.engine.load import load_engine

    cpu = torch.device("cpu")
    loaded = load_engine(model, None, offload or OffloadConfig(),
                         RuntimeConfig(device=cpu, dtype=torch.float32, resident_quant=resident_quant), progress=False)
    try:
        eng, T = loaded.engine, len(prompt)
        cache = KVCache.for_model(eng.target.cfg, T, eng.target.dtype, cpu)
        mask = torch.arange(T)[:, None] >= torch.arange(T)[None]
        return forward_one(eng.target, torch.tensor(prompt), torch.arange(T), torch.arange(T), mask, cache), loaded
    finally:
        loaded.engine.close()


def assert_logits_as_published(model, reference, prompt: Sequence[int]) -> None:
    """A checkpoint read as published (`model`: a quantized folder or a GGUF file, loaded with no flag) gives the
    logits of `reference`, the dense folder of its dequantized weights, bit for bit: resident (dequantized at load),
    streamed from RAM and from the disk store, and held as published on the device (--resident-quant on); every
    load runs the checkpoint's own quantization."""
    from offspec.config import OffloadConfig
    from offspec.formats.open import open_checkpoint

    want, _ = loaded_prompt_logits(reference, prompt)
    quant = open_checkpoint(model).quant
    for offload in (OffloadConfig(), OffloadConfig(mode="cpu", n_slots=2), OffloadConfig(mode="disk", n_slots=2)):
        got, loaded = loaded_prompt_logits(model, prompt, offload)
        assert loaded.plan.target_quant == quant == loaded.engine.target_quant
        assert torch.equal(got, want), offload.mode
    got, loaded = loaded_prompt_logits(model, prompt, OffloadConfig(), resident_quant="on")
    assert loaded.plan.placement.resident_held and torch.equal(got, want)


def assert_speculative_greedy_is_plain(target, draft, prompt: Sequence[int], tree: TreeConfig) -> None:
    """`target` read as published (no flag), streamed from RAM beside `draft`, float32: speculative greedy with
    `tree` gives the plain greedy tokens of that quantized target, with trees that pay (more than 1.2 tokens a
    pass), and the report names the checkpoint's quantization."""
    from offspec.config import OffloadConfig, RuntimeConfig
    from offspec.engine.generate import GenerationRequest, run
    from offspec.engine.load import load_engine
    from offspec.formats.open import open_checkpoint

    loaded = load_engine(target, draft, OffloadConfig(mode="cpu", n_slots=2),
                         RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32), progress=False)
    try:
        plain, spec = (run(loaded.engine, GenerationRequest(prompt_ids=tuple(prompt), max_new_tokens=30, tree=t,
                                                            ignore_eos=True))[0]
                       for t in (TreeConfig(policy="none"), tree))
        assert spec.tokens == plain.tokens and spec.target_quant == open_checkpoint(target).quant
        assert spec.tokens_per_pass > 1.2
    finally:
        loaded.engine.close()
