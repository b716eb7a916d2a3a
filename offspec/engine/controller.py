"""The runtime controller: every decision the generation loop makes from what it measures, behind two calls a
round. Before a round, `plan` gives each auto-budget row its tree budget and a joining prompt its chunk; after it,
`observe` takes the round's record, refits the costs, forgets the rows that finished and says how many rows the
next round is worth (auto concurrency). How a run starts, before anything is measured, is `Controller.for_run`.

A round costs  t_round(N) = t_draft(N) + t_target(N)  and yields  E(N) = R + (sum of the N best node
values)  tokens for R rows in the pass, because a DySpec node's value estimates the probability that it is
reached and accepted (the expected accepted length of a tree is the sum of those probabilities over it) and
every row adds its bonus token. The best budget minimizes t_round(N) / E(N). All three ingredients are
measured while generating:
  t_target(n) = a + b * n     least squares over the passes seen (n = tokens in the pass, every row's)
  t_draft(N)  = c0 * (k_calls * depth(N) + 1) + c1 * k_nodes * N + e * R
                              one catch-up call (each row's root, e a token) plus the growth's batched calls
                              (rows grow in lockstep), c0 each plus c1 per working-tree node they run on.
                              (c0, c1): least squares over the rounds' growth calls and nodes run on. Growth
                              runs the draft on more nodes than it keeps (DySpec expands candidates it then
                              drops) and calls to its working tree's depth:
                              k_nodes and k_calls are the measured ratios (nodes run on / nodes kept, calls /
                              the kept trees' deepest draft call), so that a budget of N kept nodes is priced
                              by the draft work it takes. c1 is what makes a wide tree dear where a draft
                              call is compute (a CPU) and cheap where it is latency (a GPU: c1 ~ 0), so the
                              planner picks chain-like trees on the one and bushy ones on the other.
  e           seconds a token of the catch-up calls (total over total): feeding tokens, no tree work
  E(N)        from the values of each row's last tree, merged and sorted (cumulative). A Sequoia tree's values
              are its f(v), the measured acceptance by rank that shaped it (sequoia.grow_shape): its N best
              nodes are then (p non-increasing) Sequoia's best tree of N nodes, so with no depth bound of its
              own (--max-depth auto) the choice of N is Sequoia's hardware-aware choice of size and depth.
With several rows in a pass, the N best nodes over ALL rows' candidates are the pass's node budget shared by
value: row r's budget is the number of its nodes among them, so rows whose drafts do well get more of the
pass. With one row this is the single-sequence planner.

The model's tree rounds are checked against what they did: each timed round in which every row grew a tree (the
rounds the choice is about; one row's tree among plain rows says little of every row's) keeps its measured seconds
and tokens yielded beside the model's seconds and expected tokens for it (a catch-up that read a draft's backlog
counted as one token a row: the rest is the switch's cost, charged apart). The best tree's predicted seconds per
token is scaled by the ratio of measured to predicted seconds per token over the last 8 such rounds (sums over
sums) before it is compared with plain decoding's (measured directly: a + b R over R rows). Whatever the model
misses (node values that overestimate acceptance, draft or verification work it does not count) then counts in
the choice.

Plain decoding (no tree, no draft call) competes with the best trees every round. Its hidden cost: the drafts fall
behind, and the first tree round after it feeds every row's backlog (at 8 rows, 32 plain rounds are 256 draft
tokens to read before any tree grows). So the switch back to trees is charged that backlog, spread over the tokens
the rows have left, and the probes that re-time trees while plain decoding wins grow one row's tree only, the row
whose draft is least behind; none at all once the backlog alone costs more a token than plain decoding (no tree
could then pay for the switch). With probe_first (a CPU, the target resident) a job starts so: after the prefill
and one timed plain round, one row's tree (_probe_size), the other rows' drafts reading nothing, and rows without a
tree priced as copies of the rows with one (their draft work per node where the rounds cannot tell a call's cost
from a node's).
Such a copy is an extrapolation from few rows, so trees spread to rows without one at most doubling the rows with
one after each timed round (1, 2, 4, 8 ...): every step is measured before the next, and a wrong guess costs a few
rows' trees, not every row's catch-up. A finished row's last tree stays as the reference for rows joining after it
(the job's last 16), so a fresh wave of prompts is decided from trees already seen, not by timing a new one.
"""
from __future__ import annotations

