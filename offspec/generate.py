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

from .config import SamplingConfig, TreeConfig
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


class StopChecker:
    """EOS ids and stop strings, honored inside an accepted block: nothing after the stop is emitted."""

    def __init__(self, tokenizer, eos_ids: Sequence[int], stop_strings: Sequence[str], max_new_tokens: int):
        self.tokenizer = tokenizer
        self.eos_ids = set(eos_ids)
        self.stop_strings = [s for s in stop_strings if s]
        self.max_new_tokens = max_new_tokens
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
        return block, None


class Engine:
    """A target (resident or streamed) and an optional resident draft, sharing one tokenizer."""

    def __init__(self, target: Model, draft: Optional[Model], tokenizer, eos_ids: Sequence[int],
                 n_shared: Optional[int] = None):
        """n_shared: the token ids the draft may propose (vocab.py; load_engine passes the count both tokenizers
        share); default: the tokenizer's own ids."""
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

    # ------------------------------------------------------------ the loop
    def weights_source(self) -> str:
        """Where the target's streamed layers come from, for the report (pinned or not, and why)."""
        host = getattr(self.target.layers, "host", None)
        if host is None:
            return "resident"
        return f"{host.kind}, {'pinned' if host.pinned else 'pageable: ' + host.reason}"

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
        planner = None
        if speculative and request.tree.budget is None:
            planner = BudgetPlanner(start=128 if self.device.type == "cuda" else 32, max_depth=request.tree.max_depth)
        budget = (planner.max_budget if planner else request.tree.budget) if speculative else 0
        if len(prompt) + 1 >= self.max_context:
            raise InputError(f"the prompt has {len(prompt)} tokens but the context holds only {self.max_context}")
        # Prompt + generated tokens + one round's tree + the root; positions never pass the context, but the
        # draft's cache slots (working-tree nodes) may, so only the target's cache is capped by it.
        needed = len(prompt) + request.max_new_tokens + budget + 2
        t_cache = KVCache.for_model(self.target.cfg, min(self.max_context, needed), self.target.dtype, self.device)
        d_cache = KVCache.for_model(self.draft.cfg, needed, self.draft.dtype, self.device) if speculative else None
        sampling = request.sampling
        stops = StopChecker(self.tokenizer, () if request.ignore_eos else self.eos_ids, request.stop_strings,
                            request.max_new_tokens)
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
            if reason is None and len(seq) + 1 >= self.max_context:
                reason = "context"
            yield Step(
                tokens=emitted, accepted=len(verdict.nodes), tree_size=tree.size, tree_depth=tree.depth,
                pass_tokens=pass_tokens,
                draft_seconds=draft_timer.seconds, target_seconds=target_timer.seconds,
                wait_seconds=stream.wait_seconds, transfer_seconds=stream.transfer_seconds,
                bytes_streamed=stream.bytes_streamed, finish_reason=reason)
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
        mask = causal_rows(start, T, start + T, dev)                                    # (T, start+T)
        logits = draft.forward(new, positions[None], positions, mask[None], cache,
                               logit_rows=torch.tensor([T - 1], device=dev))
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
                                   committed + frontier - 1, mask[None], cache)                   # (1, F, V_draft)
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
        S = root_slot + N
        mask = torch.zeros(P + N, S, dtype=torch.bool, device=dev)
        mask[:P] = causal_rows(start, P, S, dev)             # the pending prompt: causal
        mask[P:, :root_slot] = True                          # tree rows see the whole committed prefix
        mask[P:, root_slot:] = tree.mask.to(dev)             # ... and their ancestors in the tree
        logits = self.target.forward(tokens, positions[None], slots, mask[None], cache,
                                     logit_rows=torch.arange(P, P + N, device=dev))
        return logits[0], P + N                                                           # (N, V)

    @staticmethod
    def _accept(tree: TokenTree, q_logits: torch.Tensor, sampling: SamplingConfig, generator):
        from .accept import verify_greedy, verify_stochastic
        # q spans every row of the target, padding included, never cut to the draft's vocabulary; the tree's
        # draft distributions already have this width (SharedVocab.draft_distribution, vocab.py).
        if sampling.greedy:
            return verify_greedy(tree, q_logits)
        return verify_stochastic(tree, process_logits(q_logits, sampling), generator)

    # ------------------------------------------------------------ streaming stats
    def _stream_stats(self):
        stats = getattr(self.target.layers, "stats", None)
        return stats() if stats is not None else None

    def _stream_delta(self, before) -> "StreamDelta":
        now = self._stream_stats()
        if now is None or before is None:
            return StreamDelta(0.0, 0.0, 0)
        # Disk mode moves a layer in two legs (read into staging, then copy into the slot); both count.
        moved = (now.transfer_s + now.read_s) - (before.transfer_s + before.read_s)
        return StreamDelta(wait_seconds=now.wait_s - before.wait_s, transfer_seconds=moved,
                           bytes_streamed=now.bytes - before.bytes)


def causal_rows(first_slot: int, n_rows: int, n_cols: int, device) -> torch.Tensor:
    """(n_rows, n_cols) bool: row i (the token at slot first_slot + i) sees every slot up to its own."""
    slots = torch.arange(first_slot, first_slot + n_rows, device=device)
    return torch.arange(n_cols, device=device)[None, :] <= slots[:, None]


@dataclass(frozen=True)
class StreamDelta:
    """What the streamer did during one target pass."""
    wait_seconds: float       # compute stood still waiting for a layer
    transfer_seconds: float   # time spent moving weights: disk reads plus copies (overlapped with compute)
    bytes_streamed: int


def run(engine: Engine, request: GenerationRequest, *, load_seconds: float = 0.0,
        offload: str = "none", on_text=None, on_step=None):
    """Drive the loop to the end: stream text deltas to `on_text`, return (RunReport, steps)."""
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
        offload=offload, device=engine.device, dtype=engine.target.dtype, weights_source=engine.weights_source())
    return report, steps
