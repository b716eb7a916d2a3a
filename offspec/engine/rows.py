"""One request in flight in the generation loop: its stop rules, state and commit, and what a pass cost it."""
from __future__ import annotations

import itertools
from dataclasses import asdict, dataclass, field
from typing import Any, Optional, Sequence

import torch

from offspec.engine.controller import Controller
from offspec.engine.metrics import Step
from offspec.engine.request import GenerationRequest
from offspec.errors import InputError
from offspec.model.kv_cache import KVCache
from offspec.spec.calibrate import Calibrator, observe
from offspec.spec.sampling import make_generator
from offspec.spec.sequoia import RankLearner
from offspec.spec.tree import TokenTree


class StopChecker:
    """EOS ids, stop strings, max_new_tokens and the context end, honored inside an accepted block: nothing
    after the stop is emitted.

    context_tokens: how many tokens fit before the context ends. Plain decoding stops once the sequence is
    one short of the context (the next token would have no position to be fed at); a speculative block
    could run one past that, so it is cut there too and both stop at the same token."""

    def __init__(self, tokenizer, eos_ids: Sequence[int], stop_strings: Sequence[str], max_new_tokens: int,
                 context_tokens: Optional[int] = None):
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.max_new_tokens = max_new_tokens
        self.context_tokens = context_tokens
        # A stop string that ends at the newest token lies within its last `window` tokens (a character
        # takes at most 4 byte-level tokens), so only that tail is decoded: earlier occurrences would have
        # stopped generation already, and decoding the whole text per token would be quadratic.
        self.window = 4 * max((len(s) for s in self.stop_strings), default=0) + 8

    def cut(self, generated: list[int], block: list[int]) -> tuple[list[int], Optional[str]]:
        """Given tokens emitted so far and a new block, return the part of the block to emit and why we stop."""
        for i, token in enumerate(block):
            if token in self.eos_ids:
                return block[:i], "eos"
            if self.stop_strings:
                tail = (generated + block[: i + 1])[-self.window:]
                text = self.tokenizer.decode(tail, skip_special_tokens=True)
                if any(s in text for s in self.stop_strings):
                    return block[: i + 1], "stop"   # IncrementalText cuts the text at the stop string
            if len(generated) + i + 1 >= self.max_new_tokens:
                return block[: i + 1], "length"
            if self.context_tokens is not None and len(generated) + i + 1 >= self.context_tokens:
                return block[: i + 1], "context"
        return block, None


@dataclass(frozen=True)
class RowStep:
    """What Engine.run_batch yields: one request's Step of a pass, or the error that refused the request."""
    request: int                        # index of the request in the sequence given to run_batch
    step: Optional[Step]                # None when the request was refused
    error: Optional[InputError] = None  # why it was refused (an empty prompt, one longer than the context, ...)


