"""What a model pair's runs learn about acceptance, cached per pair across runs: $OFFSPEC_HOME/<kind>/<key>.json.

Two kinds, each a counts record that adds up (its own module defines it):
  sequoia      acceptance by rank (spec.sequoia.RankCounts): the vector Sequoia's tree shapes are built for
  calibration  acceptance by depth and bin of draft probability (spec.calibrate.AcceptanceCounts): the node values
               dyspec grows by with --calibrate
A file holds {"version": 1, **counts.to_dict()} of one key: a hash of the pair (pair_key: both models' weights,
how each is held, the dtype) and of greedy vs sampling (T = 0 and T > 0 accept differently). An engine reads a
mode's file once, when its first row of that kind and mode is admitted (its snapshot; a seeded sampled row's reads
the greedy file too). A sampled row starts from the snapshot, so its tokens do not depend on what shares its
passes or came before it. A greedy row's tokens are the target's whatever the tree, so it starts from the snapshot
plus what the engine's rows have observed so far: a pair's first batch, or a server started before the pair had
learned, learns as it goes (PairCache.row_start).

  learning  the snapshot holds fewer than the kind's frozen_at observations: each row adds what it observes to its
            own counts (from where it started), and the engine adds every row's new counts to the file when it closes
            (re-read then, so engines sharing the file add up; written atomically: a temporary file, os.replace).
  frozen    frozen_at observations or more: rows use the snapshot as it is and the file is never rewritten, so a
            seed's sampled output repeats from run to run.
  seeded    a learning sampled snapshot of a kind with seed_weight > 0: its rows also start from the greedy
            snapshot's counts as the engine read them, scaled to at most seed_weight observations
            (PairCache.row_start). A pair's first sampled rows then start from what its greedy runs measured, not
            from the kind's fixed prior, and their own observations outweigh it within a few rounds. The seed is
            fixed when the engine reads the files, and never written back.
An unreadable or malformed file counts as none, with one warning line. Without a key nothing is read or written.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from offspec.engine.request import GenerationRequest
from offspec.formats import int4
from offspec.spec.calibrate import AcceptanceCounts, Calibrator
from offspec.spec.sequoia import RankCounts, RankLearner

VERSION = 1


@dataclass(frozen=True)
class Kind:
    """One kind of learned counts: its folder under $OFFSPEC_HOME, the observations after which its snapshot no
    longer changes, the most observations the greedy counts weigh as a learning sampled snapshot's seed (0: not
    seeded), and its counts record (empty(), from_dict(d); a record has +, -, observations, to_dict(), and where
    seed_weight > 0 at_most(n))."""
    folder: str
    frozen_at: int
    seed_weight: int
    empty: Callable[[], Any]
    from_dict: Callable[[dict], Any]


SEQUOIA = Kind("sequoia", frozen_at=2000, seed_weight=32, empty=lambda: RankCounts.zeros(0),
               from_dict=RankCounts.from_dict)
CALIBRATION = Kind("calibration", frozen_at=20000, seed_weight=0, empty=AcceptanceCounts.zeros,
                   from_dict=AcceptanceCounts.from_dict)


def pair_key(target, draft, *, target_quant: str, draft_quant: str, dtype, twin: bool = False) -> Optional[str]:
    """The cache key of a model pair (None without a draft): target and draft are anything with fingerprint()
    (formats.checkpoint.Checkpoint, gguf_read's); twin: the draft is the target's own layers (--draft self). An
    int4 draft is named with the groups it is held in (int4.held_group)."""
    if draft is None:
        return None
    held = f"{draft_quant} g{int4.held_group(draft.quant)}" if draft_quant == "int4" else draft_quant
    text = f"{target.fingerprint()}|{draft.fingerprint()}|{target_quant}|{held}|{dtype}|twin={twin}"
    return hashlib.sha1(text.encode()).hexdigest()[:16]


class Snapshot:
    """One kind and mode's counts as an engine read them (`start`), whether they are frozen, and what this engine's
    rows added since (`new`: `share` adds a row's observations; saved at close)."""

    def __init__(self, path: Path, start, frozen: bool, empty):
        self.path, self.start, self.frozen = path, start, frozen
        self.new = empty            # rows' observations
        self.written = empty        # of those, already in the file

    def share(self, counts) -> None:
        self.new = self.new + counts


class PairCache:
    """The counts of one kind an engine's rows start from and add to (module docstring)."""

    def __init__(self, key: Optional[str], kind: Kind, home: Optional[Path] = None):
        self.key, self.kind, self.home = key, kind, home
        self._modes: dict[bool, Snapshot] = {}

    def snapshot(self, greedy: bool) -> Optional[Snapshot]:
        """The engine's snapshot for greedy or sampled rows (None without a key: rows start from nothing)."""
        if self.key is None:
            return None
        if greedy not in self._modes:
            home = self.home if self.home is not None else default_home()
            mode = "greedy" if greedy else "sampling"
            name = hashlib.sha1(f"{self.key}|{mode}".encode()).hexdigest()[:16]
            path = home / self.kind.folder / f"{name}.json"
            start = self._read(path, warn=True)
            self._modes[greedy] = Snapshot(path, start, start.observations >= self.kind.frozen_at, self.kind.empty())
        return self._modes[greedy]

    def row_start(self, greedy: bool):
        """The counts a row admitted now starts from (None without a key; module docstring): for a greedy row the
        snapshot plus what the engine's rows have observed since it was read; for a sampled row the snapshot, plus
        the greedy seed while it is learning."""
        snap = self.snapshot(greedy)
        if snap is None:
            return None
        if greedy:
            return snap.start + snap.new
        if snap.frozen or self.kind.seed_weight == 0:
            return snap.start
        return snap.start + self.snapshot(True).start.at_most(self.kind.seed_weight)

    def save(self) -> None:
        """Add what rows observed since the last save to each learning mode's file (re-read now)."""
        for mode in self._modes.values():
            delta = mode.new - mode.written
            if mode.frozen or delta.observations <= 0:
                continue
            merged = self._read(mode.path, warn=False) + delta
            mode.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = mode.path.with_name(f"{mode.path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": VERSION, **merged.to_dict()}))
            os.replace(tmp, mode.path)
            mode.written = mode.new

    def _read(self, path: Path, warn: bool):
        """The counts in `path`; none when it is missing, or unreadable (one warning line when `warn`)."""
        try:
            data = json.loads(path.read_text())
            if not isinstance(data, dict) or data.get("version") != VERSION:
                raise ValueError(f"not a version {VERSION} counts file")
            return self.kind.from_dict(data)
        except FileNotFoundError:
            return self.kind.empty()
        except (OSError, ValueError, KeyError, TypeError) as err:
            if warn:
                print(f"offspec: warning: ignoring the {self.kind.folder} cache {path} "
                      f"({' '.join(str(err).split())}); learning from scratch", file=sys.stderr)
            return self.kind.empty()


