"""The one generation loop. Every consumer (CLI, batch, bench) iterates `Engine.generate` and reads Steps.

Cache bookkeeping, with `seq` = prompt + emitted tokens and root = seq[-1] (the last committed token):
  target cache  holds seq[:Lt]; the next pass feeds seq[Lt:-1] (the prompt, in the first round; nothing
                later) followed by the tree [root, node 1, ..., node N-1].  Tree node j sits at slot
                len(seq) - 1 + j and RoPE position len(seq) - 1 + depth(j).
  draft cache   holds seq[:Ld]; each round first feeds seq[Ld:] (what the draft has not seen, ending with
                the root) to get the root's distribution, then one batched call per depth over the
                frontier; tree node j (j >= 1) sits at slot len(seq) + j - 1.
After verification both caches keep only the accepted path (compact), so no cache ever holds a rejected
token, and the bonus token becomes the next root.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from .config import AUTO_MAX_TREE_BUDGET, DEFAULT_PREFILL_CHUNK, SamplingConfig, TreeConfig
from .costmodel import BudgetPlanner
from .grow import grow
from .errors import InputError
from .kv_cache import KVCache
from .metrics import Step, Timer
from .model import Model
from .sampling import make_generator, process_logits
from .tree import TokenTree
from .vocab import SharedVocab, token_id_count


@dataclass(frozen=True)
class GenerationRequest:
    prompt_ids: tuple[int, ...]                 # the tokenized prompt (chat template already applied)
    max_new_tokens: int = 128                   # stop after this many generated tokens
    stop_strings: tuple[str, ...] = ()          # stop when the text contains one (not emitted)
    tree: TreeConfig = TreeConfig()             # growth policy, budget, threshold
    sampling: SamplingConfig = SamplingConfig()  # temperature, top-p, top-k, seed
    ignore_eos: bool = False                    # benchmarks: always generate max_new_tokens

    def __post_init__(self):
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InputError(f"max_new_tokens must be a whole number >= 1, not {self.max_new_tokens!r}")


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


class Engine:
    """A target (resident or streamed) and an optional resident draft, sharing one tokenizer.

    context, max_tree_budget and prefill_chunk are the memory plan's (load.Models.load passes them): the KV
    caches never hold more than `context` tokens, no tree has more than max_tree_budget nodes, and each
    layer runs over at most prefill_chunk rows at a time. n_shared: the token ids the draft may propose
    (vocab.py; Models.open counts those both tokenizers share); default: the tokenizer's own ids."""

    def __init__(self, target: Model, draft: Optional[Model], tokenizer, eos_ids: Sequence[int], *,
                 n_shared: Optional[int] = None, context: Optional[int] = None,
                 max_tree_budget: int = AUTO_MAX_TREE_BUDGET, prefill_chunk: int = DEFAULT_PREFILL_CHUNK, plan=None):
        self.target = target
        self.draft = draft
        self.tokenizer = tokenizer
        self.eos_ids = tuple(eos_ids)
        self.device = target.device
        self.max_context = target.cfg.max_position_embeddings
        self.vocab = None
        if draft is not None:
            self.max_context = min(self.max_context, draft.cfg.max_position_embeddings)
            # Draft and target rows may differ (padded vocabularies): every draft distribution goes through
            # self.vocab, which keeps proposals on the shared ids and gives p the target's width (vocab.py).
            if n_shared is None:
                n_shared = min(token_id_count(tokenizer), draft.cfg.vocab_size, target.cfg.vocab_size)
            self.vocab = SharedVocab(n_shared, draft_rows=draft.cfg.vocab_size, target_rows=target.cfg.vocab_size)
        if context is not None:
            self.max_context = min(self.max_context, context)
        self.max_tree_budget = max_tree_budget
        self.prefill_chunk = prefill_chunk
        self.plan = plan            # plan.MemoryPlan the engine was loaded by, for reports (None: built by hand)

    # ------------------------------------------------------------ the loop
    def weights_source(self) -> str:
        """Where the target's streamed layers come from, for the report (pinned or not, and why)."""
        host = getattr(self.target.layers, "host", None)
        if host is None:
            return "resident"
        return (f"{host.kind}, {'pinned' if host.pinned else 'pageable: ' + host.reason}"
                + (f"; reads: {host.io}" if host.io else ""))

    def close(self) -> None:
        """Stop the streamer's threads (a no-op for resident models)."""
        close = getattr(self.target.layers, "close", None)
        if close is not None:
            close()

    def speculative(self, request: GenerationRequest) -> bool:
        return request.tree.policy != "none" and self.draft is not None and request.tree.budget != 0

    def generate(self, request: GenerationRequest) -> Iterator[Step]:
        """Yield one Step per target pass until EOS, a stop string, max_new_tokens or the context end."""
        prompt = list(request.prompt_ids)
        if not prompt:
            raise InputError("the prompt is empty")
        speculative = self.speculative(request)
        if speculative and request.tree.budget is not None and request.tree.budget > self.max_tree_budget:
            raise InputError(f"a tree budget of {request.tree.budget} is more than the engine was planned for "
                             f"({self.max_tree_budget}); load it with a larger tree budget")
        planner = None
        if speculative and request.tree.budget is None:
            planner = BudgetPlanner(start=128 if self.device.type == "cuda" else 32, max_budget=self.max_tree_budget,
                                    max_depth=request.tree.max_depth)
        budget = (planner.max_budget if planner else request.tree.budget) if speculative else 0
        if len(prompt) + 1 >= self.max_context:
            raise InputError(f"the prompt has {len(prompt)} tokens but the context holds only {self.max_context}")
        # Prompt + generated tokens + one round's tree + the root, and never more than the context: a round's
        # tree shrinks to the room left before the context end, so no position or cache slot passes it.
        capacity = min(self.max_context, len(prompt) + request.max_new_tokens + budget + 2)
        t_cache = KVCache.for_model(self.target.cfg, capacity, self.target.dtype, self.device)
        d_cache = KVCache.for_model(self.draft.cfg, capacity, self.draft.dtype, self.device) if speculative else None
        sampling = request.sampling
        stops = StopChecker(self.tokenizer, () if request.ignore_eos else self.eos_ids, request.stop_strings,
                            request.max_new_tokens, context_tokens=self.max_context - 1 - len(prompt))
        seed_gen = torch.Generator().manual_seed(sampling.seed)   # seeds a fresh generator every round

        seq, generated = prompt, []
        # TreeConfig.prune: last round's C (its tree's lowest value) when that tree filled its budget; a round
        # with a larger budget (the auto planner probing) must reach below it, so it gets no floor.
        floor, floor_budget = 0.0, 0
        while True:
            generator = make_generator(int(torch.randint(0, 2**62, (1,), generator=seed_gen)), self.device)
            # Near the end of the context the tree shrinks so it still fits.
            room = self.max_context - len(seq) - 1
            round_budget = max(0, min(planner.next_budget() if planner else budget, room))
            with Timer(self.device) as draft_timer:
                if speculative and round_budget > 0:
                    tree = self._grow(seq, d_cache, request.tree, sampling, round_budget, generator,
                                      floor if round_budget <= floor_budget else 0.0)
                else:
                    tree = TokenTree.root_only(seq[-1])
            stream_before = self._stream_stats()
            with Timer(self.device) as target_timer:
                q_logits, pass_tokens = self._verify_pass(seq, t_cache, tree)   # (N, V)
            stream = self._stream_delta(stream_before)
            verdict = self._accept(tree, q_logits, sampling, generator)

            block = list(verdict.tokens) + [verdict.bonus]
            emitted, reason = stops.cut(generated, block)
            # Commit: both caches keep the root and the accepted path; the bonus is the next root.
            root_slot = len(seq) - 1
            t_cache.compact(torch.tensor([root_slot + j for j in [0, *verdict.nodes]], device=self.device), root_slot)
            if d_cache is not None and tree.size > 0:
                # The draft saw seq whole (root included) before the tree, then the working-tree nodes it ran on;
                # an accepted node it ran on sits at slot start + origin - 1. Those form a prefix of the path.
                start, origin = len(seq), tree.origin.tolist()
                seen = list(itertools.takewhile(lambda n: origin[n] >= 0, verdict.nodes))
                d_cache.compact(torch.tensor([start + origin[n] - 1 for n in seen], dtype=torch.long,
                                             device=self.device), start)
            if planner is not None:
                planner.observe(tree, draft_timer.seconds, target_timer.seconds, pass_tokens)
            full = tree.size > 0 and tree.size >= round_budget
            floor = float(tree.values[1:].min()) if request.tree.prune and full else 0.0
            floor_budget = round_budget
            seq = seq + block
            generated = generated + emitted
            yield Step(
                tokens=emitted, accepted=len(verdict.nodes), tree_size=tree.size, tree_depth=tree.depth,
                pass_tokens=pass_tokens,
                draft_seconds=draft_timer.seconds, target_seconds=target_timer.seconds,
                wait_seconds=stream.wait_seconds, transfer_seconds=stream.transfer_seconds,
                bytes_streamed=stream.bytes_streamed, prefetched_bytes=stream.prefetched_bytes,
                finish_reason=reason)
            if reason is not None:
                return

    # ------------------------------------------------------------ draft
    def _grow(self, seq: list[int], cache: KVCache, tree_cfg: TreeConfig, sampling: SamplingConfig,
              budget: int, generator: torch.Generator, floor: float) -> TokenTree:
        draft, dev = self.draft, self.device
        # Catch up: feed what the draft has not seen (ends with the root) and read the root's distribution.
        start = cache.length
        new = self.vocab.draft_input(torch.tensor([seq[start:]], device=dev))          # (1, T)
        T = new.shape[1]
        positions = torch.arange(start, start + T, device=dev)
        logits = draft.forward(new, positions[None], positions, PassMask(start, T, None, dev), cache,
                               logit_rows=torch.tensor([T - 1], device=dev), chunk=self.prefill_chunk)
        cache.set_length(start + T)
        root_dist = self.vocab.draft_distribution(logits[0, 0], sampling)               # (V_target,)
        committed = len(seq)          # == cache.length: tree node j goes to slot committed + j - 1
        root_pos = len(seq) - 1

        def draft_step(tree: TokenTree, frontier: torch.Tensor) -> torch.Tensor:
            """frontier (F,) working-tree node ids -> the draft's distributions at those nodes (F, V_target).
            Working node j's K/V lives at slot committed + j - 1; its mask row spans every working node
            (grow reuses the index of a dropped node, so an ancestor may sit after its descendant)."""
            frontier = frontier.to(dev)
            N = tree.n_nodes
            mask = torch.ones(frontier.numel(), committed + N - 1, dtype=torch.bool, device=dev)   # (F, S)
            mask[:, committed:] = tree.mask[frontier.cpu()][:, 1:].to(dev)
            logits = draft.forward(tree.tokens[frontier.cpu()].to(dev)[None],
                                   (root_pos + tree.depths[frontier.cpu()].to(dev))[None],
                                   committed + frontier - 1, mask[None], cache,
                                   chunk=self.prefill_chunk)                                      # (1, F, V_draft)
            return self.vocab.draft_distribution(logits[0], sampling)

        return grow(tree_cfg, sampling, seq[-1], root_dist, draft_step, budget, generator, expand_floor=floor)

    # ------------------------------------------------------------ target
    def _verify_pass(self, seq: list[int], cache: KVCache, tree: TokenTree) -> tuple[torch.Tensor, int]:
        """ONE target pass over [not-yet-cached prompt tokens] + [root + tree] -> (N, V) tree logits, tokens fed."""
        dev = self.device
        start = cache.length
        root_slot = len(seq) - 1
        pending = seq[start:root_slot]                      # the prompt in the first round, else empty
        P, N = len(pending), tree.tokens.numel()
        tokens = torch.tensor([pending + tree.tokens.tolist()], device=dev)               # (1, P+N)
        positions = torch.cat([torch.arange(start, root_slot), root_slot + tree.depths.cpu()]).to(dev)
        slots = torch.arange(start, root_slot + N, device=dev)                           # (P+N,)
        logits = self.target.forward(tokens, positions[None], slots, PassMask(start, P, tree.mask, dev), cache,
                                     logit_rows=torch.arange(P, P + N, device=dev), chunk=self.prefill_chunk)
        return logits[0], P + N                                                           # (N, V)

    @staticmethod
    def _accept(tree: TokenTree, q_logits: torch.Tensor, sampling: SamplingConfig, generator):
        from .accept import verify_greedy, verify_stochastic
        # q spans every row of the target, padding included, never cut to the draft's vocabulary; the tree's
        # draft distributions already have this width (SharedVocab.draft_distribution, vocab.py).
        if sampling.greedy:
            return verify_greedy(tree, q_logits)
        # q is processed row by row, only at the nodes verification visits (the accepted path): processing
        # all N rows (sorting for top-p) would cost several (N, V) temporaries, gigabytes for a large tree.
        return verify_stochastic(tree, lambda u: process_logits(q_logits[u], sampling), generator)

    # ------------------------------------------------------------ streaming stats
    def _stream_stats(self):
        stats = getattr(self.target.layers, "stats", None)
        return stats() if stats is not None else None

    def _stream_delta(self, before) -> "StreamDelta":
        now = self._stream_stats()
        if now is None or before is None:
            return StreamDelta(0.0, 0.0, 0, 0)
        # Disk mode moves a layer in two legs (read into staging, then copy into the slot); both count.
        moved = (now.transfer_s + now.read_s) - (before.transfer_s + before.read_s)
        return StreamDelta(wait_seconds=now.wait_s - before.wait_s, transfer_seconds=moved,
                           bytes_streamed=now.bytes - before.bytes,
                           prefetched_bytes=now.prefetched_bytes - before.prefetched_bytes)


