"""Batch jobs sharded over a Ray cluster: N actors own one engine each; the driver hands out prompts and alone
writes the result file (jobs.write_results), so resume and exactly-once stay where they are for a one-process
job. engines_on_ray(run, setup, ray, notify) is jobs.engine_here's counterpart: a jobs.BatchRun on N workers.

    driver (`offspec batch --workers N`)                   actors (BatchWorker: one per GPU, or per CPU slot)
      skip ids already in OUT, tokenize every prompt
      probe one worker's machine, make its memory plan ──►  (a task placed the way a worker is placed)
        (plan.make_plan: auto concurrency resolved there)
      start N actors: num_gpus=1 | num_cpus, memory = the plan's host bytes
      keep each worker's feed topped up ───────────────►  load the engine once (again after a restart)
        (its rows' worth of prompts waiting)               Engine.run_batch over its feed (batched trees): a
                                                            finished row takes the next prompt at the next pass,
                                                            while the driver keeps putting more in
      write each finished prompt's line ◄───────────────── one event per prompt as it finishes
      the queue is empty: close the feeds ──────────────►  the run ends when its rows do
      a worker's process dies: the prompts given to it and not yet received go back to the front of the queue;
      Ray restarts the process (up to MAX_RESTARTS), which loads again and is fed again.

Nothing is lost (a prompt leaves the queue for good only when its line is written) and nothing is duplicated
(the driver writes an id once; a killed worker's stream ends at its death). A killed driver takes its actors
with it (they belong to its Ray job); rerunning the same command skips the ids already in OUT.
"""
from __future__ import annotations

import fcntl
import math
import os
import socket
import threading
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Callable, Iterator, Optional, Sequence, Union

import torch

from offspec.config import OffloadConfig, RunLimits, RuntimeConfig
from offspec.engine.feed import RequestFeed
from offspec.engine.metrics import JobReport
from offspec.errors import BudgetError, InputError, OffspecError
from offspec.jobs.runner import BatchRun, PromptDone, PromptRefused, Running, run_prompts

MAX_RESTARTS = 3              # Ray restarts a dead worker's process this many times, then it is gone for good
FEED_ROUNDS = 2               # a worker's feed is kept at this many times its concurrency prompts given and not
                              # yet back: its rows in flight and as many waiting, so a finished row is refilled at
                              # the next pass (the driver's answer to that row's line arrives passes later)
LOCAL_OBJECT_STORE = 128 << 20  # a local Ray's object store (Ray's minimum is 75 MiB): results are small
WAIT_SECONDS = 1.0            # the driver wakes at least this often (Ctrl-C, the progress bar's clock)
PLACEMENT_NOTICE_SECONDS = 60  # no worker loaded after this long: say what Ray is waiting for


class ClusterError(OffspecError):
    """The cluster cannot run the job (every worker died, too few GPUs, ...)."""


