"""The records the generation loop and the controller (controller.py) exchange: what a run is before anything is
measured, what a row is to the plan, what `plan` decided for a round and what the round did."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable, Optional


@dataclass
class DraftWork:
    """A round's draft work, for the controller's t_draft and e fits."""
    calls: int = 0          # batched growth forwards (one per depth step, every row's frontier together)
    nodes: int = 0          # working-tree nodes they ran on, all rows
    catch_up: tuple[int, float] = (0, 0.0)   # the catch-up call: (tokens fed, seconds)


@dataclass(frozen=True)
class RunStart:
    """What the controller knows of a run before anything is measured (Controller.for_run)."""
    gpu: bool                          # the device is a GPU: a pass costs its transfer whatever it computes
    streamed: bool                     # the target's layers stream: a pass reads every layer, on any device
    rows: int                          # the most rows in flight (cache rows)
    max_budget: int                    # tree nodes one pass may verify, all rows together (the plan's)
    prefill_per_pass: Optional[int] = None   # prompt tokens a joining prompt feeds a pass; None: auto (join_chunk)
    adapt_rows: bool = False           # auto concurrency: `rows` is the most, the costs may keep fewer


@dataclass(frozen=True)
class RowView:
    """An auto-budget row as `plan` sees it."""
    key: Hashable                      # the row's request key (stable while it is in flight)
    max_depth: int = 0                 # its TreeConfig.max_depth: a tree that reaches it can only grow wider


@dataclass(frozen=True)
class RoundPlan:
    """What `plan` decided for a round."""
    budgets: dict                      # row key -> its tree budget this round (0: plain decoding)
    join_chunk: Optional[int]          # the most prompt tokens a joining row feeds this pass; None: all of it


@dataclass(frozen=True)
class RoundRecord:
    """What a round did, for `observe`. trees: this round's tree of each auto-budget row (root alone: none
    grown); draft_seconds: the growth calls (the catch-up left out); target_seconds and pass_tokens: the target
    pass (every row's tokens)."""
    trees: dict
    draft_seconds: float
    target_seconds: float
    pass_tokens: int
    timed: bool = True                 # False: the round also prefilled a new prompt; its seconds are not a tree's
    draft_calls: Optional[int] = None  # growth calls and the working-tree nodes they ran on, all rows (default:
    draft_nodes: Optional[int] = None  # the kept trees' deepest draft call and their size)
    catch_up: Optional[tuple[int, float]] = None   # (tokens fed, seconds) of the round's catch-up call
    behind: dict = field(default_factory=dict)     # row -> tokens its draft has not read, after this round
    left: dict = field(default_factory=dict)       # row -> tokens it may still generate
    yielded: Optional[int] = None      # tokens the auto rows emitted (accepted + bonus, before any stop's cut)
    finished: tuple = ()               # rows that finished this round: forgotten once the round is counted
    capped: frozenset = frozenset()    # rows whose tree was held shallower by the few tokens they had left


def plain_first_round(gpu: bool, streamed: bool) -> bool:
    """A run starts with a plain prefill round, no tree and no draft call, on a CPU with the target resident
    (Controller.for_run's probe_first); so there the draft may load beside that round (draft.DraftBeside)."""
    return not gpu and not streamed