def default_home() -> Path:
    """Where a PairCache made without a home keeps its files: $OFFSPEC_HOME."""
    from offspec.formats.demo import offspec_home
    return offspec_home()


class Learned:
    """An engine's caches of its pair (sequoia's acceptance by rank, dyspec's calibration) and the learners its
    rows start from (module docstring)."""

    def __init__(self, key: Optional[str], home: Optional[Path] = None):
        self.ranks = PairCache(key, SEQUOIA, home)
        self.calibration = PairCache(key, CALIBRATION, home)

    def rank_learner(self, request: GenerationRequest) -> RankLearner:
        """A sequoia row's acceptance by rank, K = its tree's branching."""
        K = request.tree.branching
        greedy = request.sampling.greedy
        snap = self.ranks.snapshot(greedy)
        if snap is None:
            return RankLearner(RankCounts.zeros(K), K)
        return RankLearner(self.ranks.row_start(greedy), K, frozen=snap.frozen, share=snap.share)

    def calibrator(self, request: GenerationRequest) -> Calibrator:
        """A --calibrate row's acceptance rates by depth and draft probability."""
        greedy = request.sampling.greedy
        snap = self.calibration.snapshot(greedy)
        if snap is None:
            return Calibrator()
        return Calibrator(self.calibration.row_start(greedy), frozen=snap.frozen, share=snap.share)

    def observations(self, greedy: bool) -> dict[str, int]:
        """What a greedy or sampled row admitted now starts from, by kind, e.g. for a benchmark's rows."""
        starts = {cache.kind.folder: cache.row_start(greedy) for cache in (self.ranks, self.calibration)}
        return {name: start.observations if start is not None else 0 for name, start in starts.items()}

    def save(self) -> None:
        self.ranks.save()
        self.calibration.save()
