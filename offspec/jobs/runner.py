"""The job runner: a batch of prompts through an engine, one event per prompt, written by one writer.

    run_prompts(engine, requests)     Engine.run_batch's per-pass RowSteps -> one event per prompt as it
                                      finishes (PromptDone) or is refused (PromptRefused); what `offspec batch`
                                      runs here and every Ray worker runs there (cluster.BatchWorker)
    engine_here(run)                  a BatchRun on one engine in this process -> Running (its events, its
                                      JobReport); cluster.engines_on_ray is the same on Ray workers
    write_results(...)                the one writer: each finished prompt's line in the result file
                                      (batch.ResultFile), the job's totals, the progress bar

Rows in flight are the engine's memory plan's (plan.make_plan resolves --concurrency auto; Models.load hands
the number to the Engine): nothing here decides them.
"""
from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

from tqdm import tqdm

from offspec.config import OffloadConfig, RunLimits, RuntimeConfig
from offspec.engine import metrics
from offspec.engine.feed import RequestFeed
from offspec.engine.metrics import JobReport, RunReport, Step
from offspec.errors import InputError
from offspec.jobs.prompt_files import result_record


@dataclass(frozen=True)
class PromptDone:
    """A finished prompt: its report (the result line is made from it) and the Steps of its passes (the job's
    totals are counted from them)."""
    request: int                     # index in the requests given to run_prompts (with a feed: its key)
    report: RunReport
    steps: list[Step]


@dataclass(frozen=True)
class PromptRefused:
    """A prompt the engine refused (an empty prompt, one longer than the context, ...)."""
    request: int
    error: InputError


Event = Union[PromptDone, PromptRefused]


def run_prompts(engine, requests: Union[Sequence, RequestFeed], prefill_per_pass: Optional[int] = None
                ) -> Iterator[Event]:
    """Engine.run_batch over `requests` (GenerationRequests, or a RequestFeed that may be put more while the job
    runs: a Ray worker's), one event per prompt as each finishes; an event's `request` is the request's
    position in the list, or its key in the feed. Rows in flight: the engine's memory plan's (with auto
    concurrency the most it fits, of which the measured costs may keep fewer)."""
    feed = requests if isinstance(requests, RequestFeed) else RequestFeed.of(requests)
    steps: dict = {}
    for event in engine.run_batch(feed, prefill_per_pass=prefill_per_pass):     # rows in flight: the plan's
        if event.error is not None:
            feed.forget(event.request)
            yield PromptRefused(event.request, event.error)
            continue
        steps.setdefault(event.request, []).append(event.step)
        if event.step.finish_reason is not None:
            done, request = steps.pop(event.request), feed.request(event.request)
            feed.forget(event.request)
            yield PromptDone(event.request, metrics.report_of(engine, request, done), done)


@dataclass(frozen=True)
class BatchRun:
    """What a batch job runs, wherever its engines are."""
    models: object                      # load.Models, opened (configs, headers, tokenizer)
    offload: OffloadConfig
    runtime: RuntimeConfig              # this machine's (engine_here); engines_on_ray makes the workers' own
    limits: RunLimits                   # context, tree budget, prefill chunk, prompts in flight per engine
                                        # (concurrency None = auto, capped by the job's prompts: the plan decides)
    prefill_per_pass: Optional[int]     # prompt tokens a joining prompt is fed per pass; None = auto (run_batch)
    requests: list                      # GenerationRequests, tokenized


@dataclass(frozen=True)
class Running:
    """A job under way, wherever its engines are: what write_results consumes."""
    events: Iterator[Event]                     # one per prompt, as each finishes
    report: JobReport                           # the job's totals, counted as its events are written
    status: Optional[Callable[[], str]] = None  # the progress bar's prefix (Ray: the workers alive)
    where: str = ""                             # one line on where the job runs (Ray: workers, claims, layers)


@contextmanager
def engine_here(run: BatchRun) -> Iterator[Running]:
    """One engine in this process, loaded by the job's memory plan and closed on the way out."""
    loaded = run.models.load(run.offload, run.runtime, run.limits)
    try:
        yield Running(run_prompts(loaded.engine, run.requests, run.prefill_per_pass),
                      JobReport(concurrency=loaded.plan.concurrency, device=str(loaded.engine.device)))
    finally:
        loaded.engine.close()


def write_results(running: Running, requests: list, results, refused: Callable[[object, InputError], str]) -> None:
    """The one writer: each finished prompt's line in `results` (batch.ResultFile), in the order prompts finish,
    counted into running.report; a progress bar on stderr. requests: [(batch.PromptItem, GenerationRequest)],
    which the events index. refused(item, error): the line to print for a refused prompt (or it raises, to
    stop the job). Ctrl-C (KeyboardInterrupt) goes to the caller, every written line complete."""
    job = running.report
    bar = tqdm(total=len(requests), desc="prompts", unit="prompt", file=sys.stderr, dynamic_ncols=True)
    started = time.perf_counter()
    try:
        for event in running.events:
            item, _ = requests[event.request]
            if not isinstance(event, PromptDone):     # e.g. a prompt longer than the context: skip it, keep going
                bar.write(refused(item, event.error), file=sys.stderr)
                bar.update(1)
                continue
            results.append(result_record(item, event.report))
            for step in event.steps:
                job.add(step)
            job.prompts += 1
            job.wall_seconds = time.perf_counter() - started
            bar.update(1)
            bar.set_postfix_str((f"{running.status()}, " if running.status else "")
                                + f"{job.generated_tokens / job.wall_seconds:.2f} tokens/s, "
                                f"{job.generated_tokens / max(job.passes, 1e-9):.2f} tokens/pass")
    finally:
        bar.close()
