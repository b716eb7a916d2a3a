"""One Timer, one Step record, one RunReport: shared by the CLI, batch jobs and benchmarks."""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Optional

import psutil
import torch

from offspec.engine.prompt import IncrementalText
from offspec.formats.published import describe as describe_quant
from offspec.formats.published import is_published
from offspec.spec.calibrate import AcceptanceCounts
from offspec.spec.sequoia import RankCounts, chosen_policy


def synchronize(device: torch.device) -> None:
    """Wait for the compute work queued so far, so host clocks measure it (once per phase, never per layer).

    Only the calling thread's current stream (the compute stream), never the whole device: a device-wide
    torch.cuda.synchronize would also wait for the streamer's copy stream, so the next pass's first layers
    could never be copied while the draft works, and every phase would absorb the copies' time."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


class Timer:
    """Wall-clock seconds of a phase, its compute-stream work included: `with Timer(dev) as t: ...; t.seconds`."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds = 0.0

    def __enter__(self) -> "Timer":
        synchronize(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        synchronize(self.device)
        self.seconds = time.perf_counter() - self._start


@dataclass
class Step:
    """One round of the generation loop: grow a tree, verify it in one target pass, commit, emit."""
    tokens: list[int]            # tokens emitted this round (accepted path + bonus), cut at a stop
    accepted: int                # draft tokens the target accepted (the bonus not counted)
    tree_size: int               # nodes in the tree (root excluded); 0 for plain autoregressive
    tree_depth: int              # deepest level of the tree
    pass_tokens: int             # tokens the target pass processed (pending prompt + root + tree)
    draft_seconds: float         # draft work this round (catch-up + growth)
    target_seconds: float        # the whole target pass
    wait_seconds: float          # part of the target pass spent waiting for streamed weights
    transfer_seconds: float      # time the weight copies of this pass took (overlapped with compute)
    bytes_streamed: int          # weight bytes moved into the compute device this pass
    prefetched_bytes: int = 0    # of those, already in their slots when the pass began (copied while drafting)
    dequant_seconds: float = 0.0  # quantized target: time dequantizing this pass's streamed layers (on the copy
                                  # queue, overlapped; a compact ring's at their use, in line with compute)
    rows_in_pass: int = 1        # requests that shared this pass (its times and bytes are the whole pass's)
    finish_reason: Optional[str] = None   # "eos" | "stop" | "length" | "context" when this round ends generation
    acceptance_counts: Optional[AcceptanceCounts] = None   # what this round's tree said about acceptance (calibrate.py)
    rank_counts: Optional[RankCounts] = None   # policy "sequoia": the same, by rank (sequoia.RankCounts)


@dataclass(frozen=True)
class StartTimes:
    """The start of a run, seconds: opening the models (configs, headers, tokenizers), the memory plan, loading
    the draft (its quantized copies included) and the target (globals, resident layers, arena or store), all
    before the first round; and draft_beside, what the run waited after its first round for a draft that loaded
    beside it (draft.DraftBeside: 0 for a draft loaded before)."""
    open: float = 0.0
    plan: float = 0.0
    draft: float = 0.0
    target: float = 0.0
    draft_beside: float = 0.0

    @property
    def total(self) -> float:
        return self.open + self.plan + self.draft + self.target + self.draft_beside

    @property
    def before_first_round(self) -> float:
        return self.total - self.draft_beside


@dataclass
class RunReport:
    """What a user reads after a run (stderr summary and the --json file)."""
    prompt_tokens: int
    new_tokens: int
    tokens: list[int]
    text: str
    finish_reason: str
    seconds_per_token: float            # decode only: (sum of rounds after the first pass) / tokens they made
    seconds_per_token_e2e: float        # load + prefill + decode, per generated token
    tokens_per_pass: float              # generated tokens / target passes
    passes: int
    prefill_seconds: float              # the first target pass (prompt + first tree)
    decode_seconds: float
    load_seconds: float                 # StartTimes.total: the load, plus any wait for a draft loading beside the
                                        # first round
    draft_seconds: float
    target_seconds: float
    wait_seconds: float
    compute_seconds: float              # target_seconds - wait_seconds
    transfer_seconds: float
    gb_streamed: float
    gb_per_second: float                # streamed bytes / transfer seconds
    prefetch_gb: float                  # streamed bytes already in their slots when their pass began (moved while drafting)
    dequant_seconds: float              # quantized target: dequantizing streamed layers (copy queue, overlapped; a
                                        # compact ring's on the compute queue, in line)
    peak_host_gb: float
    peak_device_gb: Optional[float]
    tree_policy: str
    tree_budget: Optional[int]
    offload: str
    weights_source: str                 # "resident", or where streamed layers live and whether pinned (and why not)
    device: str
    dtype: str
    target_quant: str                   # "none" | "int8" | "nf4" | a published one ("awq-g128"): the target that ran (output is exactly ITS output)
    draft_quant: str = "none"           # "none" | "int8" (copy) | "int8-held" | "nf4": the draft that ran (changes acceptance only)
    draft_twin: bool = False            # the draft was the target's twin (--draft self)
    acceptance: list[int] = field(default_factory=list)   # accepted draft tokens per round
    tree_sizes: list[int] = field(default_factory=list)   # tree nodes proposed per round
    memory_plan: Optional[dict] = None  # plan.MemoryPlan.to_dict(): where every byte was planned to live
    calibration: Optional[dict] = None  # predicted vs observed acceptance of tree nodes (calibrate.AcceptanceCounts.report)
    start: Optional[dict] = None        # the load split (StartTimes: open, plan, draft, target, draft_beside)

    def to_dict(self) -> dict:
        return {**asdict(self), "tokens_per_second": tokens_per_second(self.seconds_per_token),
                "tokens_per_second_e2e": tokens_per_second(self.seconds_per_token_e2e)}

    def start_line(self) -> str:
        """Where the time before the first token went: the load's parts, then the first round."""
        start = StartTimes(**self.start) if self.start else StartTimes(target=self.load_seconds)
        parts = (": " + ", ".join(f"{name.replace('_', ' ')} {seconds:.2f} s" for name, seconds in self.start.items())
                 if self.start else "")
        return (f"load {self.load_seconds:.2f} s{parts}; first round {self.prefill_seconds:.2f} s; first token "
                f"at {start.before_first_round + self.prefill_seconds:.2f} s")

    def summary(self) -> str:
        dev = f", device peak {self.peak_device_gb:.2f} GB" if self.peak_device_gb is not None else ""
        prefetch = (f", {self.prefetch_gb:.2f} GB of it moved while drafting" if self.gb_streamed > 0 else "")
        plan = f"\nplan: {self.memory_plan['layers_line']}" if self.memory_plan else ""
        plan += "".join(f"\nplan note: {n}" for n in (self.memory_plan or {}).get("notes", ()))
        cal = self.calibration
        if cal and cal["draft_nodes"]:
            plan += (f"\nnode acceptance: draft nodes {cal['draft_observed']:.3f} observed vs {cal['draft_p']:.3f} by "
                     f"draft probability, {cal['draft_estimate']:.3f} estimated ({cal['draft_nodes']} nodes)")
            if cal["ngram_nodes"]:
                plan += (f"; n-gram nodes {cal['ngram_observed']:.3f} observed vs {cal['ngram_estimate']:.3f} "
                         f"estimated ({cal['ngram_nodes']})")
        dequant = f", dequantized in {self.dequant_seconds:.2f} s" if self.target_quant != "none" else ""
        quant = ("" if self.target_quant == "none" else
                 f", target {describe_quant(self.target_quant)} as published" if is_published(self.target_quant) else
                 f", target quantized {self.target_quant} (output is that quantized target's)")
        if self.draft_twin:
            quant += f", draft self ({self.draft_quant})"
        elif self.draft_quant != "none":
            quant += f", draft {self.draft_quant}"
        return (
            f"{self.new_tokens} tokens in {self.passes} target passes ({self.tokens_per_pass:.2f} tokens/pass), "
            f"finish: {self.finish_reason}\n"
            f"{self.seconds_per_token:.4f} s/token decode, {self.seconds_per_token_e2e:.4f} s/token end to end "
            f"({self.start_line()})\n"
            f"target {self.target_seconds:.2f} s (waiting for weights {self.wait_seconds:.2f} s, compute "
            f"{self.compute_seconds:.2f} s), draft {self.draft_seconds:.2f} s; streamed {self.gb_streamed:.2f} GB "
            f"at {self.gb_per_second:.2f} GB/s{prefetch}{dequant}\n"
            f"tree {self.tree_policy} (budget {self.tree_budget if self.tree_budget is not None else 'auto'}), "
            f"offload {self.offload} ({self.weights_source}), {self.device} {self.dtype}{quant}; host peak "
            f"{self.peak_host_gb:.2f} GB{dev}"
            f"{plan}"
        )


@dataclass
class JobReport:
    """A batch job's totals (`offspec batch` stderr summary and --json), counted from every row's Steps. A
    pass shared by R rows reports its whole time and bytes in each of their R Steps, so each Step adds 1/R
    of a pass, of its seconds and of its bytes."""
    concurrency: int                    # requests in flight at once (in each engine: each Ray worker has one)
    device: Optional[str] = None        # where this process's engine computes; None: the engines are Ray workers'
    prompts: int = 0                    # requests finished (a line written each)
    skipped: int = 0                    # requests refused or malformed
    generated_tokens: int = 0
    passes: float = 0.0                 # target passes (each streams every layer once)
    row_steps: int = 0                  # (request, pass) pairs
    bytes_streamed: float = 0.0         # weight bytes moved, summed over passes
    draft_seconds: float = 0.0          # the draft's work (catch-up and growth of every row's tree), summed over passes
    target_seconds: float = 0.0         # target passes
    wait_seconds: float = 0.0           # of those, waiting for streamed layers
    transfer_seconds: float = 0.0       # the weight reads' and copies' own time (overlapping the draft and compute)
    wall_seconds: float = 0.0           # from the first pass to the last line (with Ray workers, from their start)
    workers: list = field(default_factory=list)   # cluster.WorkerReport of each Ray worker (batch --workers)

    def add(self, step: Step) -> None:
        share = 1 / step.rows_in_pass
        self.generated_tokens += len(step.tokens)
        self.passes += share
        self.row_steps += 1
        self.bytes_streamed += step.bytes_streamed * share
        self.draft_seconds += step.draft_seconds * share
        self.target_seconds += step.target_seconds * share
        self.wait_seconds += step.wait_seconds * share
        self.transfer_seconds += step.transfer_seconds * share

    def to_dict(self) -> dict:
        tokens, passes = self.generated_tokens, max(self.passes, 1e-9)
        device_peaks = ([peak_device_gb(torch.device(self.device))] if self.device is not None else
                        [w.peak_device_gb for w in self.workers])
        device_peaks = [gb for gb in device_peaks if gb is not None]
        return {**asdict(self), "passes": round(self.passes),
                "tokens_per_second": tokens / self.wall_seconds if self.wall_seconds > 0 else 0.0,
                "rows_per_pass": self.row_steps / passes, "tokens_per_pass": tokens / passes,
                "gb_streamed_per_token": self.bytes_streamed / 1e9 / tokens if tokens else 0.0,
                # where a pass's time went: what to change (a bigger tree, more rows, a faster drive) follows
                "draft_seconds_per_pass": self.draft_seconds / passes,
                "target_seconds_per_pass": self.target_seconds / passes,
                "wait_seconds_per_pass": self.wait_seconds / passes,
                "stream_gb_per_second": (self.bytes_streamed / 1e9 / self.transfer_seconds
                                         if self.transfer_seconds > 0 else None),
                "peak_host_gb": peak_host_gb(), "peak_device_gb": max(device_peaks) if device_peaks else None,
                "workers": [w.to_dict() for w in self.workers]}

    def summary(self) -> str:
        d = self.to_dict()
        return (f"done: {self.prompts} prompts, {self.generated_tokens} tokens in {self.wall_seconds:.1f} s "
                f"({d['tokens_per_second']:.2f} tokens/s), {d['passes']} passes ({d['rows_per_pass']:.2f} prompts and "
                f"{d['tokens_per_pass']:.2f} tokens a pass, {d['gb_streamed_per_token']:.3f} GB streamed a token); "
                f"skipped {self.skipped} bad")

    def pass_line(self) -> str:
        """Where a pass's time went, e.g. "a pass: draft 1.23 s, target 1.67 s (0.70 s of it waiting for weights
        streamed at 1.58 GB/s)"."""
        d = self.to_dict()
        stream = (f" ({d['wait_seconds_per_pass']:.2f} s of it waiting for weights streamed at "
                  f"{d['stream_gb_per_second']:.2f} GB/s)" if d["stream_gb_per_second"] is not None else "")
        return (f"a pass: draft {d['draft_seconds_per_pass']:.2f} s, target {d['target_seconds_per_pass']:.2f} s"
                f"{stream}")


def tokens_per_second(seconds_per_token: float) -> float:
    return 1 / seconds_per_token if seconds_per_token > 0 else 0.0


def offspec_version() -> str:
    """The installed offspec's version ("unknown" when run from a tree that was never installed)."""
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("offspec")
    except PackageNotFoundError:
        return "unknown"


def provenance(command: str, options: dict, target: Optional[str], draft: Optional[str]) -> dict:
    """What every JSON report says of the run that made it, beside its numbers: which offspec ("offspec": version
    and command), which models ("models": the target and draft folders that ran; draft None: the target alone)
    and which settings ("options": the command's options as given, defaults filled in)."""
    return {"offspec": {"version": offspec_version(), "command": command},
            "models": {"target": target, "draft": draft}, "options": options}


def peak_host_gb() -> float:
    """Peak resident set size of this process (Linux ru_maxrss is in KiB)."""
    try:
        import resource
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    except ImportError:  # Windows has no resource module
        return psutil.Process().memory_info().rss / 2**30


def peak_device_gb(device: torch.device) -> Optional[float]:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None


def weights_source(layers) -> str:
    """Where a target's streamed layers come from (its layer source's `host`, stream.staged.StoreInfo), for the
    report: pinned or not, and why; "resident" where nothing streams."""
    from offspec.formats.layout import format_bytes
    host = getattr(layers, "host", None)
    if host is None:
        return "resident"
    pinned = ("pinned" if host.pinned else
              f"{format_bytes(host.pinned_nbytes)} pinned, the rest pageable" if host.pinned_nbytes else
              f"pageable: {host.reason}")
    return f"{host.kind}, {pinned}" + (f"; reads: {host.io}" if host.io else "")


@dataclass(frozen=True)
class RunSetup:
    """What a report says of how the run was set up (RunReport's fields of the same names)."""
    tree_policy: str                    # the policy that ran ("none": plain decoding)
    tree_budget: Optional[int]          # None: auto
    offload: str
    weights_source: str
    device: str
    dtype: str
    target_quant: str = "none"
    draft_quant: str = "none"
    draft_twin: bool = False
    memory_plan: Optional[dict] = None


def build_report(steps: list[Step], *, prompt_tokens: int, text: str, setup: RunSetup,
                 start: Optional[StartTimes] = None) -> RunReport:
    """The RunReport of one request from the Steps of its passes."""
    tokens = [t for s in steps for t in s.tokens]
    n = len(tokens)
    round_seconds = [s.draft_seconds + s.target_seconds for s in steps]
    prefill = round_seconds[0] if steps else 0.0
    decode = sum(round_seconds[1:])
    decode_tokens = n - (len(steps[0].tokens) if steps else 0)
    target = sum(s.target_seconds for s in steps)
    wait = sum(s.wait_seconds for s in steps)
    transfer = sum(s.transfer_seconds for s in steps)
    streamed = sum(s.bytes_streamed for s in steps)
    load_seconds = start.total if start is not None else 0.0
    return RunReport(
        prompt_tokens=prompt_tokens, new_tokens=n, tokens=tokens, text=text,
        finish_reason=steps[-1].finish_reason if steps and steps[-1].finish_reason else "length",
        seconds_per_token=decode / decode_tokens if decode_tokens > 0 else (prefill / n if n else 0.0),
        seconds_per_token_e2e=(load_seconds + prefill + decode) / n if n else 0.0,
        tokens_per_pass=n / len(steps) if steps else 0.0,
        passes=len(steps), prefill_seconds=prefill, decode_seconds=decode, load_seconds=load_seconds,
        draft_seconds=sum(s.draft_seconds for s in steps), target_seconds=target, wait_seconds=wait,
        compute_seconds=target - wait, transfer_seconds=transfer, gb_streamed=streamed / 1e9,
        gb_per_second=streamed / 1e9 / transfer if transfer > 0 else 0.0,
        prefetch_gb=sum(s.prefetched_bytes for s in steps) / 1e9,
        dequant_seconds=sum(s.dequant_seconds for s in steps),
        peak_host_gb=peak_host_gb(), peak_device_gb=peak_device_gb(torch.device(setup.device)),
        acceptance=[s.accepted for s in steps], tree_sizes=[s.tree_size for s in steps],
        calibration=acceptance_report(steps), start=asdict(start) if start is not None else None, **asdict(setup),
    )


def acceptance_report(steps: list[Step]) -> Optional[dict]:
    """Every round's acceptance observations summed: predicted vs observed (None for plain decoding)."""
    counts = [s.acceptance_counts for s in steps if s.acceptance_counts is not None]
    if not counts:
        return None
    report = sum(counts[1:], counts[0]).report()
    ranks = [s.rank_counts for s in steps if s.rank_counts is not None]
    if ranks:
        by_rank = sum(ranks[1:], ranks[0])
        report["by_rank"] = {k: [int(x) for x in v] for k, v in by_rank.to_dict().items()}   # tried, hits
    return report


def report_of(engine, request, steps: list[Step], *, start=None, offload: Optional[str] = None,
              text: Optional[str] = None) -> RunReport:
    """The RunReport of one request (engine.request.GenerationRequest) on an engine (engine.generate.Engine) from
    its Steps: generate.run for one request, the job runner for each of many.
    text: the output text when the caller has it already (streamed); else it is decoded from the steps."""
    speculative = engine.speculative(request)
    setup = RunSetup(tree_policy=chosen_policy(request.tree.policy, engine.twin) if speculative else "none",
                     tree_budget=request.tree.budget if speculative else 0,
                     offload=offload or (engine.plan.mode if engine.plan is not None else "none"),
                     weights_source=engine.weights_source(), device=str(engine.device),
                     dtype=str(engine.target.dtype).replace("torch.", ""), target_quant=engine.target_quant,
                     draft_quant=engine.draft_quant if speculative else "none", draft_twin=speculative and engine.twin,
                     memory_plan=engine.plan.to_dict() if engine.plan is not None else None)
    if text is None:
        text = IncrementalText(engine.tokenizer, request.stop_strings).text([t for s in steps for t in s.tokens])
    if start is not None:       # a draft loaded beside the first round: what the run waited for it, counted here
        start = replace(start, draft_beside=engine.draft_waited)
    return build_report(steps, prompt_tokens=len(request.prompt_ids), text=text, setup=setup, start=start)
