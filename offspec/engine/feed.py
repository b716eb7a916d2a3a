"""Requests in: what Engine.run_batch takes its next prompt from whenever a row is free.

A job that knows all its prompts hands run_batch a list (`RequestFeed.of`, closed at once). A Ray worker's feed
stays open: the driver puts more prompts into it while the batch runs, so the worker's rows are refilled
without a pause between the driver's hand-outs, and it closes the feed when it has nothing more to give.
run_batch never waits on the feed while rows are decoding (it takes what is there); with every row idle it
waits until a prompt comes or the feed is closed. A request may be cancelled (a server's client that went away):
taken out if it still waits, its row freed before the next pass if it runs.

Thread-safe: the driver's puts arrive on another thread of the worker than the one running the batch.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import Hashable, Iterable, Optional, Sequence


class RequestFeed:
    """(key, GenerationRequest) pairs in arrival order; the key names the request in everything run_batch
    yields (an index into a list, the driver's request number). tokens_a_row: the most prompt + new tokens
    any request of an open feed will need, to size the KV caches' rows (None: the engine's context); a request
    that needs more is refused. A feed made from a list (`of`) knows every request: run_batch sizes its rows
    and caches from them exactly."""

    def __init__(self, tokens_a_row: Optional[int] = None):
        self.tokens_a_row = tokens_a_row
        self.known: Optional[list] = None                 # every request, for a feed made from a list
        self._items: deque = deque()
        self._requests: dict[Hashable, object] = {}     # key -> request, from put until forget
        self._put = 0                                    # requests put so far
        self._closed_after: Optional[int] = None         # closed once this many were put (close)
        self._cancelled: set = set()                     # keys cancelled while running (run_batch drops them)
        self._changed = threading.Condition()

    @classmethod
    def of(cls, requests: Sequence) -> "RequestFeed":
        """A closed feed of a known list, keyed by position."""
        feed = cls()
        feed.known = list(requests)
        feed.put(enumerate(feed.known))
        feed.close()
        return feed

    def put(self, items: Iterable[tuple[Hashable, object]]) -> None:
        with self._changed:
            for key, request in items:
                if self._closed():
                    raise ValueError("the feed is closed")
                self._items.append((key, request))
                self._requests[key] = request
                self._put += 1
            self._changed.notify_all()

    def close(self, after: Optional[int] = None) -> None:
        """Nothing more will be put (after: once `after` requests in all were put; a Ray actor's calls may
        arrive out of order, so the driver's close may overtake its last put): once the feed is empty,
        run_batch ends when its rows do."""
        with self._changed:
            self._closed_after = self._put if after is None else after
            self._changed.notify_all()

    def _closed(self) -> bool:
        return self._closed_after is not None and self._put >= self._closed_after

    def wait(self) -> bool:
        """Block until a request waits (True) or the feed is closed and empty (False)."""
        with self._changed:
            self._changed.wait_for(lambda: self._items or self._closed())
            return bool(self._items)

    def waiting(self) -> int:
        """How many requests wait to be taken."""
        with self._changed:
            return len(self._items)

    def take(self) -> Optional[tuple[Hashable, object]]:
        """The oldest waiting (key, request), or None."""
        with self._changed:
            return self._items.popleft() if self._items else None

    def cancel(self, key: Hashable) -> None:
        """Drop the request under `key`: out of the queue if it waits, else run_batch frees its row before its next
        pass (and yields nothing more for it)."""
        with self._changed:
            waiting = [item for item in self._items if item[0] == key]
            for item in waiting:
                self._items.remove(item)
            if not waiting and key in self._requests:
                self._cancelled.add(key)
            self._requests.pop(key, None)
            self._changed.notify_all()

    def take_cancelled(self) -> set:
        """The running requests cancelled since the last call (run_batch's)."""
        with self._changed:
            cancelled, self._cancelled = self._cancelled, set()
            return cancelled

    def request(self, key: Hashable):
        """The request put under `key` (until forget)."""
        return self._requests[key]

    def forget(self, key: Hashable) -> None:
        """The request under `key` is finished: the feed need not remember it."""
        self._requests.pop(key, None)
