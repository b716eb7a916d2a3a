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

from dataclasses import replace
from typing import Iterator, Optional, Sequence, Union

import torch

from offspec.config import AUTO_MAX_TREE_BUDGET, DEFAULT_PREFILL_CHUNK, SamplingConfig
from offspec.engine.controller import Controller
from offspec.engine.draft_records import DraftLog
from offspec.engine.feed import RequestFeed
from offspec.engine.mask import PassMask
from offspec.engine.metrics import Step, Timer, report_of, weights_source
from offspec.engine.pair_cache import Learned
from offspec.engine.request import GenerationRequest, RowLimits, check_request
from offspec.engine.rounds import DraftWork, RoundRecord, RowView, RunStart
from offspec.engine.rows import Batch, PassCost, Row, RowStep, StopChecker, StreamDelta
from offspec.errors import InputError
from offspec.model.forward import Model, RowSpan
from offspec.model.kv_cache import KVCache
from offspec.model.vocab import SharedVocab, token_id_count
from offspec.spec import ngram
from offspec.spec.calibrate import judged_greedy, judged_path
from offspec.spec.grow import grow_steps
from offspec.spec.sampling import process_logits
from offspec.spec.sequoia import chosen_policy
from offspec.spec.tree import TokenTree


class Engine:
    """A target (resident or streamed) and an optional resident draft, sharing one tokenizer.

    context, max_tree_budget, prefill_chunk and max_concurrency are the memory plan's (load.Models.load passes
    them): the KV caches never hold more than `context` tokens a row, no tree (and with the auto budget no
    pass, all rows' trees together, beyond a node a row) has more than max_tree_budget
    nodes, each layer runs over at most prefill_chunk rows at a time, and at most max_concurrency requests
    are in flight. n_shared: the token ids the draft may propose (vocab.py; Models.open counts those both
    tokenizers share); default: the tokenizer's own ids."""

    def __init__(self, target: Model, draft: Optional[Model], tokenizer, eos_ids: Sequence[int], *,
                 n_shared: Optional[int] = None, context: Optional[int] = None,
                 max_tree_budget: int = AUTO_MAX_TREE_BUDGET, prefill_chunk: int = DEFAULT_PREFILL_CHUNK,
                 max_concurrency: Optional[int] = None, plan=None, target_quant: str = "none",
                 draft_quant: str = "none", twin: bool = False, pair: Optional[str] = None,
                 draft_log: Optional[DraftLog] = None):
        self.target = target
        self.draft = draft
        self.draft_waited = 0.0         # seconds runs waited for a draft loading beside the first round
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
        self.max_context = min(self.max_context, context if context is not None else self.max_context)
        self.max_tree_budget = max_tree_budget
        self.prefill_chunk = prefill_chunk
        self.max_concurrency = max_concurrency   # requests in flight the plan counted (None: not planned)
        self.plan = plan            # plan.MemoryPlan the engine was loaded by, for reports (None: built by hand)
        # "none" | "int8" | "nf4" | published ("awq-g128"): which target runs (the output is ITS output)
        self.target_quant = target_quant
        self.draft_quant = draft_quant if draft is not None else "none"   # how the draft is held (draft_quant.QUANT_MODES)
        self.twin = twin and draft is not None     # the draft is the target's twin (--draft self: draft.load_twin)
        self.learned = Learned(pair)   # what the pair's runs learned about acceptance (pair_cache.py)
        self.draft_log = draft_log if draft is not None else None   # its decoding rounds, kept (draft_records.py)

    # ------------------------------------------------------------ the loop
    def weights_source(self) -> str:
        return weights_source(self.target.layers)

    def close(self) -> None:
        """Stop the streamer's threads, wait for a draft still loading, save what rows and rounds measured."""
        for close in (getattr(self.target.layers, "close", None), getattr(self.draft, "close", None), self.learned.save,
                      getattr(self.draft_log, "save", None)):
            if close is not None:
                close()

    def speculative(self, request: GenerationRequest) -> bool:
        return request.tree.policy != "none" and self.draft is not None and request.tree.budget != 0

    def generate(self, request: GenerationRequest) -> Iterator[Step]:
        """Yield one Step per target pass until EOS, a stop string, max_new_tokens or the context end: the
        batch of one (run_batch), a bad request refused with its InputError."""
        for event in self.run_batch([request], concurrency=1):
            if event.error is not None:
                raise event.error
            yield event.step

    def run_batch(self, requests: Union[Sequence[GenerationRequest], RequestFeed], concurrency: Optional[int] = None,
                  prefill_per_pass: Optional[int] = None, adapt_rows: Optional[bool] = None) -> Iterator[RowStep]:
        """Run many requests, up to `concurrency` at a time, every target pass serving all of them: yield a
        RowStep per request per pass (its Step, or the error that refused it) as passes complete. concurrency
        None: the memory plan's (plan.MemoryPlan.concurrency; 1 without a plan), adapted to the measured costs
        where the plan resolved it as auto.

        requests: a list (RowStep.request is the position in it), or a RequestFeed (feed.py) that may be put
        more requests while the batch runs (RowStep.request is the key it was put with): a free row takes the
        next waiting request before each pass; with no row in flight the batch waits for one, and it ends
        when the feed is closed and every row has finished.

        A request's output does not depend on which others share its passes: each row has its own caches'
        row, generator (seeded from its own sampling.seed), tree and stop state, and attention never looks
        across rows. A finished row's cache row is taken by the next waiting request before the next pass.

        A prompt that joins while other rows are decoding is fed in chunks of at most `prefill_per_pass` tokens
        a pass (None: auto, Controller.join_chunk), so a long prompt does not stall their passes; its Steps
        until then carry no tokens. A row alone, or every row joining, feeds its whole prompt in one pass
        (chunked within the pass by prefill_chunk): splitting it would only cost passes.

        adapt_rows (auto concurrency; None: as the plan says): `concurrency` is then the most rows in flight, and
        a finished row is refilled only while the controller's measured costs say another row raises tokens/s
        (Controller.rows_worth); the job starts with all of them, the cheapest way to measure."""
        feed = requests if isinstance(requests, RequestFeed) else RequestFeed.of(requests)
        if adapt_rows is None:
            adapt_rows = concurrency is None and self.plan is not None and self.plan.concurrency_auto
        batch = self._open_batch(feed, self._concurrency(concurrency, prefill_per_pass), prefill_per_pass, adapt_rows)
        while batch.rows or feed.wait():          # with no row in flight: wait for a request, or end with the feed
            self._drop_cancelled(batch, feed)
            yield from self._admit_waiting(batch, feed)
            if batch.rows:
                yield from self._round(batch)

    def _concurrency(self, concurrency: Optional[int], prefill_per_pass: Optional[int]) -> int:
        """The rows in flight asked for, checked against the plan (None: the plan's, else 1)."""
        if prefill_per_pass is not None and prefill_per_pass < 1:
            raise InputError(f"prefill_per_pass must be at least 1, not {prefill_per_pass}")
        if concurrency is None:
            return self.max_concurrency or 1
        if concurrency < 1:
            raise InputError(f"concurrency must be at least 1, not {concurrency}")
        if self.max_concurrency is not None and concurrency > self.max_concurrency:
            raise InputError(f"concurrency {concurrency} is more than the engine was planned for "
                             f"({self.max_concurrency}); load it with RunLimits(concurrency={concurrency})")
        return concurrency

    def _open_batch(self, feed: RequestFeed, concurrency: int, prefill_per_pass: Optional[int],
                    adapt_rows: bool) -> Batch:
        """The caches and controller of a batch. One cache row per request in flight, each holding prompt +
        generated tokens + one round's tree and its root, never more than the context: a round's tree shrinks
        to the room left before the context end."""
        if feed.known is not None:
            B = max(1, min(concurrency, len(feed.known)))
            row_tokens = max((self._row_tokens(r) for r in feed.known), default=2)
            speculative = any(self.speculative(r) for r in feed.known)
        else:
            B, speculative = concurrency, self.draft is not None
            row_tokens = (feed.tokens_a_row or self.max_context) + (self.max_tree_budget if speculative else 0) + 2
        capacity = min(self.max_context, row_tokens)
        t_cache = KVCache.for_model(self.target.cfg, capacity, self.target.dtype, self.device, batch=B)
        d_cache = (KVCache.for_model(self.draft.cfg, capacity, self.draft.dtype, self.device, batch=B)
                   if speculative else None)
        stream_seen = self._stream_stats()
        controller = Controller.for_run(RunStart(gpu=self.device.type == "cuda", streamed=stream_seen is not None,
                                                 rows=B, max_budget=self.max_tree_budget,
                                                 prefill_per_pass=prefill_per_pass, adapt_rows=adapt_rows))
        return Batch(t_cache, d_cache, capacity, B, controller, self.device, free=list(range(B))[::-1],
                      stream_seen=stream_seen)

    def _drop_cancelled(self, batch: Batch, feed: RequestFeed) -> None:
        """Rows whose request was cancelled (RequestFeed.cancel) leave before the next pass; their cache rows are
        free for waiting requests."""
        cancelled = feed.take_cancelled()
        gone = [row for row in batch.rows if row.index in cancelled]
        for row in gone:
            batch.controller.forget(row.index)
        self._retire(batch, gone)

    def _admit_waiting(self, batch: Batch, feed: RequestFeed) -> Iterator[RowStep]:
        """The next waiting requests take free rows (auto concurrency: as many as the controller wants in
        flight); a request the engine refuses is yielded with its error."""
        limit = (batch.controller.rows_wanted or batch.most) if batch.free and feed.waiting() else 0
        while batch.free and len(batch.rows) < limit and (taken := feed.take()) is not None:
            index, request = taken
            try:
                batch.rows.append(self._admit(index, request, batch))
                batch.free.pop()
            except InputError as err:
                yield RowStep(index, None, err)

    def _round(self, batch: Batch) -> Iterator[RowStep]:
        """One round of every row in flight: the controller's plan, trees grown and verified in ONE target pass
        (_pass), each row's verdict committed and yielded, the controller told what the round did, finished
        rows retired."""
        rows, controller = batch.rows, batch.controller
        plan = controller.plan([RowView(r.index, r.request.tree.max_depth) for r in rows if r.auto])
        for row in rows:
            row.start_round(plan.budgets.get(row.index, row.budget), self.max_context, self.device)
        self._ration_prefill(rows, batch.t_cache, plan.join_chunk)
        trees, q_logits, fed, cost, growth = self._pass(batch)
        finished, yielded, made = [], 0, 0
        for row, tree, q, n_fed in zip(rows, trees, q_logits, fed):
            if row.round_feed is not None:                      # joining: a chunk of its prompt, no tokens yet
                yield RowStep(row.index, cost.step(n_fed, tokens=[], accepted=0, tree_size=0, tree_depth=0))
                continue
            verdict, judged = self._accept(tree, q, row.request.sampling, row.generator)
            step = row.commit(batch, tree, verdict, judged, cost, n_fed)
            yielded += (step.accepted + 1) if row.auto else 0
            made += len(step.tokens)
            yield RowStep(row.index, step)
            if step.finish_reason is not None:
                finished.append(row)
        # After the commits, so that what each row's draft has not read is known (a switch from plain decoding
        # back to trees pays it). A round that prefilled a new prompt (target and draft) says little about the
        # cost of trees.
        going = [row for row in rows if row.auto and row not in finished]
        timed = all(n == tree.n_nodes for n, tree in zip(fed, trees))
        if self.draft_log is not None and timed and all(row.speculative for row in rows):
            self.draft_log.add(cost.draft_seconds + cost.target_seconds, made)
        controller.observe(RoundRecord(
            trees={row.index: tree for row, tree in zip(rows, trees) if row.auto}, pass_tokens=sum(fed),
            draft_seconds=cost.draft_seconds - growth.catch_up[1], target_seconds=cost.target_seconds,
            timed=timed, draft_calls=growth.calls,
            draft_nodes=growth.nodes, catch_up=growth.catch_up,
            behind={row.index: len(row.seq) - batch.d_cache.lengths[row.cache_row] for row in going},
            left={row.index: row.tokens_left() for row in going}, yielded=yielded,
            finished=tuple(row.index for row in finished),
            capped=frozenset(row.index for row in rows if row.auto and row.held_shallow())))
        self._retire(batch, finished)

    def _pass(self, batch: Batch) -> tuple[list[TokenTree], list, list[int], PassCost, DraftWork]:
        """The round's work on the devices: the draft's catch-up and every row's growth, then ONE target pass ->
        (trees, per row its (N_r, V) tree logits or None, tokens each row fed, the round's cost, the growth's
        calls, nodes and catch-up)."""
        if any(row.round_budget > 0 for row in batch.rows):
            self._wait_for_draft()
        with Timer(self.device) as draft_timer:
            with Timer(self.device) as catch_up_timer:
                root_logits, caught_up = self._catch_up(batch.rows, batch.d_cache)
            growth = DraftWork()
            trees = self._grow_all(batch.rows, root_logits, batch.d_cache, growth)
        growth.catch_up = (caught_up, catch_up_timer.seconds)
        with Timer(self.device) as target_timer:
            q_logits, fed = self._verify_pass(batch.rows, trees, batch.t_cache)          # [(N_r, V)]
        cost = PassCost(draft_timer.seconds, target_timer.seconds, self._stream_delta(batch), len(batch.rows))
        return trees, q_logits, fed, cost, growth

    def _wait_for_draft(self) -> None:
        """A draft still loading beside the first round (draft.DraftBeside) is waited for here, before the round's
        timers: the wait is part of the start (report_of), not of decoding."""
        wait = getattr(self.draft, "wait_loaded", None)
        if wait is not None:
            self.draft_waited += wait()

    @staticmethod
    def _retire(batch: Batch, finished: list[Row]) -> None:
        """Finished rows leave; their cache rows are free for the next waiting requests."""
        for row in finished:
            batch.rows.remove(row)
            batch.free.append(row.cache_row)

    @staticmethod
    def _ration_prefill(rows: list[Row], t_cache: KVCache, chunk: Optional[int]) -> None:
        """Set each row's round_feed: a joining row (prompt tokens not yet in its target cache) whose prompt is
        longer than `chunk` feeds only that many tokens this pass, and grows no tree this round. Only while some
        row is decoding: they are the ones a long prefill would stall."""
        pending = [len(row.seq) - 1 - t_cache.lengths[row.cache_row] for row in rows]
        decoding = any(p == 0 for p in pending)
        for row, p in zip(rows, pending):
            row.round_feed = None
            if decoding and chunk is not None and p > chunk:
                row.round_feed, row.round_budget = chunk, 0

    def _tree_room(self, request: GenerationRequest) -> int:
        """The most tree nodes a round of `request` may hold (what its cache row needs beyond its tokens)."""
        if not self.speculative(request):
            return 0
        return request.tree.budget if request.tree.budget is not None else self.max_tree_budget

    def _row_tokens(self, request: GenerationRequest) -> int:
        """Cache slots a row of `request` may need: its prompt and new tokens, and one round's tree with its root
        (what run_batch sizes the caches by and _admit checks an open feed's rows against)."""
        return len(request.prompt_ids) + request.max_new_tokens + self._tree_room(request) + 2

    def _admit(self, index: int, request: GenerationRequest, batch: Batch) -> Row:
        """`request`, its tree's policy (chosen_policy) and depth bound (TreeConfig.depth_bound) resolved, checked
        and given the batch's next free cache row."""
        tree = request.tree
        request = replace(request, tree=replace(tree, policy=chosen_policy(tree.policy, self.twin),
                                                max_depth=tree.depth_bound()))
        speculative = self.speculative(request)
        check_request(request, RowLimits(self.max_context, self.max_tree_budget, batch.capacity),
                      speculative=speculative, row_tokens=self._row_tokens(request))
        prompt, cache_row = list(request.prompt_ids), batch.free[-1]
        learned = self.learned if speculative else None
        batch.t_cache.set_length(0, cache_row)
        if batch.d_cache is not None:
            batch.d_cache.set_length(0, cache_row)
        stops = StopChecker(self.tokenizer, () if request.ignore_eos else self.eos_ids, request.stop_strings,
                            request.max_new_tokens, context_tokens=self.max_context - 1 - len(prompt))
        return Row(index=index, request=request, cache_row=cache_row, seq=prompt, stops=stops,
                    seed_gen=torch.Generator().manual_seed(request.sampling.seed), speculative=speculative,
                    auto=speculative and request.tree.budget is None, budget=self._tree_room(request),
                    calibrator=learned.calibrator(request) if learned and request.tree.calibrate else None,
                    ranks=learned.rank_learner(request) if learned and request.tree.policy == "sequoia" else None)

    # ------------------------------------------------------------ draft
    def _catch_up(self, rows: list[Row], cache: Optional[KVCache]) -> tuple[dict[int, torch.Tensor], int]:
        """One packed draft forward feeding every growing row what its draft cache has not seen (ending with
        its root): ({row position in `rows`: the draft's logits after its root, (V_draft,)}, tokens fed). Rows
        with budget 0 this round (plain decoding) are left behind; they catch up the next time they grow a tree."""
        growing = [i for i, r in enumerate(rows) if r.round_budget > 0]
        if not growing:
            return {}, 0
        draft, dev = self.draft, self.device
        # Catch up, packed: row i feeds seq[Ld:] at slots Ld.. and reads the distribution after its root.
        spans, tokens, positions, last = [], [], [], []
        for i in growing:
            row = rows[i]
            start, new = cache.lengths[row.cache_row], row.seq[cache.lengths[row.cache_row]:]
            spans.append(RowSpan(len(tokens), len(tokens) + len(new), row.cache_row,
                                 torch.arange(start, start + len(new), device=dev),
                                 PassMask(start, len(new), None, dev)))
            tokens += new
            positions += range(start, start + len(new))
            last.append(len(tokens) - 1)
            cache.set_length(start + len(new), row.cache_row)
        logits = draft.forward(self.vocab.draft_input(torch.tensor(tokens, device=dev)),
                               torch.tensor(positions, device=dev), spans, cache,
                               logit_rows=torch.tensor(last, device=dev), chunk=self.prefill_chunk)
        return dict(zip(growing, logits)), len(tokens)

    def _grow_all(self, rows: list[Row], root_logits: dict[int, torch.Tensor], cache: Optional[KVCache],
                  work: Optional[DraftWork] = None) -> list[TokenTree]:
        """Every row's tree for this round, grown together from its root (`_catch_up`'s logits): the rows'
        growths advance in lockstep, all the draft calls of a step in ONE forward over every row's frontier.
        A row not growing this round gets its root alone. work: counts the growth calls and nodes they ran on."""
        trees: list[Optional[TokenTree]] = [None if i in root_logits else TokenTree.root_only(r.seq[-1])
                                            for i, r in enumerate(rows)]
        steps, requests = {}, {}
        for i, logits in root_logits.items():
            row = rows[i]
            root_dist = self.vocab.draft_distribution(logits, row.request.sampling)   # (V_target,)
            tree_cfg = replace(row.request.tree, max_depth=row.round_depth)
            steps[i] = grow_steps(tree_cfg, row.request.sampling, row.seq[-1], root_dist, row.round_budget,
                                  row.generator, expand_floor=row.round_floor, rank_acceptance=row.rank_acceptance(),
                                  calibration=row.calibrator.calibration() if row.calibrator is not None else None,
                                  ngram=ngram.lookup(row.seq) if row.request.tree.ngram else ())
        for i in list(steps):
            self._advance(steps, requests, trees, i, None)
        while requests:
            if work is not None:
                work.calls += 1
                work.nodes += sum(frontier.numel() for _, frontier in requests.values())
            answers = self._draft_step_all(rows, requests, cache)
            for i, dists in answers.items():
                self._advance(steps, requests, trees, i, dists)
        return trees

    @staticmethod
    def _advance(steps: dict, requests: dict, trees: list, i: int, dists: Optional[torch.Tensor]) -> None:
        """Send row i's growth its answer (or start it); keep its next request, or its tree when it is done."""
        try:
            requests[i] = next(steps[i]) if dists is None else steps[i].send(dists)
        except StopIteration as done:
            trees[i] = done.value
            requests.pop(i, None)
            del steps[i]

    def _draft_step_all(self, rows: list[Row], requests: dict, cache: KVCache) -> dict[int, torch.Tensor]:
        """One draft forward over every pending request: row i's frontier (F_i,) working-tree nodes -> the
        draft's distributions there, (F_i, V_target). Working node j's K/V lives at slot len(seq) + j - 1 of
        the row's cache row; a frontier row sees the committed sequence and its ancestors among the working
        nodes (growth reuses a dropped node's index, so an ancestor may sit after its descendant)."""
        dev = self.device
        spans, tokens, positions, order = [], [], [], []
        for i, (tree, frontier) in requests.items():
            row = rows[i]
            committed, F_ = len(row.seq), frontier.numel()
            mask = torch.ones(F_, committed + tree.n_nodes - 1, dtype=torch.bool, device=dev)  # (F, S)
            mask[:, committed:] = tree.mask[frontier][:, 1:].to(dev)
            spans.append(RowSpan(len(tokens), len(tokens) + F_, row.cache_row, (committed + frontier - 1).to(dev),
                                 mask))
            tokens += tree.tokens[frontier].tolist()
            positions += (committed - 1 + tree.depths[frontier]).tolist()
            order.append(i)
        logits = self.draft.forward(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev), spans,
                                    cache, chunk=self.prefill_chunk)                             # (sum F, V_draft)
        return {i: self.vocab.draft_distribution(logits[span.start:span.end], rows[i].request.sampling)
                for i, span in zip(order, spans)}

    # ------------------------------------------------------------ target
    def _verify_pass(self, rows: list[Row], trees: list[TokenTree], cache: KVCache
                     ) -> tuple[list[torch.Tensor], list[int]]:
        """ONE target pass over every row's [not-yet-cached prompt tokens] + [root + tree], packed -> per row its
        (N_r, V) tree logits and the tokens it fed."""
        dev = self.device
        spans, tokens, positions, logit_rows, fed = [], [], [], [], []
        for row, tree in zip(rows, trees):
            start, root_slot = cache.lengths[row.cache_row], len(row.seq) - 1
            if row.round_feed is not None:                      # a long prompt joining: one chunk of it, no tree
                chunk = row.seq[start:start + row.round_feed]
                spans.append(RowSpan(len(tokens), len(tokens) + len(chunk), row.cache_row,
                                     torch.arange(start, start + len(chunk), device=dev),
                                     PassMask(start, len(chunk), None, dev)))
                tokens += chunk
                positions += range(start, start + len(chunk))
                fed.append(len(chunk))
                cache.set_length(start + len(chunk), row.cache_row)
                continue
            pending = row.seq[start:root_slot]                  # the prompt's rest in its first round, else empty
            P, N = len(pending), tree.n_nodes
            first = len(tokens)
            spans.append(RowSpan(first, first + P + N, row.cache_row, torch.arange(start, root_slot + N, device=dev),
                                 PassMask(start, P, tree.mask, dev)))
            tokens += pending + tree.tokens.tolist()
            positions += list(range(start, root_slot)) + (root_slot + tree.depths).tolist()
            logit_rows += range(first + P, first + P + N)
            fed.append(P + N)
        logits = self.target.forward(torch.tensor(tokens, device=dev), torch.tensor(positions, device=dev), spans,
                                     cache, logit_rows=torch.tensor(logit_rows, device=dev), chunk=self.prefill_chunk)
        per_row, at = [], 0
        for row, tree in zip(rows, trees):
            if row.round_feed is not None:
                per_row.append(None)
                continue
            per_row.append(logits[at: at + tree.n_nodes])                                # (N_r, V)
            at += tree.n_nodes
        return per_row, fed

    @staticmethod
    def _accept(tree: TokenTree, q_logits: torch.Tensor, sampling: SamplingConfig, generator):
        """-> (Verdict, the child accepted at each node whose children were judged: calibrate.observe's input)."""
        from offspec.spec.accept import follow_argmax, verify_stochastic
        # q spans every row of the target, padding included, never cut to the draft's vocabulary; the tree's
        # draft distributions already have this width (SharedVocab.draft_distribution, vocab.py).
        if sampling.greedy:
            best = q_logits.argmax(dim=-1).tolist()                                      # (N,)
            return follow_argmax(tree, best), judged_greedy(tree, best)
        # q is processed row by row, only at the nodes verification visits (the accepted path): processing
        # all N rows (sorting for top-p) would cost several (N, V) temporaries, gigabytes for a large tree.
        verdict = verify_stochastic(tree, lambda u: process_logits(q_logits[u], sampling), generator)
        return verdict, judged_path(tree, verdict.nodes)

    # ------------------------------------------------------------ streaming stats
    def _stream_stats(self):
        return getattr(self.target.layers, "stats", lambda: None)()

    def _stream_delta(self, batch: Batch) -> StreamDelta:
        """What the streamer counted since the batch's last reading (docs/streaming.md §6: copies are counted
        when their events are read, so the readings tile the run and each copy lands in exactly one round)."""
        before, batch.stream_seen = batch.stream_seen, self._stream_stats()
        return StreamDelta.between(before, batch.stream_seen)


def run(engine: Engine, request: GenerationRequest, *, start=None, offload: Optional[str] = None, on_text=None,
        on_step=None):
    """Drive the loop to the end: stream text deltas to `on_text`, return (RunReport, steps).
    start: the load's metrics.StartTimes, for the report (load.Loaded.start); offload: the mode for the report;
    default the engine's memory plan's ("none" for an engine without one)."""
    from offspec.engine.prompt import IncrementalText

    text_stream = IncrementalText(engine.tokenizer, request.stop_strings)
    steps, generated, streamed = [], [], []
    for step in engine.generate(request):
        steps.append(step)
        generated += step.tokens
        if on_text is not None:
            delta = text_stream.delta(generated, final=step.finish_reason is not None)
            if delta:
                streamed.append(delta)
                on_text(delta)
        if on_step is not None:
            on_step(step)
    text = "".join(streamed) if on_text is not None else None      # the deltas add up to the text
    return report_of(engine, request, steps, start=start, offload=offload, text=text), steps