@dataclass
class Row:
    """One request in flight: its sequence, cache row, randomness, stop state and tree budget."""
    index: int                          # its position in run_batch's requests
    request: GenerationRequest
    cache_row: int                      # its row in both KV caches
    seq: list[int]                      # prompt + every token emitted so far; seq[-1] is the next root
    stops: StopChecker
    seed_gen: torch.Generator           # seeds a fresh generator every round, from request.sampling.seed
    speculative: bool
    auto: bool                          # the tree budget is chosen each round by the run's Controller
    budget: int                         # the most tree nodes a round may have (0: plain decoding)
    generated: list[int] = field(default_factory=list)   # emitted tokens (seq minus the prompt, cut at a stop)
    calibrator: Optional[Calibrator] = None   # TreeConfig.calibrate: this row's observed acceptance rates
    ranks: Optional[RankLearner] = None       # policy "sequoia": this row's acceptance by rank (pair_cache.py)
    floor: float = 0.0                  # TreeConfig.prune: last round's C, when that tree filled its budget
    floor_budget: int = 0               # ... and that round's budget
    generator: Optional[torch.Generator] = None   # this round's randomness (growth and verification)
    round_budget: int = 0               # this round's tree budget
    round_depth: int = 0                # this round's deepest tree level
    round_feed: Optional[int] = None    # this round feeds only this many prompt tokens (a long prompt joining)
    round_floor: float = 0.0            # this round's expand floor

    def start_round(self, wanted: int, max_context: int, device: torch.device) -> None:
        """This round's generator and tree: `wanted` nodes (the controller's, or the row's own), fewer near the
        end of the context, and no deeper than the row's last tokens need: a round emits at most its accepted
        path and the bonus token, so with L tokens left a node deeper than L - 1 cannot be used (L = 1: no tree)."""
        self.generator = make_generator(int(torch.randint(0, 2**62, (1,), generator=self.seed_gen)), device)
        room = max_context - len(self.seq) - 1
        self.round_depth = min(self.request.tree.max_depth, self.tokens_left() - 1)
        self.round_budget = max(0, min(wanted, room)) if self.speculative and self.round_depth > 0 else 0
        # A round with a larger budget than the floor's (the controller probing) must reach below it: no floor.
        self.round_floor = self.floor if self.round_budget <= self.floor_budget else 0.0

    def held_shallow(self) -> bool:
        """This round's tree was held shallower by the row's last tokens than its depth bound and its budget (a
        tree of N nodes is at most N deep) would have let it grow."""
        return self.round_depth < min(self.request.tree.max_depth, self.round_budget)

    def rank_acceptance(self) -> Optional[tuple[float, ...]]:
        """Policy "sequoia": the acceptance by rank this round's shape is built for (None: another policy)."""
        return self.ranks.vector() if self.ranks is not None else None

    def tokens_left(self) -> int:
        """The most tokens it may still generate: to its max_new_tokens or the context end (EOS may come first)."""
        end = min(self.stops.max_new_tokens, self.stops.context_tokens or self.stops.max_new_tokens)
        return max(end - len(self.generated), 0)

    def commit(self, batch: "Batch", tree: TokenTree, verdict, judged: dict[int, Optional[int]],
               step_of: "PassCost", fed: int) -> Step:
        """Emit the accepted block (cut at a stop), keep only the root and accepted path in both caches; the
        bonus token is the next root. `judged`: the child the target accepted at each node whose children were
        judged (calibrate.judged_greedy / judged_path), what the tree says about acceptance; fed: the tokens this
        row fed the pass."""
        observed = observe(tree, judged)
        if self.calibrator is not None:
            self.calibrator.add(observed)
        by_rank = self.ranks.observe(tree, judged) if self.ranks is not None and tree.size > 0 else None
        block = list(verdict.tokens) + [verdict.bonus]
        emitted, reason = self.stops.cut(self.generated, block)
        dev, root_slot = batch.device, len(self.seq) - 1
        batch.t_cache.compact(torch.tensor([root_slot + j for j in [0, *verdict.nodes]], device=dev), root_slot,
                              self.cache_row)
        if batch.d_cache is not None and tree.size > 0:
            # The draft saw seq whole (root included) before the tree, then the working-tree nodes it ran on;
            # an accepted node it ran on sits at slot start + origin - 1. Those form a prefix of the path.
            start, origin = len(self.seq), tree.origin.tolist()
            seen = list(itertools.takewhile(lambda n: origin[n] >= 0, verdict.nodes))
            batch.d_cache.compact(torch.tensor([start + origin[n] - 1 for n in seen], dtype=torch.long, device=dev),
                                  start, self.cache_row)
        full = tree.size > 0 and tree.size >= self.round_budget
        self.floor = float(tree.values[1:].min()) if self.request.tree.prune and full else 0.0
        self.floor_budget = self.round_budget
        self.seq = self.seq + block
        self.generated = self.generated + emitted
        return step_of.step(fed, tokens=emitted, accepted=len(verdict.nodes), tree_size=tree.size,
                            tree_depth=tree.depth, finish_reason=reason,
                            acceptance_counts=observed if tree.size > 0 else None, rank_counts=by_rank)


@dataclass(frozen=True)
class PassCost:
    """What one round cost, shared by every row's Step (its times and bytes are the whole pass's)."""
    draft_seconds: float                # catch-up + growth
    target_seconds: float               # the target pass
    stream: "StreamDelta"               # what the streamer did during the pass
    rows_in_pass: int

    def step(self, fed: int, **row) -> Step:
        """A row's Step of this round: `fed` tokens in the pass, and the row's own fields."""
        return Step(pass_tokens=fed, draft_seconds=self.draft_seconds, target_seconds=self.target_seconds,
                    **asdict(self.stream), rows_in_pass=self.rows_in_pass, **row)


@dataclass
class Batch:
    """run_batch's state: the rows in flight, their caches (one cache row each) and the controller."""
    t_cache: KVCache
    d_cache: Optional[KVCache]          # None: no row is speculative
    capacity: int                       # slots a cache row holds
    most: int                           # cache rows (the most rows in flight)
    controller: Controller
    device: torch.device
    rows: list = field(default_factory=list)     # Rows in flight
    free: list = field(default_factory=list)     # free cache rows, the next one last
    stream_seen: Any = None             # the streamer's counters at the end of the last round (StreamStats)


@dataclass(frozen=True)
class StreamDelta:
    """What the streamer did during one target pass (named as the Step fields it fills)."""
    wait_seconds: float       # compute stood still waiting for a layer
    transfer_seconds: float   # time spent moving weights: disk reads plus copies (overlapped with compute)
    bytes_streamed: int
    prefetched_bytes: int = 0  # of those, already in their slots when the pass began (copied during drafting)
    dequant_seconds: float = 0.0   # quantized target: dequantizing its streamed layers (overlapped like the copies)

    @classmethod
    def between(cls, before, now) -> "StreamDelta":
        """What the streamer counted from one reading of its StreamStats to the next (either None: nothing)."""
        if now is None or before is None:
            return cls(0.0, 0.0, 0, 0)
        # Disk mode moves a layer in two legs (read into staging, then copy into the slot); both count.
        moved = (now.transfer_s + now.read_s) - (before.transfer_s + before.read_s)
        return cls(wait_seconds=now.wait_s - before.wait_s, transfer_seconds=moved,
                   bytes_streamed=now.bytes - before.bytes,
                   prefetched_bytes=now.prefetched_bytes - before.prefetched_bytes,
                   dequant_seconds=now.dequant_s - before.dequant_s)
