"""The engine's thread: Engine.run_batch over an open RequestFeed for the server's life, and what it counts.

A request is submitted with a callback, which hears each of its RowSteps on the engine's thread (None: the engine
failed). The gate counts what the engine holds: a request counts from its submission until its last step (or its
cancellation), not while a slow client is still reading its answer, so a stalled reader never holds a row. A
failure of the engine fails every request in flight (their callbacks hear None), marks the service failed and
calls on_failure (the server then exits non-zero: cli/serve.py). drain() refuses new requests and tells every
answer in flight to end now (the HTTP side ends each with a proper last chunk).
"""
from __future__ import annotations

import threading
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, Optional

from offspec.engine.feed import RequestFeed
from offspec.engine.request import GenerationRequest
from offspec.serve.requests import ApiError

DRAINED = "drained"      # what drain() tells every callback: the server is shutting down


@dataclass
class Counters:
    """What /metrics exposes (serve/metrics.py): monotone totals, read under the service's lock."""
    passes: float = 0.0            # target passes: each RowStep counts 1 / the rows that shared its pass
    pass_seconds: float = 0.0      # their seconds (each pass's counted once, spread over its rows)
    tokens: int = 0                # tokens generated
    requests: Counter = field(default_factory=Counter)   # answered requests by HTTP status


class EngineService:
    """Engine.run_batch over an open RequestFeed on its own thread; each request's RowSteps go to its callback
    (called on the engine's thread)."""

    def __init__(self, engine, concurrency: int, max_waiting: int, on_failure: Optional[Callable[[str], None]] = None):
        self.engine, self.rows, self.max_waiting = engine, concurrency, max_waiting
        self.feed = RequestFeed()
        self.failure: Optional[str] = None
        self.draining = False
        self.counters = Counters()
        self.on_failure = on_failure
        self._callbacks: dict[int, Callable] = {}
        self._held: set[int] = set()        # requests the engine holds: waiting for a row, or running
        self._lock = threading.Lock()
        self._next = 0
        self._thread = threading.Thread(target=self._run, args=(concurrency,), name="offspec-engine", daemon=True)
        self._thread.start()

    @property
    def passes(self) -> float:
        return self.counters.passes

    def _run(self, concurrency: Optional[int]) -> None:
        try:
            for row_step in self.engine.run_batch(self.feed, concurrency=concurrency):
                self._count(row_step)
                with self._lock:
                    callback = self._callbacks.get(row_step.request)
                if callback is not None:
                    callback(row_step)
        except BaseException as err:       # the engine is gone: tell every request in flight, /health, the server
            with self._lock:
                self.failure = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                callbacks = list(self._callbacks.values())
                self._held.clear()
            for callback in callbacks:
                callback(None)
            if self.on_failure is not None:
                self.on_failure(self.failure)

    def _count(self, row_step) -> None:
        step = row_step.step
        with self._lock:
            if step is not None:
                self.counters.passes += 1 / step.rows_in_pass
                self.counters.pass_seconds += step.target_seconds / step.rows_in_pass
                self.counters.tokens += len(step.tokens)
            if step is None or step.finish_reason is not None:
                self._held.discard(row_step.request)           # the engine is done with it: its row is free

    def submit(self, request: GenerationRequest, callback: Callable) -> int:
        """Queue `request`; -> its key. ApiError 429 when every row is taken and max_waiting requests already wait
        for one; 503 while the server shuts down; 500 once the engine has failed."""
        with self._lock:
            if self.failure is not None:
                raise ApiError(500, f"the engine failed: {self.failure}", kind="server_error")
            if self.draining:
                raise ApiError(503, "the server is shutting down", kind="server_error", headers={"Retry-After": "5"})
            if len(self._held) >= self.rows + self.max_waiting:
                raise ApiError(429, f"all {self.rows} rows are taken and {self.max_waiting} requests wait for one; "
                               f"retry shortly", kind="rate_limit_error", headers={"Retry-After": "1"})
            key, self._next = self._next, self._next + 1
            self._callbacks[key] = callback
            self._held.add(key)
        self.feed.put([(key, request)])
        return key

    def in_flight(self) -> int:
        """Requests the engine holds: waiting for a row or running."""
        with self._lock:
            return len(self._held)

    def answering(self) -> int:
        """Requests whose answers are not finished on the HTTP side (a slow reader's included)."""
        with self._lock:
            return len(self._callbacks)

    def done(self, key: int, cancel: bool) -> None:
        """The request under `key` is answered (or its client left, or the server drains: cancel frees its row at
        the next pass)."""
        with self._lock:
            self._callbacks.pop(key, None)
            self._held.discard(key)
        if cancel:
            self.feed.cancel(key)
        self.feed.forget(key)

    def answered(self, status: int) -> None:
        with self._lock:
            self.counters.requests[status] += 1

    def snapshot(self) -> tuple[Counters, int, int]:
        """(a copy of the counters, requests in the engine, of those waiting for a row)."""
        with self._lock:
            counters = Counters(self.counters.passes, self.counters.pass_seconds, self.counters.tokens,
                                Counter(self.counters.requests))
            held = len(self._held)
        return counters, held, self.feed.waiting()

    def drain(self) -> None:
        """Refuse new requests (503), and end every answer in flight now: each callback hears DRAINED (app.py ends
        the answer with a proper last chunk; its request is cancelled, its row freed at the next pass)."""
        with self._lock:
            self.draining = True
            callbacks = list(self._callbacks.values())
        for callback in callbacks:
            callback(DRAINED)

    def close(self) -> None:
        self.feed.close()
        self._thread.join(timeout=30)