def import_ray():
    """The ray module, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise InputError("--workers runs the job on Ray, which is not installed here: pip install 'ray>=2.40' "
                         "(from a checkout: pip install -e '.[ray]')") from None
    return ray


@dataclass(frozen=True)
class RaySetup:
    """Where and how a batch job runs on Ray, as `offspec batch --workers` was given it."""
    workers: int                  # actors, one engine each
    worker_cpus: int              # CPU cores each claims from Ray (and its torch threads)
    address: Optional[str]        # the cluster to join ("auto", HOST:PORT, ray://HOST:PORT); None = a local Ray
                                  # started for the job and stopped after it
    device: Optional[str]         # the workers' device as given (--device); None = cuda where the cluster has
                                  # GPUs, else cpu
    draft_quant: str              # as given: "auto" is resolved for the workers' device (load.runtime_config)
    target: Optional[str]         # target folder or hub id as given; None = the embedded demo pair
    draft: tuple[str, ...]        # draft folders or hub ids as given (the one that runs: BatchRun.models.drafts)


@dataclass(frozen=True)
class WorkerSpec:
    """What every worker loads; the same on every node."""
    target: Optional[str]         # target folder (absolute) or hub id, opened on the worker's node; None with demo
    draft: Optional[str]          # draft folder, hub id or "self"; None: the target alone (demo: else the demo draft)
    demo: bool                    # the embedded demo models: each node converts its own copy (demo.py)
    offload: OffloadConfig
    runtime: RuntimeConfig        # device (cuda = the GPU Ray gave the actor), dtype, draft quantization
    limits: RunLimits             # context, tree budget, prefill chunk, prompts in flight: sized on the driver
                                  # (auto concurrency: the worker's own plan, capped at the driver's number)
    prefill_per_pass: Optional[int]  # prompt tokens a joining prompt is fed per pass; None = auto (run_batch)
    cpus: int                     # CPU cores claimed from Ray for the actor, and its torch threads


@dataclass(frozen=True)
class WorkerInfo:
    """What a worker says once its engine is loaded."""
    pid: int
    node: str                     # host name
    device: str
    layers_line: str              # the memory plan's placement of the target's layers
    load_seconds: float


class BatchWorker:
    """A Ray actor's body: one engine, loaded on the first call (and again in a process Ray restarted).

    A threaded actor (two threads): `give` and `close` reach the feed of a `run` while that run is busy. Each
    run has its own feed, named by the driver's run number, so prompts given to a run that died with an
    earlier process never enter a later run."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.loaded = None
        self.info: Optional[WorkerInfo] = None
        self.feeds: dict[int, RequestFeed] = {}          # run number -> its feed
        self.feeds_lock = threading.Lock()
        torch.set_num_threads(spec.cpus)

    def load(self) -> WorkerInfo:
        if self.loaded is None:
            from offspec.engine.load import SELF_DRAFT, Models

            spec = self.spec
            start = time.perf_counter()
            # A disk store (streaming may resolve to disk unless it is "none") or a demo model is built once per
            # node, by the first worker to load; the others wait for it and then open it.
            with node_lock(spec.demo or spec.offload.mode != "none"):
                target, draft = spec.target, spec.draft
                if spec.demo:
                    from offspec.formats.demo import ensure_demo_models
                    target, demo_draft = ensure_demo_models(progress=False)
                    draft = None if spec.draft is None else spec.draft if spec.draft == SELF_DRAFT else demo_draft
                self.loaded = Models.open(target, draft).load(spec.offload, spec.runtime, spec.limits, progress=False)
            self.info = WorkerInfo(os.getpid(), socket.gethostname(), str(self.loaded.engine.device),
                                   self.loaded.plan.layers_line(), time.perf_counter() - start)
        return self.info

    def _feed(self, run: int) -> RequestFeed:
        with self.feeds_lock:
            return self.feeds.setdefault(run, RequestFeed())

    def give(self, run: int, items: list) -> None:
        """items: [(request index on the driver, GenerationRequest)] for run number `run`."""
        self._feed(run).put(items)

    def close(self, run: int, given: int) -> None:
        """Run number `run` gets nothing beyond the `given` prompts the driver gave it in all (this call may
        overtake the last give): it ends when its rows do."""
        self._feed(run).close(after=given)

    def run(self, run: int, tokens_a_row: int) -> Iterator[Union[PromptDone, PromptRefused]]:
        """Every prompt given to run number `run` until it is closed; one event per prompt as it finishes,
        named by the driver's request index (a Ray streaming generator: the driver receives each as it is
        yielded). tokens_a_row: the most prompt + new tokens of any prompt of the job (sizes the caches)."""
        self.load()
        feed = self._feed(run)
        feed.tokens_a_row = tokens_a_row
        try:
            yield from run_prompts(self.loaded.engine, feed, self.spec.prefill_per_pass)
        finally:
            with self.feeds_lock:
                self.feeds.pop(run, None)


