"""Sequoia's acceptance by rank, cached per model pair across runs: $OFFSPEC_HOME/sequoia/<key>.json.

A file holds {"version": 1, "tried": [...], "hits": [...]} (spec.sequoia.RankCounts) of one key: a hash of the
pair (pair_key: both models' weights, how each is held, the dtype) and of greedy vs sampling (T = 0 and T > 0
accept differently). An engine reads a mode's file once, when its first sequoia row of that mode is admitted,
and every row starts from that same snapshot, so a prompt's tokens do not depend on what shares its passes.

  learning  the snapshot holds fewer than FROZEN_AT observations: each row adds what it observes to its own
            counts (from the snapshot), and the engine adds every row's new counts to the file when it closes
            (re-read then, so engines sharing the file add up; written atomically: a temporary file, os.replace).
  frozen    FROZEN_AT observations or more: rows use the snapshot's vector as it is and the file is never
            rewritten, so a seed's sampled output repeats from run to run.
An unreadable or malformed file counts as none, with one warning line. Without a key nothing is read or written.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from offspec.engine.request import GenerationRequest
from offspec.spec.sequoia import RankCounts, RankLearner

FROZEN_AT = 2000        # observations (judged nodes) after which the vector no longer changes
MAX_RANKS = 64          # ranks an engine's rows add up (a row's beyond, if its branching is larger, are dropped)
VERSION = 1


def pair_key(target, draft, *, target_quant: str, draft_quant: str, dtype, twin: bool = False) -> Optional[str]:
    """The cache key of a model pair (None without a draft): target and draft are anything with fingerprint()
    (formats.checkpoint.Checkpoint, gguf_read's); twin: the draft is the target's own layers (--draft self)."""
    if draft is None:
        return None
    text = f"{target.fingerprint()}|{draft.fingerprint()}|{target_quant}|{draft_quant}|{dtype}|twin={twin}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


@dataclass
class _Mode:
    """One mode's (greedy or sampling) snapshot and what this engine's rows added to it."""
    path: Path
    start: RankCounts                   # the file as read: every row starts here
    frozen: bool
    new: RankCounts = field(default_factory=lambda: RankCounts.zeros(MAX_RANKS))   # rows' observations (shared)
    written: RankCounts = field(default_factory=lambda: RankCounts.zeros(MAX_RANKS))   # of those, in the file


class RankCache:
    """The acceptance-by-rank counts an engine's sequoia rows start from and add to (module docstring)."""

    def __init__(self, key: Optional[str], home: Optional[Path] = None):
        self.key = key
        self.home = home
        self._modes: dict[str, _Mode] = {}

    def learner(self, request: GenerationRequest) -> RankLearner:
        """A row's learner: this engine's snapshot for the request's mode, K = its tree's branching."""
        K = request.tree.branching
        if self.key is None:
            return RankLearner(RankCounts.zeros(K), K)
        mode = self._mode("greedy" if request.sampling.greedy else "sampling")
        return RankLearner(mode.start, K, frozen=mode.frozen, shared=None if mode.frozen else mode.new)

    def _mode(self, name: str) -> _Mode:
        if name not in self._modes:
            if self.home is None:
                self.home = default_home()
            key = hashlib.sha1(f"{self.key}|{name}".encode()).hexdigest()[:16]
            path = self.home / "sequoia" / f"{key}.json"
            start = _read(path, warn=True)
            self._modes[name] = _Mode(path, start, frozen=start.observations >= FROZEN_AT)
        return self._modes[name]

    def save(self) -> None:
        """Add what rows observed since the last save to each learning mode's file (re-read now)."""
        for mode in self._modes.values():
            delta = _padded(mode.new, mode.written, sign=-1.0)
            if mode.frozen or delta.observations <= 0:
                continue
            merged = _padded(_read(mode.path, warn=False), delta)
            merged = merged.resized(int(max(1, (merged.tried > 0).nonzero()[0].max(initial=0) + 1)))
            mode.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = mode.path.with_name(f"{mode.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": VERSION, **merged.to_dict()}))
            os.replace(tmp, mode.path)
            mode.written = RankCounts(mode.new.tried.copy(), mode.new.hits.copy())


def default_home() -> Path:
    """Where a RankCache made without a home keeps its files (under sequoia/): $OFFSPEC_HOME."""
    from offspec.formats.demo import offspec_home
    return offspec_home()


def _read(path: Path, warn: bool) -> RankCounts:
    """The counts in `path`; none when it is missing, or unreadable (one warning line when `warn`)."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} rank-count file")
        return RankCounts.from_dict(data)
    except FileNotFoundError:
        return RankCounts.zeros(0)
    except (OSError, ValueError, KeyError, TypeError) as err:
        if warn:
            print(f"offspec: warning: ignoring the sequoia cache {path} ({' '.join(str(err).split())}); "
                  "learning from scratch", file=sys.stderr)
        return RankCounts.zeros(0)


def _padded(a: RankCounts, b: RankCounts, sign: float = 1.0) -> RankCounts:
    """a + sign * b over the longer of the two rank ranges."""
    K = max(len(a.tried), len(b.tried))
    out, other = a.resized(K), b.resized(K)
    return RankCounts(out.tried + sign * other.tried, out.hits + sign * other.hits)