from collections import deque
from typing import Hashable, Optional, Sequence

import torch

from offspec.config import AUTO_MAX_TREE_BUDGET
from offspec.engine.rounds import RoundPlan, RoundRecord, RowView, RunStart, plain_first_round

ROW_GAIN = 0.05     # auto concurrency: a row in flight must add at least 5% to the predicted tokens/s to be worth it
YIELD_ROUNDS = 8     # the tree rounds whose measured / predicted seconds per token scale the trees' prediction
FIRST_PROBE = 4      # while plain decoding wins, trees are grown again after 4 plain rounds, then 8, 16, 32
LAST_PROBE = 32
PAST_TREES = 16      # finished rows' last trees kept as the reference for rows that join after them
SWITCH_MARGIN = 0.1  # going back from plain decoding to trees wants them predicted 10% cheaper a token: near a tie
                     # the switches' backlog reads and probes cost more than the trees return
PROBE_PASSES = 4     # the job's first tree (probe_first) is at most as wide as makes its pass cost 4 plain passes
ONE_ROW_CPU_BUDGET = 16   # one row on a CPU whose target streams: this many dyspec nodes every round (for_run)
MIN_JOIN_CHUNK = 64  # the fewest prompt tokens a pass feeds from a long prompt joining (auto; see join_chunk)