@contextmanager
def node_lock(needed: bool = True):
    """An exclusive flock on $OFFSPEC_HOME/.worker-load.lock while a worker loads (per node where the home is
    local): disk stores and demo conversions are written by one process at a time. needed False: no lock."""
    from offspec.formats.demo import offspec_home

    if not needed:
        yield
        return
    home = offspec_home()
    home.mkdir(parents=True, exist_ok=True)
    with open(home / ".worker-load.lock", "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def measure_machine(device_type: str):
    """Run on a worker's node, placed like a worker: that machine's sizes for the memory plan."""
    from offspec.plan.machine import Machine
    return Machine.measure(torch.device(device_type))


@dataclass
class WorkerReport:
    """One worker's share of the job (the job report's `workers`)."""
    name: str
    pid: Optional[int] = None           # its process (the last one, after restarts)
    node: str = ""
    device: str = ""
    prompts: int = 0
    generated_tokens: int = 0
    engine_seconds: float = 0.0         # its share of the passes it ran (draft + target time; a pass of R rows / R each)
    load_seconds: float = 0.0           # engine loads, restarts included
    restarts: int = 0                   # its process died and Ray restarted it
    requeued: int = 0                   # prompts given to it and handed back to the queue by those deaths
    peak_host_gb: float = 0.0           # the largest peak resident set its processes reported
    peak_device_gb: Optional[float] = None   # the largest peak device memory they reported (None: a CPU worker)

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": self.tokens_per_second}

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.engine_seconds if self.engine_seconds > 0 else 0.0

    def line(self) -> str:
        if self.pid is None:
            return f"{self.name}: no prompts (not loaded when the job ended)"
        return (f"{self.name} ({self.node} pid {self.pid}, {self.device}): {self.prompts} prompts, "
                f"{self.generated_tokens} tokens, {self.tokens_per_second:.2f} tokens/s over {self.engine_seconds:.1f} s "
                f"of passes, load {self.load_seconds:.1f} s"
                + (f", {self.restarts} restarts ({self.requeued} prompts requeued)" if self.restarts else ""))


@dataclass
class _Worker:
    report: WorkerReport
    actor: object                                   # the Ray actor handle
    given: list = field(default_factory=list)       # request indices given to it, not yet received
    ready: bool = False                             # loaded (a loading or restarting worker is given nothing)
    run: int = 0                                    # its current (or last) run's number
    run_given: int = 0                              # prompts given to that run in all
    running: bool = False                           # that run's stream is open
    closed: bool = False                            # ... and its feed is closed: it ends when its rows do
    gone: bool = False                              # dead for good (restarts spent)


class Cluster:
    """A connection to Ray (a local one started for the job, or `address`) and the job's workers.

    with Cluster(ray, address) as cluster:
        cluster.start(spec, n_workers, host_bytes)
        for event in cluster.run(requests): ...     # PromptDone / PromptRefused, each request exactly once
    """

    def __init__(self, ray, address: Optional[str] = None, notify: Callable[[str], None] = lambda text: None):
        self.ray, self.address = ray, address
        self.notify = notify          # one line on what happened to a worker (died, restarted, gone)
        self.owned = False            # this job started the Ray it runs on (and stops it)
        self.workers: list[_Worker] = []
        self.needs = ""               # what each worker claims from Ray, for messages

    def __enter__(self) -> "Cluster":
        ray = self.ray
        if not ray.is_initialized():
            kwargs = dict(include_dashboard=False, logging_level="ERROR", log_to_driver=True)
            if self.address is None:     # a local Ray for this job only
                kwargs.update(object_store_memory=LOCAL_OBJECT_STORE)
            else:
                check_reachable(self.address)
            try:
                ray.init(address=self.address, **kwargs)
            except (ConnectionError, ValueError, RuntimeError) as e:
                raise ClusterError(f"cannot reach the Ray cluster at {self.address or 'a new local Ray'}: "
                                   f"{str(e).splitlines()[0] if str(e) else type(e).__name__}") from None
            self.owned = True
        return self

    def __exit__(self, *exc) -> None:
        for worker in self.workers:
            try:
                self.ray.kill(worker.actor)
            except Exception:   # noqa: BLE001 - an actor already gone; nothing else to clean up
                pass
        self.workers = []
        if self.owned:
            self.ray.shutdown()

    # ------------------------------------------------------------ resources
    def gpus(self) -> int:
        return int(self.ray.cluster_resources().get("GPU", 0))

    def probe(self, device_type: str, cpus: int):
        """The memory-plan Machine of a node where a worker would run (free GPU and host memory there)."""
        options = dict(num_cpus=cpus, num_gpus=1 if device_type == "cuda" else 0)
        return self._get(self.ray.remote(**options)(measure_machine).remote(device_type))

    def check_slots(self, n_workers: int, device_type: str, cpus: int) -> None:
        """Refuse at once a job whose workers could never all be placed: GPUs and CPUs in the cluster."""
        total = self.ray.cluster_resources()
        if device_type == "cuda" and total.get("GPU", 0) < n_workers:
            raise ClusterError(f"--workers {n_workers} needs {n_workers} GPUs (one a worker); the cluster has "
                               f"{int(total.get('GPU', 0))}")
        if total.get("CPU", 0) < n_workers * cpus:
            raise ClusterError(f"--workers {n_workers} × --worker-cpus {cpus} needs {n_workers * cpus} CPUs; the "
                               f"cluster has {int(total.get('CPU', 0))}")

    def check_memory(self, host_bytes: int) -> None:
        """A worker's host memory (its memory plan's) must fit one node's Ray memory resource."""
        node_memory = max((n["Resources"].get("memory", 0) for n in self.ray.nodes() if n.get("Alive")), default=0)
        if host_bytes > node_memory:
            raise BudgetError(f"a worker's memory plan needs {host_bytes / 1e9:.1f} GB of host memory; the largest "
                              f"Ray node offers {node_memory / 1e9:.1f} GB: lower --context or --concurrency, or use "
                              f"--offload disk")

    def start(self, spec: WorkerSpec, n_workers: int, host_bytes: int) -> None:
        """n_workers actors, each claiming one GPU (cuda) or spec.cpus cores, and host_bytes of memory."""
        options = dict(num_cpus=spec.cpus, num_gpus=1 if spec.runtime.device.type == "cuda" else 0,
                       memory=max(1, host_bytes), max_restarts=MAX_RESTARTS, max_task_retries=0,
                       max_concurrency=2)     # a run, and the driver's give/close beside it (BatchWorker)
        self.needs = (f"{spec.cpus} CPU{'s' if spec.cpus > 1 else ''}"
                      + (", 1 GPU" if options["num_gpus"] else "") + f" and {host_bytes / 1e9:.1f} GB of memory")
        actor_class = self.ray.remote(BatchWorker).options(**options)
        for i in range(n_workers):
            self.workers.append(_Worker(WorkerReport(f"worker {i}"), actor_class.remote(spec)))

    # ------------------------------------------------------------ the job
    def run(self, requests: Sequence, concurrency: int) -> Iterator[Union[PromptDone, PromptRefused]]:
        """Every request once, as workers finish them (any order). Workers load as soon as they are placed; a
        loaded worker's feed is kept topped up from the queue's front (`settle`). concurrency: a worker's rows in
        flight, its memory plan's."""
        ray = self.ray
        queue = deque(range(len(requests)))
        open_requests = set(range(len(requests)))      # neither written nor refused yet
        tokens_a_row = max((len(r.prompt_ids) + r.max_new_tokens for r in requests), default=1)
        waiting: dict = {}                              # load ref or run stream -> (worker, kind)
        for worker in self.workers:
            waiting[worker.actor.load.remote()] = (worker, "load")
        started, noticed = time.monotonic(), False

        def settle() -> None:
            """Top up every loaded worker's feed to FEED_ROUNDS x concurrency prompts given and not yet back
            (never more than its share of the queue, so the last prompts spread over the workers), starting a
            run where none is open; once the queue is empty, close the open feeds so their runs end."""
            live = sum(w.ready and not w.gone for w in self.workers)
            for worker in self.workers:
                if not worker.ready or worker.gone or worker.closed:   # a closed run must end before the next
                    continue
                want = min(FEED_ROUNDS * concurrency - len(worker.given), math.ceil(len(queue) / max(live, 1)))
                items = [queue.popleft() for _ in range(max(0, min(want, len(queue))))]
                if items and not worker.running:
                    worker.run, worker.run_given, worker.running = worker.run + 1, 0, True
                    waiting[worker.actor.run.remote(worker.run, tokens_a_row)] = (worker, "run")
                if items:
                    worker.actor.give.remote(worker.run, [(i, requests[i]) for i in items])
                    worker.given += items
                    worker.run_given += len(items)
                if not queue and worker.running:
                    worker.actor.close.remote(worker.run, worker.run_given)
                    worker.closed = True

        def lost(worker: _Worker, error) -> None:
            """The worker's process died: its unfinished prompts go back first in line; Ray restarts it."""
            report = worker.report
            report.restarts += 1
            report.requeued += len(worker.given)
            queue.extendleft(reversed(worker.given))
            self.notify(f"{report.name} (pid {report.pid}) died ({type(error).__name__}); "
                        f"{len(worker.given)} prompts back in the queue, Ray restarts it")
            worker.given, worker.ready, worker.running, worker.closed = [], False, False, False
            waiting[worker.actor.load.remote()] = (worker, "load")   # answered once Ray has restarted it

        while open_requests:
            if not waiting:
                raise ClusterError(f"every worker is gone ({len(open_requests)} prompts not done); finished "
                                   "prompts are saved: rerun to resume")
            ready, _ = ray.wait(list(waiting), num_returns=1, timeout=WAIT_SECONDS)
            if not ready:
                if (not noticed and time.monotonic() - started > PLACEMENT_NOTICE_SECONDS
                        and all(w.report.pid is None for w in self.workers)):
                    noticed = True
                    self.notify(f"no worker has started after {PLACEMENT_NOTICE_SECONDS} s: Ray has not placed one "
                                f"yet (each needs {self.needs}); the cluster may be busy")
                continue
            key = ready[0]
            worker, kind = waiting.pop(key)
            if kind == "load":
                try:
                    info = self._get(key)
                except ray.exceptions.ActorDiedError as e:       # restarts spent, or it cannot start at all
                    worker.gone = True
                    self.notify(f"{worker.report.name} is gone: {_first_line(e)}")
                    continue
                except ray.exceptions.RayActorError:            # still restarting: ask again
                    waiting[worker.actor.load.remote()] = (worker, "load")
                    continue
                worker.report.pid, worker.report.node, worker.report.device = info.pid, info.node, info.device
                worker.report.load_seconds += info.load_seconds
                worker.ready = True
                settle()
                continue
            try:
                ref = next(key)
            except StopIteration:                               # the run ended: its feed was closed and is done
                worker.running = worker.closed = False
                settle()
                continue
            try:
                event = self._get(ref)
            except ray.exceptions.RayActorError as e:
                lost(worker, e)
                settle()
                continue
            waiting[key] = (worker, "run")
            worker.given.remove(event.request)
            settle()
            if event.request not in open_requests:             # never twice, whatever a retry might send
                continue
            open_requests.discard(event.request)
            if isinstance(event, PromptDone):
                report = worker.report
                report.prompts += 1
                report.generated_tokens += sum(len(s.tokens) for s in event.steps)
                report.engine_seconds += sum((s.draft_seconds + s.target_seconds) / s.rows_in_pass
                                             for s in event.steps)
                report.peak_host_gb = max(report.peak_host_gb, event.report.peak_host_gb)
                if event.report.peak_device_gb is not None:
                    report.peak_device_gb = max(report.peak_device_gb or 0.0, event.report.peak_device_gb)
            yield event

    def _get(self, ref):
        """ray.get, with a worker's own known failure (an OffspecError, an OSError) re-raised as itself."""
        try:
            return self.ray.get(ref)
        except self.ray.exceptions.RayTaskError as e:
            cause = getattr(e, "cause", None)
            if isinstance(cause, (OffspecError, OSError)):
                raise cause from None
            raise ClusterError(f"a worker failed: {type(cause).__name__ if cause else 'error'}: "
                               f"{_first_line(cause or e)}") from None


def check_reachable(address: str, timeout: float = 5.0) -> None:
    """HOST:PORT (or ray://HOST:PORT) must accept a connection: Ray itself retries an unreachable address for
    minutes. 'auto' (this node's `ray start`) is Ray's to find."""
    if address == "auto":
        return
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        raise InputError(f"--ray-address {address!r}: expected auto, HOST:PORT or ray://HOST:PORT")
    try:
        socket.create_connection((host, int(port)), timeout=timeout).close()
    except OSError as e:
        raise ClusterError(f"cannot reach the Ray cluster at {address}: {e.strerror or e}") from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def plan_host_bytes(plan) -> int:
    """Host memory a worker's memory plan counts: its host items, and on a CPU device the device items too."""
    return plan.total("host") + (plan.total("device") if plan.machine.kind == "cpu" else 0)


@contextmanager
def engines_on_ray(run: BatchRun, setup: RaySetup, ray, notify: Callable[[str], None]) -> Iterator[Running]:
    """`run` on setup.workers Ray workers with an engine each: yields the job under way (jobs.Running); the caller
    stays the only writer. notify(line): what happened to a worker (died, restarted, gone).

    The workers' device: setup.device, else cuda where the cluster has GPUs, else cpu. Their memory plan is made
    here, for the machine a probe task placed like a worker measures: a job no worker can hold stops before any
    starts, and the plan's rows in flight (auto concurrency resolved) size each worker's feed."""
    from offspec.engine.load import SELF_DRAFT, parse_device, runtime_config

    with Cluster(ray, setup.address, notify) as cluster:
        device = setup.device or ("cuda" if cluster.gpus() > 0 else "cpu")
        if device.startswith("cuda") and cluster.gpus() == 0:
            raise ClusterError(f"--device {device}: the Ray cluster has no GPU")
        runtime = runtime_config(parse_device(device, check_available=False), run.runtime.dtype, setup.draft_quant,
                                 run.runtime.target_quant, run.runtime.resident_quant, twin=run.models.twin)
        cluster.check_slots(setup.workers, runtime.device.type, setup.worker_cpus)
        machine = cluster.probe(runtime.device.type, setup.worker_cpus)
        plan = run.models.plan(run.offload, runtime, run.limits, machine)    # what a worker cannot hold stops here
        host_bytes = plan_host_bytes(plan)
        cluster.check_memory(host_bytes)
        demo, chosen = setup.target is None, run.models.drafts       # chosen: the plan's draft, of those given
        draft = None if not chosen else SELF_DRAFT if chosen[0].twin else "demo" if demo else absolute(chosen[0].given)
        # Each worker plans again when it loads, on its own node: never more rows than Ray was told the memory of.
        spec = WorkerSpec(target=absolute(setup.target), draft=draft, demo=demo, offload=run.offload,
                          runtime=replace(runtime, draft_quant=plan.draft_quant),
                          limits=replace(run.limits, concurrency_cap=plan.concurrency),
                          prefill_per_pass=run.prefill_per_pass, cpus=setup.worker_cpus)
        cluster.start(spec, setup.workers, host_bytes)
        where = (f"ray: {setup.workers} workers on {runtime.device.type} ({setup.worker_cpus} CPU"
                 f"{'s' if setup.worker_cpus > 1 else ''}{', 1 GPU' if runtime.device.type == 'cuda' else ''} and "
                 f"{host_bytes / 1e9:.1f} GB host memory each, by the memory plan), {plan.concurrency} prompts in "
                 f"flight each; {plan.layers_line()}")
        yield Running(cluster.run(run.requests, plan.concurrency),
                      JobReport(concurrency=plan.concurrency, workers=[w.report for w in cluster.workers]),
                      status=lambda: f"{sum(not w.gone for w in cluster.workers)}/{setup.workers} workers",
                      where=where)


def absolute(name: Optional[str]) -> Optional[str]:
    """A model folder that exists here as an absolute path (a worker's working folder is not ours); a hub id as
    given (each node resolves it in its own cache)."""
    if name is None or not Path(name).expanduser().exists():
        return name
    return str(Path(name).expanduser().resolve())