def causal_rows(first_slot: int, n_rows: int, n_cols: int, device) -> torch.Tensor:
    """(n_rows, n_cols) bool: row i (the token at slot first_slot + i) sees every slot up to its own."""
    slots = torch.arange(first_slot, first_slot + n_rows, device=device)
    return torch.arange(n_cols, device=device)[None, :] <= slots[:, None]


class PassMask:
    """One forward's attention mask, built a block of rows at a time (model.MaskRows), so a long prompt
    never builds its whole (T, S) mask: `n_pending` causal rows for the not-yet-cached tokens at slots
    first_slot, first_slot + 1, ..., then (with a tree) the tree's N rows, which see every slot before the
    root and their own ancestors in the tree (tree_mask, (N, N)); the root sits at slot first_slot + n_pending.

    Example: 3 cached tokens, 2 pending (slots 3, 4), a root with one child (slots 5, 6); S = 7:
        slot 3  1111000        root  1111110
        slot 4  1111100        child 1111111
    """

    def __init__(self, first_slot: int, n_pending: int, tree_mask: Optional[torch.Tensor], device):
        self.first_slot, self.n_pending, self.device = first_slot, n_pending, device
        self.tree_mask = tree_mask.to(device) if tree_mask is not None else None        # (N, N)
        self.root_slot = first_slot + n_pending
        self.n_cols = self.root_slot + (tree_mask.shape[0] if tree_mask is not None else 0)   # S

    def __call__(self, a: int, b: int) -> torch.Tensor:
        """Rows a..b-1 -> (1, b - a, S) bool."""
        P = self.n_pending
        rows = torch.zeros(b - a, self.n_cols, dtype=torch.bool, device=self.device)
        if a < P:                                           # the pending prompt: causal
            rows[: min(b, P) - a] = causal_rows(self.first_slot + a, min(b, P) - a, self.n_cols, self.device)
        if b > P:                                           # tree rows: the whole committed prefix ...
            tree_rows = slice(max(a, P) - a, b - a)
            rows[tree_rows, : self.root_slot] = True
            rows[tree_rows, self.root_slot:] = self.tree_mask[max(a, P) - P: b - P]   # ... and their ancestors
        return rows[None]