class Controller:
    """Picks each round's tree budgets ("auto") from measured draft and target costs, for the rows in flight,
    the chunk a joining prompt feeds, and (auto concurrency) how many rows are worth having in flight."""

    def __init__(self, start: int = 32, max_budget: int = AUTO_MAX_TREE_BUDGET, max_depth: int = 32,
                 probe_first: Optional[int] = None, prefill_per_pass: Optional[int] = None,
                 most_rows: Optional[int] = None, fixed: bool = False):
        self.start = min(start, max_budget)   # a row's budget before any tree of it was seen
        self.fixed = fixed                    # every round's budget is `start`: the fits are kept but choose nothing
        # probe_first: the job starts as if plain decoding had won, with ONE tree of this many nodes (the least
        # behind row's, after the first round), so the other rows' drafts read their prompts only once the measured
        # costs say trees pay. Where a draft's prefill is compute as dear as the target's (a CPU), that read is most
        # of what trees cost at many rows. None: every row starts with `start` (a streamed target, on a GPU or a
        # CPU: a pass's read of every layer is dearer than the drafts' prefill).
        self.probe_first = min(probe_first, max_budget) if probe_first else None
        self.max_budget = max_budget          # nodes per pass, all rows together (+ at least one a row): the
                                              # plan counted logits for that many
        self.max_depth = max_depth            # TreeConfig.max_depth: trees that reach it can only grow wider
        self.passes: deque[tuple[int, float]] = deque(maxlen=32)   # (tokens in pass, seconds)
        self.prefill: Optional[tuple[int, float]] = None   # the widest untimed pass: (tokens, seconds)
        # growth rounds: (calls, working-tree nodes run on, the kept trees' deepest draft call, nodes kept, seconds)
        self.drafts: deque[tuple[int, int, int, int, float]] = deque(maxlen=32)
        self.catch_ups: deque[tuple[int, float]] = deque(maxlen=32)    # catch-up calls (tokens fed, seconds)
        # tree rounds: (measured seconds, tokens yielded, the model's seconds, its expected tokens)
        self.misses: deque[tuple[float, int, float, float]] = deque(maxlen=YIELD_ROUNDS)
        self.explored_low = False
        self.exploring: frozenset = frozenset()      # rows growing the small trees that time another pass size
        self.plain_rounds = 0                         # plain-decoding rounds since trees were last grown
        self.probe_after = FIRST_PROBE                # ... after this many, grow trees once to re-time them
        self.plain_wins = self.probe_first is not None  # the last choice was plain decoding
        self.trees: dict[Hashable, object] = {}       # row -> its last tree (TokenTree)
        self.past: deque = deque(maxlen=PAST_TREES)   # finished rows' last trees, newest last
        self.timed = False                            # the last round observed was timed
        self.alloc: dict[Hashable, int] = {}          # row -> its budget for the next round
        self.behind: dict[Hashable, int] = {}         # row -> tokens its draft has not read (its next catch-up)
        self.left: dict[Hashable, int] = {}           # row -> tokens it may still generate
        self.prefill_per_pass = prefill_per_pass      # a joining prompt's tokens a pass; None: auto (join_chunk)
        self.most_rows = most_rows                    # auto concurrency: the most rows (None: not adapting)
        self.rows_wanted: Optional[int] = None        # ... and how many the costs favour (None: not known yet)
        if most_rows is not None:
            self.rows_wanted = self.rows_worth(most_rows)

    @classmethod
    def for_run(cls, run: RunStart) -> "Controller":
        """The starting policy. First trees: 128 nodes a row on a GPU, where a pass costs its transfer whatever it
        computes, and on a CPU whose target streams (a pass reads every layer there too) 32 / B nodes a row, every
        row's tree from the first round. On a CPU with the target resident, a pass and a draft call are compute,
        and every row's first tree costs its draft reading its prompt: the job (a row alone too) starts decoding
        plainly, so its first token comes after the target's prefill alone; after the first timed plain pass one
        row grows a tree (probe_first: 32 / B nodes but at least 8, enough to price a draft's nodes; fewer where
        a wide pass is dear, _probe_size), and the others grow theirs once that tree is timed and trees pay; rows
        joining later while trees pay share 32 nodes a pass. One row on a CPU whose target streams grows a fixed
        16-node tree every round instead (`fixed`): an answer of a few dozen tokens is over in a handful of rounds
        there, before the fits have seen enough to choose better, and every mischosen round costs draft calls that
        are compute on a CPU. Why each start: docs/notes/2026-11-23-batch-host-ram-and-planner.md,
        docs/notes/2026-11-27-the-default-on-a-cpu.md, docs/notes/2026-11-28-twin-from-the-stream.md, and for the
        twin drafting one prompt from disk docs/notes/2026-11-30-one-prompt-from-disk-with-the-twin.md."""
        B = run.rows
        if not run.gpu and run.streamed and B == 1:
            return cls(start=ONE_ROW_CPU_BUDGET, max_budget=run.max_budget, max_depth=0, fixed=True,
                       prefill_per_pass=run.prefill_per_pass)
        return cls(start=128 if run.gpu else max(1, 32 // B), max_budget=run.max_budget, max_depth=0,
                   probe_first=max(8, 32 // B) if plain_first_round(run.gpu, run.streamed) else None,
                   prefill_per_pass=run.prefill_per_pass, most_rows=B if run.adapt_rows else None)

    def plan(self, rows: Sequence[RowView]) -> RoundPlan:
        """Before a round: each auto-budget row's tree budget (in the order given: a new row takes what the pass
        has left beside those before it) and the chunk a joining prompt feeds."""
        for row in rows:
            self.max_depth = max(self.max_depth, row.max_depth)
        budgets = {row.key: self.budget(row.key) for row in rows}
        return RoundPlan(budgets, self.prefill_per_pass or self.join_chunk())

    def join_chunk(self) -> Optional[int]:
        """Auto: the prompt tokens a pass takes from a joining prompt. With t_target(n) = a + b n measured, a
        chunk of a / b tokens costs the decoding rows at most one more pass's fixed cost a (on a GPU streaming
        its layers a is the transfer, and whole prompts join at once; on a CPU a pass is compute and prompts
        join in smaller chunks). None (no limit) until passes of two sizes were timed."""
        if len({n for n, _ in self.passes}) < 2:
            return None
        a, b = self.target_fit()
        return None if b <= 0 else max(MIN_JOIN_CHUNK, int(a / b))

    def budget(self, row: Hashable) -> int:
        """Row's tree budget for this round: a new row starts at `start` (or what the pass has left), or at 0
        while plain decoding wins (its draft need not read its prompt until trees pay again). With probe_first
        the job starts so: its first round prefills the prompts with no tree (one grown there is not timed, so
        its draft work would buy its values alone), the next decodes plainly, and then the row least behind grows
        the one tree that times them (_choose); later rows have the finished rows' trees."""
        if row not in self.alloc:
            self.alloc[row] = 0 if self.plain_wins else self._left(self.start)
        return self.alloc[row]

    def _left(self, want: int) -> int:
        """A budget of `want` nodes, or what the pass has left beside the others' (at least 1)."""
        return max(1, min(want, self.max_budget - sum(self.alloc.values())))

    def forget(self, row: Hashable) -> None:
        """Row finished: its tree no longer counts for a row, only as a reference for rows joining later."""
        if row in self.trees:
            self.past.append(self.trees[row])
        for table in (self.trees, self.alloc, self.behind, self.left):
            table.pop(row, None)

    def observe(self, r: RoundRecord) -> None:
        """After a round: its passes refine t_target (a round that was not timed, having also prefilled a new
        prompt in the target and the draft, counts its trees' values but not its seconds, since the prefill's cost
        is not a tree's); its growth calls refine t_draft, its catch-up e (counted even in a round that prefilled:
        the draft's prefill is the catch-up, timed on its own); with every row growing a tree, its seconds and
        yield are checked against the model's prediction for those trees (miss; a row whose last token left it no
        tree yields its one token, as the model has it). The rows' backlogs and tokens
        left say what a switch from plain decoding back to trees would cost, and what it is spread over. A round
        without trees (every budget 0: plain decoding was the better deal) still refines t_target, and the
        choice is made again from the rows' last trees, so trees come back when they pay again. Then the finished
        rows are forgotten and, adapting rows, rows_wanted is set for the next refill."""
        if r.timed:
            self.passes.append((r.pass_tokens, r.target_seconds))
        elif self.prefill is None or r.pass_tokens > self.prefill[0]:
            self.prefill = (r.pass_tokens, r.target_seconds)
        grown = {row: t for row, t in r.trees.items() if t.size > 0}
        if grown and r.timed:
            deepest = max(int(t.draft_depths[1:].max()) for t in grown.values())   # 0: n-gram nodes only
            size = sum(t.size for t in grown.values())
            calls = r.draft_calls if r.draft_calls is not None else deepest
            nodes = r.draft_nodes if r.draft_nodes is not None else size
            self.drafts.append((max(calls, 1), nodes, max(deepest, 1), size, r.draft_seconds))
        if r.catch_up is not None and r.catch_up[0] > 0:
            self.catch_ups.append(r.catch_up)
        if r.yielded and r.timed and grown and all(row in grown or row in r.capped for row in r.trees):
            self._check_model(r, grown, size, deepest)
        self.behind.update(r.behind)
        self.left.update(r.left)
        # A row's reference tree (what its trees are worth; a fresh wave's, once the row is forgotten) is its last
        # full one: not the small tree that timed another pass size, nor one held shallow by its last tokens.
        held = r.capped | self.exploring
        self.trees.update({row: t for row, t in grown.items() if row not in held or row not in self.trees})
        self.exploring = frozenset()
        self.timed = r.timed
        # No tree yet: time one (_choose); with probe_first, right after the job's first round, untimed as it is
        # (a round's draft work is fitted only once a pass was timed: no drafts without passes).
        if not self.fixed and (self.passes or self.probe_first is not None) and (self.drafts or not self.trees):
            self._choose()
        for row in r.finished:
            self.forget(row)
        if self.most_rows is not None:
            self.rows_wanted = self.rows_worth(self.most_rows)

    def _check_model(self, r: RoundRecord, grown: dict, size: int, deepest: int) -> None:
        """Keep a tree round's measured seconds and yield beside the model's for it (miss)."""
        R = len(r.trees)
        fed, catch_seconds = r.catch_up if r.catch_up is not None else (R, 0.0)
        # a catch-up that read drafts' backlogs (after plain rounds) is the switch's cost, charged apart
        # (_switch_cost): the tokens beyond one a row are taken out at e a token
        catch_seconds = max(catch_seconds - self.catch_up_fit() * max(fed - R, 0), 0.0)
        spent = r.draft_seconds + catch_seconds + r.target_seconds
        predicted = self.round_seconds(size, deepest, R)
        expected = R + sum(float(t.values[1:].sum()) for t in grown.values())
        self.misses.append((spent, r.yielded, predicted, expected))

    def round_seconds(self, N, depth, R, unsure: str = "per call"):
        """t_draft(N) + t_target(N + R): the model's seconds of a round of R rows verifying N tree nodes whose
        deepest draft call is at `depth` (numbers or tensors of them). unsure: draft_fit's model where the
        rounds cannot tell its two costs apart."""
        a, b = self.target_fit()
        c0, c1 = self.draft_fit(unsure)
        k_calls, k_nodes = self.working_ratios()
        return c0 * (k_calls * depth + 1) + c1 * k_nodes * N + self.catch_up_fit() * R + a + b * (N + R)

    def tree_seconds(self, N, depth, R, m: float = 1.0):
        """What a tree round of R rows verifying N nodes (deepest draft call at `depth`) is taken to cost, where
        the rows' trees are m copies of those measured: the model's round_seconds scaled by its measured miss().
        m > 1 (rows without a tree of their own, taken to be like the measured ones) prices the draft per node
        where the rounds cannot tell a call's cost from a node's: a few rows' trees say nothing of how the
        draft's cost grows with the nodes of many. The budget choice and auto concurrency both price trees so."""
        return self.round_seconds(N, depth, R, unsure="per node" if m > 1 else "per call") * self.miss()

    def miss(self) -> float:
        """The recent tree rounds' measured seconds per token over the model's, each a ratio of sums (seconds
        over tokens yielded, against predicted seconds over expected tokens): one round's yield is a few tokens,
        and a mean or median of per-round ratios would weigh its unlucky rounds (1 token for 2.5 expected) more
        than its lucky ones. 1 before any."""
        if not self.misses:
            return 1.0
        spent, yielded, predicted, expected = (sum(r[i] for r in self.misses) for i in range(4))
        return (spent / yielded) / (predicted / expected)

    def working_ratios(self) -> tuple[float, float]:
        """(k_calls, k_nodes): growth calls per level of the kept trees' deepest draft call, and working-tree
        nodes run on per node kept, over the rounds in the fit (1, 1 before any)."""
        calls, nodes, depth, size = (sum(r[i] for r in self.drafts) for i in range(4))
        if not depth or not size:
            return 1.0, 1.0
        return calls / depth, nodes / size

    def catch_up_fit(self) -> float:
        """e: seconds a token fed by the catch-up calls (their total over their tokens); without any yet, the
        growth's c1 (a draft forward row, like a catch-up token)."""
        tokens = sum(n for n, _ in self.catch_ups)
        return sum(t for _, t in self.catch_ups) / tokens if tokens else self.draft_fit()[1]

    def draft_fit(self, unsure: str = "per call") -> tuple[float, float]:
        """(c0, c1) of a draft call's cost c0 + c1 * nodes, both >= 0. With too few or too alike rounds to tell
        the two apart (or a negative c1), one of the one-cost models: unsure="per call" (c1 = 0, every call costs
        the mean per call: the latency-bound model, right for a tree the size of those measured), or "per node"
        (c0 = 0, the mean per node: what more rows' trees cost at most, since their nodes share the calls)."""
        calls = torch.tensor([r[0] for r in self.drafts], dtype=torch.float64)
        nodes = torch.tensor([r[1] for r in self.drafts], dtype=torch.float64)
        ts = torch.tensor([r[-1] for r in self.drafts], dtype=torch.float64)
        per_call, per_node = (float(ts.sum() / calls.sum()), 0.0), (0.0, float(ts.sum() / nodes.sum()))
        fallback = per_node if unsure == "per node" else per_call
        A = torch.stack([calls, nodes], 1)
        if calls.numel() < 3 or torch.linalg.matrix_rank(A) < 2:
            return fallback
        c0, c1 = torch.linalg.lstsq(A, ts[:, None]).solution[:, 0].tolist()
        if abs(c1) * float(nodes.mean()) <= 1e-9 * float(ts.mean()):
            c1 = 0.0      # rounding, not a cost: its sign must not pick the model (data exactly c0 per call)
        if c1 < 0:
            return fallback
        if c0 < 0:
            return per_node
        return c0, c1

    def target_fit(self) -> tuple[float, float]:
        """(a, b) of t_target(n) = a + b n; b >= 0. Needs passes of at least two sizes."""
        ns = torch.tensor([n for n, _ in self.passes], dtype=torch.float64)
        ts = torch.tensor([t for _, t in self.passes], dtype=torch.float64)
        if ns.numel() < 2 or float(ns.max() - ns.min()) == 0.0:
            return float(ts.mean()), 0.0
        A = torch.stack([torch.ones_like(ns), ns], 1)
        a, b = torch.linalg.lstsq(A, ts[:, None]).solution[:, 0].tolist()
        b = max(b, 0.0)
        return max(float((ts - b * ns).mean()), 0.0), b

    def rows_worth(self, most: int) -> Optional[int]:
        """Auto concurrency: how many rows in flight, up to `most` (what the memory plan holds), the measured
        costs favour. Rows in flight share a pass's fixed cost a and its draft calls, so tokens/s grows with them
        until the pass is compute (b) or the draft's per-node cost (c1) bound; past that point more rows only
        make every prompt wait longer. For R' rows the node values seen so far are taken as every row's, pooled:
        R' rows offer R'/R copies of the R current rows' sorted values v (k of the pooled best nodes -> N =
        k R'/R nodes), so
            rate(R') = max over k of  (R' + R'/R C(k)) / tree_seconds(N),   tree_seconds(0) = a + b R',
        k = 0 being plain decoding (no draft call), C the cumulative sum of v; tree rounds priced as the budget
        choice prices them (tree_seconds: the measured miss, per node where more rows are extrapolated). The
        answer: the fewest rows whose rate is within ROW_GAIN of the best rate up to `most`. None until trees and
        passes were timed."""
        rows = list(self.trees)
        if not rows or not self.drafts or len({n for n, _ in self.passes}) < 2:
            return None
        _, C, depth = self._pooled([self.trees[r] for r in rows])
        zero = torch.zeros(1, dtype=torch.float64)
        C, depth = torch.cat([zero, C]), torch.cat([zero, depth])          # C(k), depth(k) for k = 0 (no tree) ..
        k = torch.arange(C.numel(), dtype=torch.float64)
        a, b = self.target_fit()
        R = len(rows)
        rates = []
        for n_rows in range(1, most + 1):
            m = n_rows / R
            N = m * k
            seconds = self.tree_seconds(N, depth, n_rows, m)
            seconds[0] = a + b * n_rows                          # no tree: no draft call
            seconds[N > self.max_budget] = float("inf")          # one pass verifies at most max_budget nodes
            rates.append(float(((n_rows + m * C) / seconds.clamp_min(1e-12)).max()))
        best = max(rates)
        return next(n for n, rate in enumerate(rates, 1) if rate >= (1 - ROW_GAIN) * best)

    def _pooled(self, trees: list) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The trees' nodes (roots left out) pooled and sorted by value, best first: (order, C, depth), C[N-1] the
        sum of the N best values and depth[N-1] the deepest draft call they need (n-gram nodes: none)."""
        values = torch.cat([t.values[1:].double() for t in trees])
        depths = torch.cat([t.draft_depths[1:] for t in trees])
        order = torch.argsort(values, descending=True)
        return order, torch.cumsum(values[order], 0), torch.cummax(depths[order], 0).values.double()

    def _least_behind(self, rows: list) -> Hashable:
        """The row whose draft has the least to read before it can grow a tree (first of equals)."""
        return min(rows, key=lambda r: self.behind.get(r, 0))

    def _switch_cost(self) -> float:
        """Seconds per token of going back to trees after plain rounds: every planned row's draft backlog beyond
        its root (which every tree round feeds, and t_draft counts), e a token, spread over the tokens the rows
        have left. 0 in steady tree rounds, and without backlog figures."""
        rows = list(self.alloc)
        backlog = sum(max(self.behind.get(r, 1) - 1, 0) for r in rows)
        if not backlog:
            return 0.0
        left = sum(self.left.get(r, 1) for r in rows)
        return self.catch_up_fit() * backlog / max(left, 1)

    def _choose(self) -> None:
        if not self.alloc:         # no row of the batch takes its budget from here (all fixed-budget rows)
            return
        rows = [r for r in self.alloc if r in self.trees]
        # The rows' last trees say what a tree is worth; with none in flight (rows that joined while plain decoding
        # won), the finished rows' last trees do.
        reference = [self.trees[r] for r in rows] or list(self.past)
        if not reference or not self.drafts:
            # Only rows that joined while plain decoding won (or the job's first rows, with probe_first), whose
            # drafts never read their prompts, and no tree seen: time one tree, of the row least behind, before
            # deciding for them all.
            # With probe_first, after a timed plain pass: what it cost sizes the tree (_probe_size).
            self.plain_rounds = 0
            self.alloc = dict.fromkeys(self.alloc, 0)
            if self.alloc and (self.passes or self.probe_first is None):
                self.alloc[self._least_behind(list(self.alloc))] = self._left(self._probe_size())
            return
        # Rows without a tree yet (their drafts have not read their prompts) are taken to be like the reference
        # trees: m = all rows / reference trees copies of their pooled nodes. The best k of those nodes then stand
        # for m k nodes verified in a pass of every row (m = 1 once every row has grown a tree), priced by
        # tree_seconds (per node where m > 1, and scaled by the measured miss).
        order, C, depth_of = self._pooled(reference)                                   # depth(k), k = 1..total
        R, total = len(self.alloc), C.numel()
        m = R / len(reference)
        expected = R + m * C                                                           # E(m k)
        a, b = self.target_fit()
        kept = torch.arange(1, total + 1, dtype=torch.float64)                        # k
        seconds = self.tree_seconds(m * kept, depth_of, R, m)
        best = int(torch.argmin((seconds / expected)[:max(1, int(self.max_budget / m))])) + 1
        if rows and len({n for n, _ in self.passes}) < 3 and not self.explored_low:
            # Too few distinct pass sizes to know b: try small trees once to measure the slope.
            self.explored_low = True
            self.exploring = frozenset(rows)
            for r in rows:
                self.alloc[r] = max(1, self.trees[r].size // 4)
            return
        switch = self._switch_cost() if self.plain_wins else 0.0
        mine = [0] * len(rows)                                                         # row r's nodes in the best k
        if rows:
            owner = torch.cat([torch.full((self.trees[r].size,), i) for i, r in enumerate(rows)])
            mine = torch.bincount(owner[order[:best]], minlength=len(rows)).tolist()
        share = max(1, round(best / len(reference)))                                   # a reference tree's part
        margin = 1 + SWITCH_MARGIN if self.plain_wins else 1.0
        if (a + b * R) / R < float((seconds / expected)[best - 1]) * margin + switch:
            # No tree at all beats every tree: plain decoding (no draft calls) for every row this round. The
            # trees are then no longer measured, and one bad round (a busy machine, an unlucky tree) must not
            # switch them off for good: after probe_after plain rounds one row's best tree is grown anyway (the
            # row least behind: its catch-up is the cheapest), and each probe that plain decoding still beats
            # doubles the wait (4, 8, 16, 32 rounds).
            self.plain_wins = True
            self.plain_rounds += 1
            self.alloc = dict.fromkeys(self.alloc, 0)
            # A probe is pointless once the drafts' backlog alone, spread over the tokens the rows have left,
            # costs more a token than plain decoding: no tree it could time would pay for the switch back (the
            # job's tail, or rows whose drafts never read their prompts). It waits, and is not rescheduled.
            if self.alloc and self.plain_rounds >= self.probe_after and switch < (a + b * R) / R:
                self.plain_rounds, self.probe_after = 0, min(2 * self.probe_after, LAST_PROBE)
                probe = self._least_behind(rows or list(self.alloc))
                self.alloc[probe] = (self._budget_of(self.trees[probe], mine[rows.index(probe)]) if rows
                                     else self._left(share))
            return
        self.plain_wins, self.plain_rounds, self.probe_after = False, 0, FIRST_PROBE
        for k, r in enumerate(rows):
            self.alloc[r] = self._budget_of(self.trees[r], mine[k])
        allotted = sum(self.alloc[r] for r in rows)
        if allotted > self.max_budget:        # rows looking further share what one pass may verify
            for r in rows:
                self.alloc[r] = max(1, self.alloc[r] * self.max_budget // allotted)
        # Rows that joined while plain decoding won grow their first tree now, of a reference tree's share of
        # the best nodes, the least behind first, and at most as many as have a tree, after a timed round only:
        # what the model extrapolated from few rows is measured at twice as many before it is trusted for more.
        waiting = sorted((r for r in self.alloc if r not in self.trees and self.alloc[r] == 0),
                         key=lambda r: self.behind.get(r, 0))
        for r in waiting[:max(1, len(rows)) if self.timed else 0]:
            self.alloc[r] = self._left(share)

    def _probe_size(self) -> int:
        """The first tree's budget: probe_first (else start), or fewer nodes where a wide pass is dear: at most N
        with a + b (n0 + N) <= PROBE_PASSES t0, (n0, t0) the last timed plain pass and b the slope from it to the
        prefill's pass. Nothing prices that tree before it is grown, so its cost is bounded by plain decoding's."""
        want = self.probe_first or self.start
        if not self.passes or self.prefill is None:
            return want
        (n0, t0), (n, t) = self.passes[-1], self.prefill
        if n <= n0 or t <= t0:
            return want
        b = (t - t0) / (n - n0)
        a = max(t0 - b * n0, 0.0)
        return max(1, min(want, int((PROBE_PASSES * t0 - a) / b) - n0))

    def _budget_of(self, tree, mine: int) -> int:
        """A row's next budget from its reference tree and its share `mine` of the best N nodes."""
        if mine >= tree.size and tree.depth < self.max_depth:
            # The optimum takes all of this row's tree: look further. (A tree already as deep as allowed would
            # only get wider, at values below everything it holds: the edge is where it stops.)
            return min(self.max_budget, max(2 * tree.size, 2))
        return min(self.max_budget, max(1, mine))
