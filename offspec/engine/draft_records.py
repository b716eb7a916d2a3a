"""What each draft's rounds measured with its target on this machine, across runs, and the choice they make:
$OFFSPEC_HOME/drafts/<key>.json.

A file holds {"version": 1, "label", "seconds", "tokens", "rounds"} of one key: a hash of the pair as it runs
(record_key: pair_cache.pair_key's hash of both models' weights, whether the draft is the target's twin, how each
is held and the dtype, with the device by name). An engine loaded with a DraftLog adds every decoding round to it
(DraftLog.add): the round's seconds (draft and target pass) and the tokens it made, over every row in the pass. A
round that fed prompt tokens is left out: it measures a prefill, not the draft. The engine adds what it saw to the
file when it closes (re-read then, so engines sharing the file add up; written atomically: a temporary file,
os.replace).

    measured seconds a token  s = seconds / tokens, over every round the file holds

choose() takes, among the drafts that fit beside the target, the first with fewer than MIN_TOKENS measured
tokens (so each candidate gets measured once, in the order given); else the least measured one where it holds
fewer than KEEP_MEASURED of the most measured one's tokens (so a draft that one early run made look slow is tried
again now and then, about one token in ten); else the one with the least s. An unreadable or malformed file counts
as none, with one warning line.
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

MIN_TOKENS = 32         # a draft with fewer measured tokens than this is measured (chosen) before any comparison
KEEP_MEASURED = 0.1     # ... and one with fewer than this share of the most measured draft's tokens, again
VERSION = 1


def record_key(pair: str, device: str) -> str:
    """The file name of a pair on a device: pair is pair_cache.pair_key's (weights, twin, how held, dtype)."""
    return hashlib.sha1(f"{pair}|{device}".encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Measured:
    """Rounds of one pair on one device, summed."""
    seconds: float = 0.0
    tokens: int = 0
    rounds: int = 0

    @property
    def per_token(self) -> float:
        return self.seconds / self.tokens if self.tokens else float("inf")

    def __add__(self, other: "Measured") -> "Measured":
        return Measured(self.seconds + other.seconds, self.tokens + other.tokens, self.rounds + other.rounds)


def records_dir() -> Path:
    from offspec.formats.demo import offspec_home
    return offspec_home() / "drafts"


def read_record(key: str, warn: bool = True) -> Measured:
    """The rounds measured under `key`; none when missing or unreadable (one warning line when `warn`)."""
    path = records_dir() / f"{key}.json"
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != VERSION:
            raise ValueError(f"not a version {VERSION} draft record")
        return Measured(float(data["seconds"]), int(data["tokens"]), int(data["rounds"]))
    except FileNotFoundError:
        return Measured()
    except (OSError, ValueError, KeyError, TypeError) as err:
        if warn:
            print(f"offspec: warning: ignoring the draft record {path} ({' '.join(str(err).split())})",
                  file=sys.stderr)
        return Measured()


class DraftLog:
    """An engine's tally of its decoding rounds, added to its pair's file by save() (module docstring)."""

    def __init__(self, key: str, label: str):
        self.key, self.label = key, label
        self.unsaved = Measured()

    def add(self, seconds: float, tokens: int) -> None:
        self.unsaved = self.unsaved + Measured(seconds, tokens, 1)

    def save(self) -> None:
        if self.unsaved.rounds == 0:
            return
        total = read_record(self.key, warn=False) + self.unsaved
        path = records_dir() / f"{self.key}.json"
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps({"version": VERSION, "label": self.label, "seconds": total.seconds,
                                       "tokens": total.tokens, "rounds": total.rounds}))
            os.replace(tmp, path)
        except OSError as err:
            print(f"offspec: warning: could not save the draft record {path} ({err})", file=sys.stderr)
        self.unsaved = Measured()


def choose(labels: Sequence[str], measured: Sequence[Measured]) -> tuple[int, str]:
    """-> (the index of the draft to run, a line saying why) among candidates that fit (module docstring)."""
    for i, m in enumerate(measured):
        if m.tokens < MIN_TOKENS:
            return i, (f"draft {labels[i]}, to measure it (drafts given: {', '.join(labels)}): once each has been "
                       f"measured on this machine, runs take the fastest")
    most = max(m.tokens for m in measured)
    least = min(range(len(labels)), key=lambda i: measured[i].tokens)
    if measured[least].tokens < KEEP_MEASURED * most:
        return least, (f"draft {labels[least]}, to measure it again ({measured[least].tokens} tokens on record "
                       f"against {most}): each draft keeps at least {KEEP_MEASURED:.0%} of the most measured one's")
    best = min(range(len(labels)), key=lambda i: measured[i].per_token)
    figures = ", ".join(f"{label} {m.per_token:.3g} s/token over {m.tokens} tokens"
                        for label, m in zip(labels, measured))
    return best, f"draft {labels[best]}: the fastest measured on this machine ({figures})"
