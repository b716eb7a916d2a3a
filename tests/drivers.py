"""Drivers the tests run offspec's pieces with, where the product only runs them batched: one sequence's forward
(the engine packs many rows into Model.forward), one tree's growth answered by a callback (the engine grows
every row's tree in lockstep with grow.grow_steps)."""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Union

import torch

from offspec.calibrate import Calibration
from offspec.config import SamplingConfig, TreeConfig
from offspec.grow import grow_steps
from offspec.kv_cache import KVCache
from offspec.model import MaskRows, Model, RowSpan
from offspec.ngram import NgramChain
from offspec.tree import TokenTree

DraftStep = Callable[[TokenTree, torch.Tensor], torch.Tensor]   # (working tree, frontier (F,)) -> (F, V)


def forward_one(model: Model, tokens: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                mask: Union[torch.Tensor, MaskRows], cache: KVCache, logit_rows: Optional[torch.Tensor] = None,
                chunk: Optional[int] = None, cache_row: int = 0) -> torch.Tensor:
    """Model.forward for one sequence: tokens, positions, slots (T,), mask (T, S) -> logits (R, V)."""
    spans = [RowSpan(0, slots.numel(), cache_row, slots, mask)]
    return model.forward(tokens, positions, spans, cache, logit_rows, chunk)


def grow(tree_cfg: TreeConfig, sampling: SamplingConfig, root_token: int, root_dist: torch.Tensor,
         draft_step: DraftStep, budget: int, generator: torch.Generator, expand_floor: float = 0.0, *,
         calibration: Optional[Calibration] = None, ngram: Sequence[NgramChain] = ()) -> TokenTree:
    """Grow one round's token tree with at most `budget` nodes besides the root, calling draft_step for every
    draft call (grow_steps' requests, answered one at a time)."""
    steps = grow_steps(tree_cfg, sampling, root_token, root_dist, budget, generator, expand_floor,
                       calibration=calibration, ngram=ngram)
    try:
        request = next(steps)
        while True:
            request = steps.send(draft_step(*request))
    except StopIteration as done:
        return done.value