@dataclass(frozen=True)
class StreamDelta:
    """What the streamer did during one target pass."""
    wait_seconds: float       # compute stood still waiting for a layer
    transfer_seconds: float   # time spent moving weights: disk reads plus copies (overlapped with compute)
    bytes_streamed: int
    prefetched_bytes: int = 0  # of those, already in their slots when the pass began (copied during drafting)


def run(engine: Engine, request: GenerationRequest, *, load_seconds: float = 0.0,
        offload: Optional[str] = None, on_text=None, on_step=None):
    """Drive the loop to the end: stream text deltas to `on_text`, return (RunReport, steps).
    offload: the mode for the report; default the engine's memory plan's ("none" for an engine without one)."""
    from .metrics import build_report
    from .prompt import IncrementalText

    text_stream = IncrementalText(engine.tokenizer, request.stop_strings)
    steps, generated = [], []
    for step in engine.generate(request):
        steps.append(step)
        generated += step.tokens
        if on_text is not None:
            delta = text_stream.delta(generated, final=step.finish_reason is not None)
            if delta:
                on_text(delta)
        if on_step is not None:
            on_step(step)
    report = build_report(
        steps, prompt_tokens=len(request.prompt_ids), text=text_stream.text(generated), load_seconds=load_seconds,
        tree_policy=request.tree.policy if engine.speculative(request) else "none",
        tree_budget=request.tree.budget if engine.speculative(request) else 0,
        offload=offload or (engine.plan.mode if engine.plan is not None else "none"), device=engine.device, dtype=engine.target.dtype, weights_source=engine.weights_source(),
        memory_plan=engine.plan.to_dict() if engine.plan is not None else None)
    return report, steps
