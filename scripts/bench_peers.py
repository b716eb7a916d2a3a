#!/usr/bin/env python3
"""offspec against Hugging Face transformers + accelerate offloading, on the same prompts, models, stopping rule
and token budget; and offspec against itself (same-engine ablations).

Systems per regime, each prompt's runs repeated --repeats times in an order shuffled per prompt and repeat:
  hf-plain              transformers generate, target offloaded by accelerate
  hf-assisted           the same with assistant_model = the draft; --assist-tokens/-schedule/-threshold go on the
                        ASSISTANT's generation_config, where transformers reads them, and each row stores what
                        transformers used (peer_settings, read back after the call), the target passes a hook
                        counted (peer_passes) and the draft tokens those passes verified (peer_draft_tokens). Rows
                        from before issue #13 have none of these: they ran transformers' defaults (20 tokens,
                        constant, threshold 0.4), not the 5 tokens / threshold 0 they recorded.
  offspec-none          offspec --tree none (plain autoregressive on offspec's streaming engine)
  offspec-tree          offspec --tree dyspec, auto budget, the bf16 draft (the peer's models)
  offspec-tree-int8     the same with the int8 draft copy: offspec's CPU default (--no-int8-draft drops it)
  offspec-chain         ablation: --tree chain --tree-budget L (L = --chain-length, its best length), default draft
  offspec-dyspec-fixed  ablation: --tree dyspec --tree-budget L: dyspec at the chain's budget, default draft
  offspec-resident      ablation, cpu regime only: --offload none (offspec's real CPU default: nothing streamed),
                        dyspec, auto budget, default draft
("default draft": the int8 copy when offspec-tree-int8 runs, else the bf16 draft.)
Regimes:
  disk  target layers on disk (accelerate: device_map -> "disk" + offload_folder; offspec: --offload disk).
        With --cold (default) the page cache is dropped for the weights before every target pass
        (posix_fadvise DONTNEED), as for a target bigger than RAM.
  cpu   target layers in host RAM (transformers: device_map {"": "cpu"}, i.e. resident, the peer's best case
        here; offspec: --offload cpu, i.e. streamed through its slot ring; offspec-resident beside it).
Device (--device, default auto: the GPU when there is one): on a GPU both sides compute there. accelerate keeps
the layers where the regime does (device_map -> "disk" or "cpu") and the rest on the GPU; offspec's target keeps
only its ring of --slots layers on the GPU (every layer crosses the link every pass); offspec-tree-int8 is left
out (the int8 copy is the CPU's default draft); offspec-resident is the target resident on the GPU. A GPU's rows
carry its model ("gpu") and are never pooled with a CPU's.
Prompts: --prompt-set code (HumanEval) or chat (MT-Bench first turns), the first --prompts of offspec.prompt_sets,
chat template applied; each row is tagged prompt_set and prompt_id. Stopping rule, both sides: EOS (the
tokenizer's) or --new-tokens, whichever comes first. --temperature 0: greedy, one row per prompt;
--temperature > 0: one row per (prompt, seed in --seeds), both sides sampling at that temperature (no top-k,
top-p), seeded.

Statistics: a system's s/token on a prompt is the median of its repeats; a cell is the median over prompts with a
bootstrap 95% interval over prompts, a speedup the ratio of two medians with a paired bootstrap interval
(scripts/_stats.py). Every row stores the commit, the time and the load average (row["stamp"]).

--assist-sweep: instead of the systems above, hf-assisted alone under each setting of SWEEP (transformers'
defaults; constant 4, 8 and 16 draft tokens with confidence threshold 0 and 0.4) on the prompts given (a
calibration subset), repeats shuffled the same way; the report names the best setting per regime and the flags
that run it. Its rows go to their own --rows file.

Resume: with --rows FILE every measured row is appended to FILE as it is made, and a rerun of the same command
measures only the (prompt, seed) rows FILE lacks (a regime whose rows are all in FILE does not even load its
models). Keep one FILE per regime, prompt set and temperature: rows measured with other settings stop the run;
--fresh moves FILE aside to FILE.bak and starts over. --report-only renders any number of --rows files together,
each group (regime, prompt set, temperature) by the settings its rows recorded.

Identity (greedy only): every system is greedy and lossless, so all must produce hf-plain's tokens. In float32
any difference fails the run (exit 1). In bfloat16 a many-token pass and a one-token pass can round a near-tie
differently, so a difference is checked instead of excused: each row records the first differing token per
system, and a final (untimed) phase reruns those prompts in float32 on resident models, transformers generate
against offspec --tree dyspec, up to and including the latest first difference. Identical there: the bf16
difference is reported as rounding ("differ in bf16, identical in fp32"); different there: FAIL, exit 1.
The fp32 results go to FILE too ("kind": "fp32_check" lines), so a rerun does not redo them.

Cost model: every GPU figure is a PREDICTION (offspec/costmodel.py) with its inputs printed beside it; the draft
call's time on a GPU is not known here, so the table shows it at each of GPU_DRAFT_CALL_S (5, 10, 20 ms), for
offspec's default and for hf-assisted alike.

Examples (each resumable; see docs/benchmarks.md for the full set):
  python scripts/bench_peers.py --assist-sweep --prompt-set code --prompt-offset 32 --prompts 8 --regimes cpu \
      --rows docs/bench_peers/sweep-cpu-code.jsonl
  python scripts/bench_peers.py --prompt-set chat --prompts 32 --regimes cpu --rows docs/bench_peers/cpu-chat-t0.jsonl
  python scripts/bench_peers.py --report-only --rows docs/bench_peers/*-t0*.jsonl --write-docs
"""
from __future__ import annotations

import argparse
import copy
import gc
import inspect
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402
import _stats  # noqa: E402

from offspec.config import OffloadConfig, RuntimeConfig, SamplingConfig, TreeConfig  # noqa: E402
from offspec.costmodel import GpuSetup, predict_seconds_per_token  # noqa: E402
from offspec.errors import OffspecError  # noqa: E402
from offspec.generate import GenerationRequest, run  # noqa: E402
from offspec.load import parse_dtype  # noqa: E402
from offspec.metrics import synchronize  # noqa: E402
from offspec.stores import drop_page_cache  # noqa: E402
from offspec.prompt_sets import PROMPT_SETS, load_prompt_set  # noqa: E402

SYSTEMS = ("hf-plain", "hf-assisted", "offspec-none", "offspec-tree", "offspec-tree-int8", "offspec-chain",
           "offspec-dyspec-fixed", "offspec-resident")
REFERENCE = "hf-plain"       # every other system's tokens are compared with this one's
INT8 = "offspec-tree-int8"
CHAIN, DYSPEC_FIXED, RESIDENT = "offspec-chain", "offspec-dyspec-fixed", "offspec-resident"
ABLATIONS = (CHAIN, DYSPEC_FIXED, RESIDENT)   # measured with the default draft (int8 when INT8 runs)
OFFSPEC_TREES = ("offspec-tree", INT8, CHAIN, DYSPEC_FIXED, RESIDENT)   # offspec systems that grow trees
FP32_CHECK = "fp32_check"    # the "kind" of the rows-file lines that hold a float32 recheck
SWEEP_KIND = "sweep"         # the "kind" of --assist-sweep rows
GPU_LINK_GB_PER_S = 24.0     # PREDICTION input: PCIe 4.0 x16 from pinned memory
# PREDICTION input, unknown here: one forward of the 0.5B draft on a GPU (latency-bound, a few rows). The tables
# show every prediction at each of these, for offspec (one call per tree depth plus one) and for hf-assisted (one
# call per draft token).
GPU_DRAFT_CALL_S = (0.005, 0.010, 0.020)
SYSTEM_TEXT = {                # how the tables describe each system
    "hf-plain": "(transformers generate, accelerate offload)",
    "hf-assisted": "(+ assisted generation, 0.5B draft)",
    "offspec-none": "(--tree none)",
    "offspec-tree": "(dyspec, auto budget, bf16 draft)",
    INT8: "(dyspec, auto budget, int8 draft copy: the CPU default)",
    CHAIN: "(--tree chain, fixed length; default draft)",
    DYSPEC_FIXED: "(dyspec at the chain's budget; default draft)",
    RESIDENT: "(--offload none: nothing streamed; dyspec, auto budget, default draft)",
}
CODE_INSTRUCTION = "Complete this Python function:\n\n"   # put before each HumanEval prompt (the runs so far did)


@dataclass(frozen=True)
class AssistSettings:
    """What hf-assisted asks transformers for. transformers reads all three from the ASSISTANT's generation_config
    (generation/candidate_generator.py, AssistedCandidateGenerator.__init__), not from the config passed to the
    target's generate, so hf_generate sets them there."""
    num_assistant_tokens: int      # draft tokens per target pass (the start value under the heuristic schedule)
    schedule: str                  # num_assistant_tokens_schedule: "constant", or "heuristic" (+2 after a round
                                   # that accepted every draft token, -1 otherwise)
    confidence_threshold: float    # assistant_confidence_threshold: drafting stops after a token the draft gives
                                   # less than this probability; 0 = never


# The label of hf-assisted rows without peer_settings: measured before issue #13, when the settings went on the
# target's generation_config, so the assistant ran transformers' defaults (see DEFAULTS_TEXT).
UNAPPLIED_LABEL = "transformers defaults (rows from before the peer's swept settings were applied)"
DEFAULTS_TEXT = ("transformers 5.23's assistant defaults: num_assistant_tokens 20, schedule constant, "
                 "assistant_confidence_threshold 0.4 (up to 20 draft tokens a pass, a draft cut short after a token "
                 "the draft gives less than 0.4 probability; transformers re-fits that threshold each round only "
                 "when scikit-learn is installed)")
# --assist-sweep: transformers' defaults, then constant schedules of 4, 8 and 16 draft tokens, each with confidence
# threshold 0 (draft all k) and 0.4 (stop a draft at a token the draft gives < 0.4, transformers' default threshold).
SWEEP: tuple[Optional[AssistSettings], ...] = (None, *(AssistSettings(k, "constant", t)
                                                      for k in (4, 8, 16) for t in (0.0, 0.4)))


def assist_label(assist: Optional[AssistSettings]) -> str:
    """'constant 8, threshold 0' / 'transformers defaults': a sweep setting in a few words."""
    if assist is None:
        return "transformers defaults"
    return f"{assist.schedule} {assist.num_assistant_tokens}, threshold {assist.confidence_threshold:g}"


def assist_flags(assist: Optional[AssistSettings]) -> str:
    """The bench_peers options that run `assist`."""
    if assist is None:
        return "--assist-defaults"
    return (f"--assist-tokens {assist.num_assistant_tokens} --assist-schedule {assist.schedule} "
            f"--assist-threshold {assist.confidence_threshold:g}")


# ------------------------------------------------------------------ the rows file (resume)

def warn(message: str) -> None:
    print(f"warning: {message}", file=sys.stderr)


def read_rows_file(path) -> tuple[list[dict], dict[str, dict]]:
    """-> (timing rows in file order, fp32 checks by prompt id; a later line wins).

    A line that does not parse is skipped with a warning: the last one is torn when a run was killed while
    writing it, and a resumed run appends after it (see append_line)."""
    rows, checks = [], {}
    if path is None or not Path(path).is_file():
        return rows, checks
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            warn(f"{path}:{number}: not a complete JSON line (a run killed mid-write?), ignored")
            continue
        if not isinstance(entry, dict):
            warn(f"{path}:{number}: not a JSON object, ignored")
        elif entry.get("kind") == FP32_CHECK:
            checks[entry["id"]] = entry
        elif "regime" in entry and "id" in entry:
            rows.append(entry)
        else:
            warn(f"{path}:{number}: neither a timing row nor an fp32 check, ignored")
    return rows, checks


def append_line(path, entry: dict) -> None:
    """Append one JSON line, first ending a torn last line so the new one stays parseable."""
    with open(path, "a+b") as f:
        if f.tell() > 0:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":
                f.write(b"\n")
        f.write((json.dumps(entry) + "\n").encode())
        f.flush()
        os.fsync(f.fileno())   # a row that took minutes to measure should survive a crash right after


def move_aside(path) -> None:
    """--fresh: keep the old rows as FILE.bak instead of deleting hours of measurements."""
    if Path(path).exists():
        backup = str(path) + ".bak"
        os.replace(path, backup)
        print(f"--fresh: moved {path} to {backup}", file=sys.stderr)


def row_key(row: dict) -> tuple:
    """What one row measures within a regime: its prompt and, when sampling, its seed (None when greedy)."""
    return row["id"], row.get("seed")


def rows_by_key(rows: list[dict], regime: str, keys, kind: Optional[str] = None) -> dict[tuple, dict]:
    """The rows of `kind` (None: timing rows; SWEEP_KIND: sweep rows) of `regime` whose row_key is in `keys`, by
    key (a later row for the same key wins)."""
    wanted = set(keys)
    return {row_key(r): r for r in rows if r.get("kind") == kind and r["regime"] == regime and row_key(r) in wanted}


def assist_settings(args) -> Optional[AssistSettings]:
    """hf-assisted's settings from the command line; None with --assist-defaults (transformers' own)."""
    if args.assist_defaults:
        return None
    return AssistSettings(num_assistant_tokens=args.assist_tokens, schedule=args.assist_schedule,
                          confidence_threshold=args.assist_threshold)


def assist_record(assist: Optional[AssistSettings]):
    """How settings and sweep rows store an AssistSettings."""
    return "transformers defaults" if assist is None else {
        "num_assistant_tokens": assist.num_assistant_tokens, "schedule": assist.schedule,
        "confidence_threshold": assist.confidence_threshold}


STOP_RULE = "EOS or new_tokens, both sides"
# What rows from before a setting was recorded ran, by setting (so they still render, and never resume into a run
# with the new settings). Before issue #13's statistics: HumanEval, greedy, one run per system in a fixed order,
# transformers stopping at EOS while offspec ignored it.
LEGACY_SETTINGS = {"prompt_set": "code", "temperature": 0.0, "repeats": 1,
                   "stop": "transformers at EOS, offspec ignoring EOS", "chain_length": None, "device": "cpu"}


def run_settings(args, dtype) -> dict:
    """Everything that changes what a row measures; stored in each row so a resume cannot mix settings.

    "assist" replaced "assist_tokens" (issue #13): rows with only the latter asked for 5 tokens but ran
    transformers' defaults, so they must not be resumed into a run that applies its settings."""
    return {"new_tokens": args.new_tokens, "dtype": str(dtype).replace("torch.", ""), "policy": args.policy,
            "budget": args.budget, "slots": args.slots, "cold": args.cold,
            "assist": assist_record(assist_settings(args)), "prompt_set": args.prompt_set,
            "temperature": args.temperature, "repeats": args.repeats, "stop": STOP_RULE,
            "chain_length": args.chain_length, "device": args.device.type}


def row_settings(row: dict) -> dict:
    """A row's settings, with what rows from before a setting was recorded ran in its place."""
    return {**LEGACY_SETTINGS, **row.get("settings", {})}


MISSING = "<not recorded>"   # a setting a row's settings lack: measured before that setting was recorded


def settings_mismatches(rows: list[dict], settings: dict) -> list[str]:
    """'key: file has X, this run Y' for each setting where a row differs. Rows without settings predate them and
    pass; a row WITH settings that lacks one of `settings` differs on it (it was measured before that setting was
    recorded, so what it ran is unknown), unless LEGACY_SETTINGS knows what such rows ran."""
    found = {}
    for row in rows:
        if "settings" not in row:
            continue
        for key in settings:
            value = row["settings"].get(key, LEGACY_SETTINGS.get(key, MISSING))
            if value != settings[key]:
                found.setdefault(key, value)
    return [f"{key}: the file has {'rows that do not record it' if value == MISSING else repr(value)}, "
            f"this run {settings[key]!r}" for key, value in found.items()]


# ------------------------------------------------------------------ identity

def common_prefix(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share (at most the shorter length)."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def first_divergence(a: list[int], b: list[int]) -> Optional[int]:
    """Index of the first token where a and b differ (a length difference counts there); None if identical."""
    first = common_prefix(a, b)
    return None if first == len(a) == len(b) else first


def agreement(a: list[int], b: list[int]) -> float:
    """Fraction of positions equal up to the first difference, over the shorter length (1.0 = identical)."""
    return common_prefix(a, b) / max(min(len(a), len(b)), 1)


def row_divergences(row: dict) -> dict[str, int]:
    """{system: first differing token index} for the systems of `row` that differ from hf-plain.

    Rows written before first_divergence existed carry only the agreement fraction, which is that index over
    the shorter length, so the index is recovered from it."""
    if "first_divergence" in row:
        # transformers stops at EOS even with eos_token_id=None (the model's generation_config fills it in);
        # offspec runs with ignore_eos. A "difference" exactly where hf-plain's output ends, with the other
        # system going on, is that stop, not a different token: its tokens equal hf-plain's whole output.
        ref_tokens = row[REFERENCE]["tokens"]
        return {system: index for system, index in row["first_divergence"].items()
                if not (index == ref_tokens and row[system]["tokens"] > ref_tokens)}
    out = {}
    for system in SYSTEMS:
        cell = row.get(system)
        if system != REFERENCE and cell is not None and cell["agreement_with_hf_plain"] < 1.0:
            n = min(cell["tokens"], row[REFERENCE]["tokens"])
            out[system] = round(cell["agreement_with_hf_plain"] * n)
    return out


def divergence_index(row: dict) -> Optional[int]:
    """The latest first difference among the systems that differ: an fp32 recheck must cover it."""
    divergences = row_divergences(row)
    return max(divergences.values()) if divergences else None


def prompt_verdict(row: dict, checks: dict[str, dict], fp32_run: bool) -> str:
    """One prompt of one regime: identical | rounding (bf16 only, fp32 recheck identical) | fail | unchecked."""
    index = divergence_index(row)
    if index is None:
        return "identical"
    if fp32_run:
        return "fail"        # float32 has no rounding excuse
    check = checks.get(row["id"])
    if check is None or check["checked_tokens"] <= index:
        return "unchecked"
    return "rounding" if check["result"] == "identical" else "fail"


def identity_summary(rows: list[dict], checks: dict[str, dict], fp32_run: bool) -> dict:
    counts = {"identical": 0, "rounding": 0, "fail": 0, "unchecked": 0}
    for row in rows:
        counts[prompt_verdict(row, checks, fp32_run)] += 1
    return {**counts, "prompts": len(rows)}


def identity_text(identity: dict) -> str:
    """'identical 14/16; 2 differ in bf16, identical in fp32 (checked)', or with FAIL in it."""
    parts = [f"identical {identity['identical']}/{identity['prompts']}"]
    if identity["rounding"]:
        parts.append(f"{identity['rounding']} differ in bf16, identical in fp32 (checked)")
    if identity["unchecked"]:
        parts.append(f"{identity['unchecked']} differ, not checked in fp32 (rerun without --report-only)")
    if identity["fail"]:
        parts.append(f"**FAIL**: {identity['fail']} differ in float32")
    return "; ".join(parts)


def fp32_todo(results: list[dict], checks: dict[str, dict]) -> dict[str, int]:
    """{prompt id: tokens to generate} for the prompts whose bf16 difference no stored fp32 check covers."""
    todo = {}
    for result in results:
        for row in result["rows"]:
            index = divergence_index(row)
            if index is not None:
                todo[row["id"]] = max(todo.get(row["id"], 0), index + 1)
    return {pid: n for pid, n in todo.items() if pid not in checks or checks[pid]["checked_tokens"] < n}


# ------------------------------------------------------------------ the systems

@dataclass
class PeerRun:
    """One transformers generate call, as it ran."""
    tokens: list[int]
    seconds: float
    passes: int                    # forward passes of the target (a pre-hook counts them)
    max_draft_tokens: int          # the most draft tokens one target pass verified (0 without an assistant)
    draft_tokens: int              # draft tokens all passes verified together (0 without an assistant): the
                                   # assistant makes them one forward each, so this counts its calls too
    settings: Optional[dict]       # with an assistant: peer_settings(), read back after the call; else None


class PeerWatch:
    """Counts the target's forward passes and keeps the candidate generator transformers builds for an assisted
    call, so what it actually used can be read back after generate returns (see peer_settings)."""

    def __init__(self, target):
        self.fed: list[int] = []   # tokens fed to each target pass, in order
        self.generators = []       # the candidate generators generate built (one per assisted call)
        self._target = target
        self._build = target._get_candidate_generator

    def _count(self, module, args, kwargs) -> None:
        self.fed.append(kwargs["input_ids"].shape[1])   # generate calls the target as self(**model_inputs)

    def _keep(self, *args, **kwargs):
        generator = self._build(*args, **kwargs)
        self.generators.append(generator)
        return generator

    def __enter__(self) -> "PeerWatch":
        self._hook = self._target.register_forward_pre_hook(self._count, with_kwargs=True)
        self._target._get_candidate_generator = self._keep   # an instance attribute shadows the method
        return self

    def __exit__(self, *exc) -> None:
        self._hook.remove()
        del self._target._get_candidate_generator

    def draft_tokens(self, prompt_len: int) -> list[int]:
        """Draft tokens verified by each pass: the first pass takes the prompt plus the first draft, every later
        one the last accepted token plus the draft (e.g. fed [9, 5, 2] for a 7-token prompt: [2, 4, 1]).
        Without an assistant every entry is 0."""
        return [n - (prompt_len if i == 0 else 1) for i, n in enumerate(self.fed)]


def peer_settings(generator) -> dict:
    """The assistant settings a finished assisted call used, read from transformers' candidate generator: its copy
    of the assistant's generation_config with the global defaults filled in where unset (the values every round
    read), and where the run left the two that can move (the heuristic schedule's token count; the confidence
    threshold, which transformers re-fits each round when scikit-learn is installed)."""
    import transformers

    used = generator.assistant_generation_config
    return {"num_assistant_tokens": int(used.num_assistant_tokens),
            "num_assistant_tokens_schedule": used.num_assistant_tokens_schedule,
            "assistant_confidence_threshold": float(generator.assistant_confidence_threshold),
            "num_assistant_tokens_final": int(generator.num_assistant_tokens),
            "assistant_confidence_threshold_final": float(generator.generation_config.assistant_confidence_threshold),
            "transformers": transformers.__version__}


def hf_generate(target, ids, new_tokens: int, assistant=None, assist: Optional[AssistSettings] = None,
                temperature: float = 0.0, seed: int = 0) -> PeerRun:
    """transformers generate of up to `new_tokens`: greedy at temperature 0, else sampling at `temperature` (no
    top-k or top-p, as offspec's SamplingConfig) from torch's generator seeded with `seed`. It stops at EOS: with
    eos_token_id=None transformers takes the model's EOS ids from its generation_config; the EOS token itself is
    not counted (offspec does not emit it either).

    With an assistant, `assist` goes on the assistant's generation_config (None: leave transformers' defaults);
    the call runs on a copy of that config, restored afterwards, because transformers writes the heuristic
    schedule's last token count back into it and the next call would start from there."""
    import transformers

    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=None,
                                           pad_token_id=0, **sampling)
    inputs = torch.tensor([ids], device=target.device)      # the device of its embeddings (peer_device_map)
    saved = None if assistant is None else assistant.generation_config
    if assistant is not None:
        assistant.generation_config = copy.deepcopy(saved)
        if assist is not None:
            assistant.generation_config.num_assistant_tokens = assist.num_assistant_tokens
            assistant.generation_config.num_assistant_tokens_schedule = assist.schedule
            assistant.generation_config.assistant_confidence_threshold = assist.confidence_threshold
    try:
        with PeerWatch(target) as watch, torch.no_grad():
            torch.manual_seed(seed)
            start = time.perf_counter()
            out = target.generate(inputs, attention_mask=torch.ones_like(inputs), generation_config=config,
                                  assistant_model=assistant)
            synchronize(out.device)
            seconds = time.perf_counter() - start
    finally:
        if assistant is not None:
            assistant.generation_config = saved
    if assistant is not None and len(watch.generators) != 1:
        raise RuntimeError(f"expected one candidate generator from an assisted generate, caught "
                           f"{len(watch.generators)}: this transformers ({transformers.__version__}) "
                           "builds it elsewhere, so its settings cannot be read back")
    tokens = out[0, len(ids):].tolist()
    eos = target.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else (eos or []))
    if tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    drafted = watch.draft_tokens(len(ids))
    return PeerRun(tokens=tokens, seconds=seconds, passes=len(watch.fed), max_draft_tokens=max(drafted, default=0),
                   draft_tokens=sum(drafted),
                   settings=peer_settings(watch.generators[0]) if assistant is not None else None)


def peer_cell(run: PeerRun) -> dict:
    """The peer's counters for its cell of a row: passes, tokens per pass, draft tokens verified and, when
    assisted, its settings."""
    cell = {"peer_passes": run.passes, "tokens_per_pass": len(run.tokens) / max(run.passes, 1),
            "peer_max_draft_tokens": run.max_draft_tokens, "peer_draft_tokens": run.draft_tokens}
    if run.settings is not None:
        cell["peer_settings"] = run.settings
    return cell


def peer_device_map(regime: str, n_layers: int, device: torch.device) -> dict:
    """accelerate's placement of the target in a regime: the decoder layers where the regime keeps them ("disk",
    or "cpu": host RAM), the rest (embeddings, final norm, rotary, lm_head) on the compute device, where accelerate
    brings each offloaded layer for its forward. On a CPU the host-RAM regime is every weight in host RAM,
    executed where it lies: accelerate's cpu_offload hooks with the CPU as the execution device break assisted
    generation in transformers 5.23 ("Cannot copy out of meta tensor") and would only add copies, so the peer gets
    its best case, no hooks at all."""
    home = "cpu" if device.type == "cpu" else (device.index or 0)      # accelerate names a GPU by its index
    if regime == "cpu" and device.type == "cpu":
        return {"": "cpu"}
    device_map = {name: home for name in ("model.embed_tokens", "model.norm", "model.rotary_emb", "lm_head")}
    device_map.update({f"model.layers.{i}": regime for i in range(n_layers)})
    return device_map


class HfSystems:
    """The target offloaded by accelerate, and the draft as a plain resident assistant, on `device`."""

    def __init__(self, target_dir, draft_dir, dtype, regime, offload_folder, cold, assist: Optional[AssistSettings],
                 device: torch.device = torch.device("cpu")):
        from transformers import AutoConfig, AutoModelForCausalLM

        n_layers = AutoConfig.from_pretrained(target_dir).num_hidden_layers
        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype,
                                                           device_map=peer_device_map(regime, n_layers, device),
                                                           offload_folder=offload_folder if regime == "disk" else None)
        self.weight_files = []
        if regime == "disk":
            # transformers 5 reads disk-offloaded weights straight from the checkpoint's safetensors (the
            # offload folder stays empty unless it must convert), so those files are what must go cold.
            self.weight_files = sorted({str(p) for p in Path(target_dir).glob("*.safetensors")}
                                       | {str(p) for p in Path(offload_folder).rglob("*") if p.is_file()})
            if cold:
                self.target.register_forward_pre_hook(lambda module, args: drop_page_cache(*self.weight_files))
        self.target.eval()
        self.draft = (AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).to(device).eval() if draft_dir
                      else None)
        self.assist = assist      # None: the assistant runs transformers' defaults

    def generate(self, ids, new_tokens, assisted: bool, temperature: float = 0.0, seed: int = 0,
                 assist: Optional[AssistSettings] = None, use_own_assist: bool = True) -> PeerRun:
        """One generate call; `assist` replaces the run's own settings when use_own_assist is False (the sweep)."""
        return hf_generate(self.target, ids, new_tokens, self.draft if assisted else None,
                           self.assist if use_own_assist else assist, temperature=temperature, seed=seed)


def run_offspec(engine, ids, new_tokens, tree: TreeConfig, offload: str, temperature: float = 0.0, seed: int = 0):
    """-> (tokens, seconds, RunReport, steps). Stops at EOS, as transformers does."""
    request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=new_tokens, tree=tree,
                                sampling=SamplingConfig(temperature=temperature, seed=seed))
    start = time.perf_counter()
    report, steps = run(engine, request, offload=offload)
    return report.tokens, time.perf_counter() - start, report, steps


def int8_draft_available() -> bool:
    from offspec.draft import load_resident
    return "quant" in inspect.signature(load_resident).parameters


def int8_draft_engine(engine, draft_dir, dtype):
    """An Engine with an int8 copy of the draft around the SAME target object (no second copy of the target,
    same streamer). Never close it: closing would stop the shared target's streamer under the bf16 engine."""
    from offspec.checkpoint import Checkpoint
    from offspec.draft import load_resident
    from offspec.generate import Engine

    ckpt = Checkpoint(draft_dir)
    try:
        draft_q = load_resident(ckpt, engine.device, dtype, quant="int8")
    finally:
        ckpt.close()
    return Engine(engine.target, draft_q, engine.tokenizer, engine.eos_ids)


def tree_stats(report, steps) -> dict:
    """The tree run's counters, for the summary and the cost model (offspec-tree and the int8 variant)."""
    return dict(tokens_per_pass=report.tokens_per_pass, passes=report.passes, draft_seconds=report.draft_seconds,
                target_seconds=report.target_seconds, gb_streamed=report.gb_streamed,
                wait_seconds=report.wait_seconds, transfer_seconds=report.transfer_seconds,
                mean_tree_size=statistics.fmean(report.tree_sizes),
                mean_depth=statistics.fmean(st.tree_depth for st in steps))


def resident_engine(default_engine, target_dir, dtype):
    """offspec-resident: the target loaded whole (--offload none, offspec's CPU default) around the default engine's
    draft (no second draft). Close it after use: it owns nothing the streamed engine needs."""
    from offspec.checkpoint import Checkpoint
    from offspec.draft import load_resident
    from offspec.generate import Engine

    ckpt = Checkpoint(target_dir)
    try:
        target = load_resident(ckpt, default_engine.device, dtype)
    finally:
        ckpt.close()
    return Engine(target, default_engine.draft, default_engine.tokenizer, default_engine.eos_ids)


def ring_bytes(target_dir, dtype, slots: int) -> int:
    """A --gpu-budget of the ring alone: `slots` of the target's layers, so on a GPU no layer stays resident."""
    from offspec.checkpoint import Checkpoint
    from offspec.plan import layer_nbytes

    ckpt = Checkpoint(target_dir)
    try:
        return slots * layer_nbytes(ckpt.config, dtype)
    finally:
        ckpt.close()


def regime_systems(args, regime: str) -> list[str]:
    """The systems --systems asks for that run in `regime` (offspec-resident only where the target is in RAM)."""
    return [s for s in args.systems
            if not (s == RESIDENT and regime != "cpu") and not (s == INT8 and not args.int8_draft)]


def work_items(prompts, args) -> list[tuple[str, list[int], Optional[int]]]:
    """(prompt id, ids, seed) per row to measure: one row a prompt when greedy, one per seed when sampling."""
    seeds = args.seeds if args.temperature > 0 else [None]
    return [(pid, ids, seed) for pid, ids in prompts for seed in seeds]


def measure_rows(args, regime: str, todo, runners: dict, make) -> list[dict]:
    """Run every (prompt, seed) of `todo` with every runner --repeats times, in an order shuffled per prompt, seed
    and repeat; make(pid, seed, ids, {name: [run per repeat]}) -> row, appended to --rows as it is made."""
    rows = []
    for name, measure in runners.items():      # warm-up (not counted): one short generation per runner
        measure(todo[0][1], 4, 0)
    for pid, ids, seed in todo:
        out = {name: [] for name in runners}
        for repeat in range(args.repeats):
            for name in _stats.shuffled_order(list(runners), f"{pid}|{seed}", repeat):
                out[name].append(runners[name](ids, args.new_tokens, seed or 0))
        row = make(pid, seed, ids, out)
        rows.append(row)
        print(f"{regime} {pid}" + ("" if seed is None else f" seed {seed}") + ": " + ", ".join(
            f"{name} {statistics.median(r[1] / max(len(r[0]), 1) for r in runs):.3f} s/tok"
            for name, runs in out.items()), file=sys.stderr)
        if args.measure_rows:
            append_line(args.measure_rows, row)
    return rows


def measure_regime(args, regime: str, todo, target_dir, draft_dir, dtype, settings) -> list[dict]:
    """Load every system of `regime`, measure `todo` interleaved, append each row to --rows as it is made."""
    from offspec.load import load_engine

    systems = regime_systems(args, regime)
    tmp = tempfile.mkdtemp(prefix=f"bench-peers-{regime}-")
    print(f"\n== regime {regime}: loading transformers + accelerate ...", file=sys.stderr)
    hf = HfSystems(target_dir, draft_dir, dtype, regime, os.path.join(tmp, "hf-offload"), args.cold,
                   assist_settings(args), device=args.device)
    print(f"== regime {regime}: loading offspec ...", file=sys.stderr)
    ring_only = ring_bytes(target_dir, dtype, args.slots) if args.device.type == "cuda" else None
    offload = OffloadConfig(mode=regime, store_dir=os.path.join(tmp, "offspec-store") if regime == "disk" else None,
                            drop_page_cache=args.cold, n_slots=args.slots, gpu_budget=ring_only)
    loaded = load_engine(target_dir, draft_dir, offload, RuntimeConfig(device=args.device, dtype=dtype))
    engine_q = int8_draft_engine(loaded.engine, draft_dir, dtype) if INT8 in systems else None
    # the ablations' draft: offspec's CPU default (the int8 copy) when it runs
    default = engine_q if engine_q is not None else loaded.engine
    resident = resident_engine(default, target_dir, dtype) if RESIDENT in systems else None
    T = args.temperature
    plain = TreeConfig(policy="none")
    tree = TreeConfig(policy=args.policy, budget=None if args.budget == "auto" else int(args.budget))
    chain = TreeConfig(policy="chain", budget=args.chain_length)
    fixed = TreeConfig(policy="dyspec", budget=args.chain_length)

    def offspec(engine, config, mode):
        return lambda ids, n, seed: run_offspec(engine, ids, n, config, mode, T, seed)

    def peer(assisted: bool):
        def measure(ids, n, seed):
            result = hf.generate(ids, n, assisted, temperature=T, seed=seed)
            return result.tokens, result.seconds, result, None
        return measure

    every = {"hf-plain": lambda: peer(False), "hf-assisted": lambda: peer(True),
             "offspec-none": lambda: offspec(loaded.engine, plain, regime),
             "offspec-tree": lambda: offspec(loaded.engine, tree, regime),
             INT8: lambda: offspec(engine_q, tree, regime),
             CHAIN: lambda: offspec(default, chain, regime), DYSPEC_FIXED: lambda: offspec(default, fixed, regime),
             RESIDENT: lambda: offspec(resident, tree, "none")}
    runners = {s: every[s]() for s in systems}
    try:
        return measure_rows(args, regime, todo, runners,
                            lambda pid, seed, ids, out: make_row(regime, args.prompt_set, pid, seed, ids, out,
                                                                 settings, greedy=T == 0))
    finally:
        if resident is not None:
            resident.close()
        loaded.engine.close()            # only the original engine: engine_q shares its target and streamer
        # The disk regime's offspec store is GBs; a resumed benchmark would otherwise leave one per run.
        shutil.rmtree(tmp, ignore_errors=True)


def gpu_of(settings: dict) -> dict:
    """{"gpu": its model} for a row measured on a GPU (the stamp names the CPU), else nothing."""
    return {"gpu": _common.device_model(torch.device("cuda"))} if settings.get("device") == "cuda" else {}


def make_row(regime, prompt_set, pid, seed, ids, out: dict, settings: dict, greedy: bool = True) -> dict:
    """One (regime, prompt, seed) row from {system: [(tokens, seconds, RunReport or PeerRun, steps) per repeat]}.

    A system's seconds_per_token is the median of its repeats (each repeat's seconds over its own tokens);
    tokens and counters are the first repeat's. Greedy rows compare every system's tokens with hf-plain's."""
    row = {"regime": regime, "prompt_set": prompt_set, "id": pid, "prompt_id": pid, "seed": seed,
           "prompt_tokens": len(ids), "settings": settings, "stamp": _stats.stamp(), "first_divergence": {},
           **gpu_of(settings)}
    ref = out[REFERENCE][0][0] if greedy and REFERENCE in out else None
    for system, runs in out.items():
        toks, _, report, steps = runs[0]
        per_token = [secs / max(len(t), 1) for t, secs, _, _ in runs]
        cell = row[system] = {"seconds_per_token": statistics.median(per_token),
                              "repeat_seconds_per_token": per_token, "tokens": len(toks)}
        if ref is not None:
            cell["agreement_with_hf_plain"] = agreement(toks, ref)
            index = first_divergence(toks, ref)
            if index is not None:
                row["first_divergence"][system] = index
        if system in OFFSPEC_TREES:
            cell.update(tree_stats(report, steps))
        elif system == "offspec-none":
            cell.update(target_seconds=report.target_seconds, passes=report.passes,
                        gb_streamed=report.gb_streamed, transfer_seconds=report.transfer_seconds)
        else:
            cell.update(peer_cell(report))
    return row


def bench_regime(args, regime, prompts, target_dir, draft_dir, dtype, settings, old_rows) -> dict:
    """Measure the (prompt, seed) rows of `regime` that --rows lacks; summarize old and new rows together."""
    items = work_items(prompts, args)
    keys = [(pid, seed) for pid, _, seed in items]
    done = rows_by_key(old_rows, regime, keys)
    todo = [item for item in items if (item[0], item[2]) not in done]
    if args.measure_rows:
        print(f"== regime {regime}: {len(done)} of {len(items)} rows reused from {args.measure_rows}, "
              f"{len(todo)} to measure", file=sys.stderr)
    new = measure_regime(args, regime, todo, target_dir, draft_dir, dtype, settings) if todo else []
    gc.collect()     # the regime's models are garbage now; free them before the next regime loads its own
    rows = {**done, **{row_key(r): r for r in new}}
    return summarize_group([rows[k] for k in keys])


# ------------------------------------------------------------------ the peer sweep

def sweep_regime(args, regime, prompts, target_dir, draft_dir, dtype, settings, old_rows) -> list[dict]:
    """--assist-sweep: hf-assisted under every SWEEP setting, on the rows --rows lacks -> every sweep row."""
    items = work_items(prompts, args)
    keys = [(pid, seed) for pid, _, seed in items]
    done = rows_by_key(old_rows, regime, keys, kind=SWEEP_KIND)
    todo = [item for item in items if (item[0], item[2]) not in done]
    print(f"== sweep {regime}: {len(done)} of {len(items)} rows reused, {len(todo)} to measure", file=sys.stderr)
    new = []
    if todo:
        tmp = tempfile.mkdtemp(prefix=f"bench-peers-sweep-{regime}-")
        try:
            hf = HfSystems(target_dir, draft_dir, dtype, regime, os.path.join(tmp, "hf-offload"), args.cold, None,
                           device=args.device)

            def runner(assist):
                def measure(ids, n, seed):
                    result = hf.generate(ids, n, True, temperature=args.temperature, seed=seed, assist=assist,
                                         use_own_assist=False)
                    return result.tokens, result.seconds, result, None
                return measure

            runners = {assist_label(a): runner(a) for a in SWEEP}
            new = measure_rows(args, regime, todo, runners,
                               lambda pid, seed, ids, out: sweep_row(regime, args.prompt_set, pid, seed, ids, out,
                                                                     settings))
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        gc.collect()
    rows = {**done, **{row_key(r): r for r in new}}
    return [rows[k] for k in keys]


def sweep_row(regime, prompt_set, pid, seed, ids, out: dict, settings: dict) -> dict:
    """One sweep row: {setting label: hf-assisted's cell under it} for one (regime, prompt, seed)."""
    cells = {}
    for label, runs in out.items():
        per_token = [secs / max(len(t), 1) for t, secs, _, _ in runs]
        cells[label] = {"seconds_per_token": statistics.median(per_token), "repeat_seconds_per_token": per_token,
                        "tokens": len(runs[0][0]), **peer_cell(runs[0][2])}
    return {"kind": SWEEP_KIND, "regime": regime, "prompt_set": prompt_set, "id": pid, "prompt_id": pid,
            "seed": seed, "prompt_tokens": len(ids), "settings": {k: v for k, v in settings.items() if k != "assist"},
            "stamp": _stats.stamp(), "cells": cells, **gpu_of(settings)}


def summarize_sweep(rows: list[dict]) -> dict:
    """One (regime, prompt set)'s sweep rows -> {"regime", "prompt_set", "prompts", "settings": {label:
    {"seconds_per_token": median CI, "tokens_per_pass": median, "flags"}}, "best": label}: the best setting is
    the one with the lowest median s/token."""
    by_label = {assist_label(a): a for a in SWEEP}
    table = {}
    for label in by_label:
        cells = [r["cells"][label] for r in rows if label in r["cells"]]
        if cells:
            table[label] = {"seconds_per_token": _stats.median_ci([c["seconds_per_token"] for c in cells]),
                            "tokens_per_pass": statistics.median(c["tokens_per_pass"] for c in cells),
                            "flags": assist_flags(by_label[label])}
    best = min(table, key=lambda label: table[label]["seconds_per_token"]["median"]) if table else None
    regime = rows[0]["regime"] + (f" on {rows[0]['gpu']}" if rows[0].get("gpu") else "") if rows else None
    return {"regime": regime, "prompt_set": rows[0].get("prompt_set") if rows else None,
            "prompts": len(rows), "settings": table, "best": best}


def sweep_markdown(summaries: list[dict]) -> str:
    lines = ["| regime | prompts | hf-assisted setting | median s/token [95% CI] | tokens/pass | flags |",
             "|---|---|---|---|---|---|"]
    for sm in summaries:
        for label, cell in sm["settings"].items():
            mark = " **(best)**" if label == sm["best"] else ""
            lines.append(f"| {sm['regime']} | {sm['prompt_set']} ({sm['prompts']}) | {label}{mark} | "
                         f"{_stats.fmt_ci(cell['seconds_per_token'])} | {cell['tokens_per_pass']:.2f} | "
                         f"`{cell['flags']}` |")
    return "\n".join(lines)


# ------------------------------------------------------------------ the fp32 recheck

def fp32_check(todo: dict[str, int], prompt_ids: dict[str, list[int]], target_dir, draft_dir) -> dict[str, dict]:
    """Rerun `todo` ({prompt id: tokens}) in float32 on resident models: transformers generate vs offspec
    --tree dyspec. -> {prompt id: fp32_check entry}. One model at a time, each loaded once for all prompts."""
    from transformers import AutoModelForCausalLM

    from offspec.load import load_engine

    print(f"\n== fp32 check of {len(todo)} prompt(s) that differ in bf16: loading transformers ...", file=sys.stderr)
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32, device_map={"": "cpu"}).eval()
    hf_tokens = {pid: hf_generate(model, prompt_ids[pid], n).tokens for pid, n in todo.items()}
    del model
    gc.collect()
    print("== fp32 check: loading offspec ...", file=sys.stderr)
    loaded = load_engine(target_dir, draft_dir, OffloadConfig(mode="none"),
                         RuntimeConfig(device=torch.device("cpu"), dtype=torch.float32))
    try:
        tree = TreeConfig(policy="dyspec", budget=None)
        ours = {pid: run_offspec(loaded.engine, prompt_ids[pid], n, tree, "none")[0] for pid, n in todo.items()}
    finally:
        loaded.engine.close()
        del loaded
        gc.collect()
    checks = {}
    for pid, n in todo.items():
        index = first_divergence(ours[pid], hf_tokens[pid])
        checks[pid] = {"kind": FP32_CHECK, "id": pid, "dtype": "float32", "checked_tokens": n,
                       "systems": ["hf-plain (transformers generate)", "offspec --tree dyspec"],
                       "result": "identical" if index is None else "differs", "first_divergence": index}
        print(f"fp32 check {pid}: {n} tokens, {checks[pid]['result']}"
              + ("" if index is None else f" from token {index}"), file=sys.stderr)
    return checks


# ------------------------------------------------------------------ summary, report, plot

def median_or_none(values) -> Optional[float]:
    values = list(values)
    return statistics.median(values) if values else None


def ratio(numerator: Optional[float], denominator: Optional[float]) -> Optional[float]:
    return None if numerator is None or not denominator else numerator / denominator


def peer_label(cell: dict) -> str:
    """hf-assisted's settings in words, from what its cell read back; UNAPPLIED_LABEL for cells from before #13."""
    used = cell.get("peer_settings")
    if used is None:
        return UNAPPLIED_LABEL
    return (f"{used['num_assistant_tokens']} draft tokens per pass, {used['num_assistant_tokens_schedule']} schedule, "
            f"confidence threshold {used['assistant_confidence_threshold']:g}")


def default_system(systems) -> str:
    """offspec's CPU default among `systems`: the int8-draft tree when it ran, else the bf16-draft tree."""
    return INT8 if INT8 in systems else "offspec-tree"


# Goals (issue #13): offspec's default at least this much faster than the best-tuned hf-assisted on cold disk, and
# than its own --tree none everywhere.
GOAL_VS_PEER_DISK, GOAL_VS_NONE = 2.5, 3.0


def comparisons_of(default: str, regime: str) -> list[tuple[str, str, Optional[float]]]:
    """(system, baseline, goal or None) pairs a group reports: speedup = median(baseline) / median(system)."""
    return [(default, "hf-assisted", GOAL_VS_PEER_DISK if regime == "disk" else None),
            ("offspec-tree", "hf-assisted", None),
            (default, "offspec-none", GOAL_VS_NONE),
            (default, CHAIN, None), (DYSPEC_FIXED, CHAIN, None), (default, DYSPEC_FIXED, None),
            (RESIDENT, default, None), (RESIDENT, "hf-plain", None)]


def cost_model(rows: list[dict], default: str) -> dict:
    """The cost model on this group's rows: checked here against the measured s/token, and PREDICTED on a GPU at
    GPU_LINK_GB_PER_S for every draft-call time in GPU_DRAFT_CALL_S, for offspec's default, hf-assisted and plain
    decoding, with the inputs each prediction used."""
    none_rows = [r["offspec-none"] for r in rows if "offspec-none" in r]
    tree_rows = [r[default] for r in rows if default in r]
    out = {"inputs": {}, "here": None, "gpu": []}
    if not none_rows or not tree_rows:
        return out
    bytes_per_pass = statistics.median(n["gb_streamed"] * 1e9 / n["passes"] for n in none_rows)
    gbps = median_or_none(n["gb_streamed"] / n["transfer_seconds"] for n in none_rows if n["transfer_seconds"] > 0)
    tokens_per_pass = statistics.median(t["tokens_per_pass"] for t in tree_rows)
    # On a GPU the draft is latency-bound: offspec makes one call per tree depth plus the catch-up call (rows
    # without depths, from older runs, take the deepest tree allowed, 32: an upper bound); hf-assisted one
    # call per draft token.
    calls = statistics.median(t.get("mean_depth", 32) + 1 for t in tree_rows)
    draft_per_round = statistics.median(t["draft_seconds"] / t["passes"] for t in tree_rows)
    pass_seconds = statistics.median(t["target_seconds"] / t["passes"] for t in tree_rows)
    here = predict_seconds_per_token(int(bytes_per_pass), GpuSetup(link_gb_per_s=gbps or float("inf")),
                                     tokens_per_pass, draft_per_round, compute_seconds_per_pass=pass_seconds)
    peer = [r["hf-assisted"] for r in rows if "peer_draft_tokens" in r.get("hf-assisted", {})]
    peer_tpp = median_or_none(c["tokens_per_pass"] for c in peer)
    peer_calls = median_or_none(c["peer_draft_tokens"] / max(c["peer_passes"], 1) for c in peer)
    link = GpuSetup(link_gb_per_s=GPU_LINK_GB_PER_S)
    def gpu(tokens: float, draft_seconds: float) -> float:
        return predict_seconds_per_token(int(bytes_per_pass), link, tokens, draft_seconds)["seconds_per_token"]

    for call in GPU_DRAFT_CALL_S:
        out["gpu"].append({"draft_call_seconds": call, "offspec": gpu(tokens_per_pass, calls * call),
                           "hf-assisted": None if peer_tpp is None else gpu(peer_tpp, peer_calls * call),
                           "plain": gpu(1.0, 0.0)})
    out["inputs"] = {"streamed_gb_per_pass": bytes_per_pass / 1e9, "measured_gb_per_s": gbps,
                     "link_gb_per_s": GPU_LINK_GB_PER_S, "offspec_system": default,
                     "offspec_tokens_per_pass": tokens_per_pass, "offspec_draft_calls_per_pass": calls,
                     "hf_assisted_tokens_per_pass": peer_tpp, "hf_assisted_draft_calls_per_pass": peer_calls}
    out["here"] = {"predicted": here["seconds_per_token"],
                   "measured": statistics.median(t["seconds_per_token"] for t in tree_rows)}
    return out


def summarize_group(rows: list[dict]) -> dict:
    """One group's rows (one regime, prompt set and temperature) -> medians with bootstrap 95% intervals per
    system over the rows that have it (a system a row lacks is absent there), paired speedups, tokens per pass
    and the cost model."""
    settings = row_settings(rows[0])
    regime = rows[0]["regime"]
    systems = [s for s in SYSTEMS if any(s in r for r in rows)]
    default = default_system(systems)
    comparisons = []
    for system, baseline, goal in comparisons_of(default, regime):
        paired = [r for r in rows if system in r and baseline in r]
        if paired:
            comparisons.append({"system": system, "baseline": baseline, "goal": goal,
                                "speedup": _stats.ratio_ci([r[baseline]["seconds_per_token"] for r in paired],
                                                           [r[system]["seconds_per_token"] for r in paired])})
    peer_labels = {}                       # {label: rows}, in row order
    for cell in (r["hf-assisted"] for r in rows if "hf-assisted" in r):
        peer_labels[peer_label(cell)] = peer_labels.get(peer_label(cell), 0) + 1
    tokens_per_pass = {s: median_or_none(r[s]["tokens_per_pass"] for r in rows if s in r) for s in OFFSPEC_TREES
                       if s in systems}
    # hf-assisted as it ran: rows from before issue #13 counted no passes and read nothing back
    tokens_per_pass["hf-assisted"] = median_or_none(r["hf-assisted"]["tokens_per_pass"] for r in rows
                                                    if "peer_passes" in r.get("hf-assisted", {}))
    return {"regime": regime, "prompt_set": settings["prompt_set"], "temperature": settings["temperature"],
            "gpu": rows[0].get("gpu"), "settings": settings, "prompts": len({r["id"] for r in rows}),
            "systems": systems, "default": default,
            "seconds_per_token": {s: _stats.median_ci([r[s]["seconds_per_token"] for r in rows if s in r])
                                  for s in systems},
            "rows_with_system": {s: sum(s in r for r in rows) for s in systems},
            "identical_outputs": {s: sum(r[s].get("agreement_with_hf_plain") == 1.0 for r in rows if s in r)
                                  for s in systems},
            "comparisons": comparisons, "tokens_per_pass": tokens_per_pass, "hf_assisted_settings": peer_labels,
            "costmodel": cost_model(rows, default), "rows": rows}


def group_name(r: dict) -> str:
    """'disk, code' / 'cpu, chat, T=0.7' / 'disk, code, on NVIDIA H100': a group's regime, prompt set, (when
    sampling) temperature and (when measured on one) GPU."""
    return (f"{r['regime']}, {r['prompt_set']}" + (f", T={r['temperature']:g}" if r["temperature"] else "")
            + (f", on {r['gpu']}" if r.get("gpu") else ""))


def fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    """A number for a table cell, or '-' for a system the rows lack."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def systems_present(results: list[dict]) -> list[str]:
    return [s for s in SYSTEMS if any(s in r["systems"] for r in results)]


def peer_text(results: list[dict]) -> str:
    """What hf-assisted ran, by each row's read-back settings (per group when they differ), and what the rows
    from before issue #13 ran instead of what they asked for."""
    labels = [r["hf_assisted_settings"] for r in results]
    if all(list(l) == list(labels[0]) for l in labels) and len(labels[0]) == 1:
        text = f"hf-assisted settings, as each row stores them: {next(iter(labels[0]))} (every row)."
    else:
        text = "hf-assisted settings, as each row stores them: " + "; ".join(
            f"{group_name(r)}: " + ", ".join(f"{label} ({n} rows)" for label, n in r["hf_assisted_settings"].items())
            for r in results) + "."
    unapplied = [row for r in results for row in r["rows"]
                 if "hf-assisted" in row and "peer_settings" not in row["hf-assisted"]]
    if unapplied:
        asked = sorted({row.get("settings", {}).get("assist_tokens") for row in unapplied} - {None})
        text += (f" Rows without peer_settings (read back from transformers after each run) ran {DEFAULTS_TEXT}; "
                 "not the "
                 + (f"{'/'.join(map(str, asked))} draft tokens, " if asked else "")
                 + "confidence threshold 0, constant schedule the script then set on the target's generation_config, "
                 "where transformers does not read them. Not a tuned peer.")
    return text


def settings_text(r: dict) -> str:
    """A group's settings in one sentence, from what its rows recorded."""
    st = r["settings"]
    prompts = {"code": "HumanEval", "chat": "MT-Bench first turns"}.get(st["prompt_set"], st["prompt_set"])
    seeds = sorted({row.get("seed") for row in r["rows"]} - {None})
    return (f"{group_name(r)}: {r['prompts']} {prompts} prompts (chat template), {st['dtype']}, "
            + ("greedy" if not st["temperature"] else f"T={st['temperature']:g}, seeds {', '.join(map(str, seeds))}")
            + f", up to {st['new_tokens']} new tokens, stop: {st['stop']}; {st['repeats']} run(s) per system and "
            f"prompt" + (", order shuffled per prompt and repeat" if st["repeats"] > 1 else ", fixed order")
            + (f"; page cache {'dropped before every pass' if st['cold'] else 'warm'}" if r["regime"] == "disk" else "")
            + f"; offspec {st['slots']} ring slots, tree {st['policy']}, budget {st['budget']}"
            + (f", ablations at length/budget {st['chain_length']}" if st.get("chain_length") else "") + ".")


def comparison_text(c: dict, r: dict) -> str:
    """'1.55x [1.31, 1.80]; goal >= 2.5x: missed (needs <= 0.163 s/token, measured 0.263)'."""
    text = _stats.fmt_ci(c["speedup"], 2, key="ratio", suffix="x")
    if c["goal"] is None:
        return text + " | |"
    met = c["speedup"]["ratio"] >= c["goal"]
    base = r["seconds_per_token"][c["baseline"]]["median"]
    mine = r["seconds_per_token"][c["system"]]["median"]
    return (text + f" | ≥ {c['goal']:g}x: {'met' if met else 'missed'}"
            + ("" if met else f" (would need ≤ {base / c['goal']:.3f} s/token = {base:.3f} / {c['goal']:g}; "
                              f"measured {mine:.3f}, {mine / (base / c['goal']):.2f}x too slow)") + " |")


def markdown(results: list[dict], header: str, source: str) -> str:
    systems = systems_present(results)
    lines = ["## offspec vs transformers + accelerate (`scripts/bench_peers.py`)", "", header, "",
             *([source, ""] if source else []),
             *(f"- {settings_text(r)}" for r in results), "", peer_text(results), "",
             "Systems: " + "; ".join(f"`{s}` {SYSTEM_TEXT[s]}" for s in systems) + ".", "",
             "Median s/token over prompts (each prompt's value the median of its runs) with a bootstrap 95% interval "
             "over prompts:", "",
             "| group | system | median s/token [95% CI] | vs hf-plain | identical outputs (greedy) |",
             "|---|---|---|---|---|"]
    for r in results:
        med = r["seconds_per_token"]
        plain = med.get("hf-plain")
        for s in r["systems"]:
            have = r["rows_with_system"][s]
            lines.append(f"| {group_name(r)} | {s} | {_stats.fmt_ci(med[s])} | "
                         f"{fmt(ratio(plain['median'], med[s]['median']) if plain else None, '.2f', 'x')} | "
                         + (f"{r['identical_outputs'][s]}/{have} |" if not r["temperature"] else "(sampled) |"))
    greedy = [r for r in results if not r["temperature"] and "identity" in r]
    if greedy:
        lines += ["", "Outputs of all systems vs hf-plain, per prompt: "
                  + "; ".join(f"{group_name(r)}: {identity_text(r['identity'])}" for r in greedy) + "."]
    lines += ["", "Speedups: median(baseline) / median(system) over the prompts both ran, with a paired bootstrap "
              "95% interval:", "", "| group | system | vs | speedup [95% CI] | goal |", "|---|---|---|---|---|"]
    for r in results:
        for c in r["comparisons"]:
            lines.append(f"| {group_name(r)} | {c['system']} | {c['baseline']} | {comparison_text(c, r)}")
    lines += ["", "Tokens per target pass (medians over prompts; hf-assisted: its new tokens over the target passes a "
              "hook counted, '-' for rows from before issue #13):", "",
              "| group | " + " | ".join(s for s in (*OFFSPEC_TREES, "hf-assisted")) + " |",
              "|---|" + "---|" * (len(OFFSPEC_TREES) + 1)]
    for r in results:
        lines.append(f"| {group_name(r)} | " + " | ".join(fmt(r["tokens_per_pass"].get(s), ".2f")
                                                          for s in (*OFFSPEC_TREES, "hf-assisted")) + " |")
    lines += ["", cost_model_markdown(results)]
    return "\n".join(lines)


def cost_model_markdown(results: list[dict]) -> str:
    lines = ["Cost model (`offspec/costmodel.py`): s/token = (max(streamed bytes / link, compute) + draft calls per "
             "pass × draft call) / tokens per pass. Checked here with this machine's measured streaming rate, target "
             "pass and draft times; on a GPU every figure is PREDICTED, not measured: link "
             f"{GPU_LINK_GB_PER_S:g} GB/s pinned PCIe, compute hidden under the transfer, this group's measured "
             "tokens and draft calls per pass (offspec: one call per tree depth plus one; hf-assisted: one per draft "
             "token), and the draft call's GPU time, unknown here, at "
             + " / ".join(f"{c * 1000:g}" for c in GPU_DRAFT_CALL_S) + " ms.", "",
             "| group | streamed GB/pass | offspec tokens/pass, calls/pass | hf-assisted tokens/pass, calls/pass | "
             "here: predicted / measured s/token | PREDICTED GPU s/token, offspec | PREDICTED hf-assisted | "
             "PREDICTED plain (no draft) |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        cm = r["costmodel"]
        if not cm["gpu"]:
            lines.append(f"| {group_name(r)} | (no offspec-none or tree rows) | | | | | | |")
            continue
        i = cm["inputs"]
        per_call = lambda key: " / ".join(fmt(g[key], ".3f") for g in cm["gpu"])   # noqa: E731
        lines.append(f"| {group_name(r)} | {i['streamed_gb_per_pass']:.2f} | {i['offspec_tokens_per_pass']:.2f}, "
                     f"{i['offspec_draft_calls_per_pass']:.1f} | {fmt(i['hf_assisted_tokens_per_pass'], '.2f')}, "
                     f"{fmt(i['hf_assisted_draft_calls_per_pass'], '.1f')} | "
                     f"{cm['here']['predicted']:.3f} / {cm['here']['measured']:.3f} | {per_call('offspec')} | "
                     f"{per_call('hf-assisted')} | {cm['gpu'][0]['plain']:.3f} |")
    return "\n".join(lines)


def readme_markdown(results: list[dict]) -> str:
    """The README's benchmark table: every system's median s/token [95% CI] per group, the peer's settings as its
    rows read them back, and how many greedy outputs equal transformers' plain generate. No verdicts: the goals'
    comparisons are in docs/benchmarks.md."""
    systems = systems_present(results)
    lines = ["| system | " + " | ".join(group_name(r) for r in results) + " |", "|---|" + "---|" * len(results)]
    for s in systems:
        lines.append(f"| `{s}` {SYSTEM_TEXT[s]} | " + " | ".join(
            _stats.fmt_ci(r["seconds_per_token"].get(s)) if s in r["systems"] else "–" for r in results) + " |")
    identity = [f"{group_name(r)}: {identity_text(r['identity'])}" for r in results if "identity" in r]
    lines.append("\nhf-assisted's settings, as its rows read them back: " + "; ".join(
        f"{group_name(r)}: " + ", ".join(r["hf_assisted_settings"]) for r in results if r["hf_assisted_settings"])
        + ".")
    return "\n".join(lines) + ("\n\nGreedy outputs of every system vs transformers' plain generate: "
                               + "; ".join(identity) + "." if identity else "")


def plot(results: list[dict], path: str) -> None:
    """Median s/token per system and group, the bootstrap 95% interval as an error bar."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = systems_present(results)
    fig, ax = plt.subplots(figsize=(max(7, 1.6 * len(results)), 3.8))
    width = 0.8 / max(len(systems), 1)
    for j, s in enumerate(systems):
        xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(results))]
        cells = [r["seconds_per_token"].get(s) for r in results]
        medians = [c["median"] if c else 0.0 for c in cells]
        errors = [[c["median"] - c["low"] if c else 0.0 for c in cells], [c["high"] - c["median"] if c else 0.0
                                                                           for c in cells]]
        ax.bar(xs, medians, width, yerr=errors, capsize=2, label=s)
    ax.set_xticks(range(len(results)), [group_name(r) for r in results], fontsize=8)
    ax.set_ylabel("median seconds / token (lower is better)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


# ------------------------------------------------------------------ main

def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--prompt-set", choices=PROMPT_SETS, default="code",
                   help="code: HumanEval; chat: MT-Bench first turns (offspec/prompt_sets.py)")
    p.add_argument("--prompts", type=int, default=32, help="prompts to run: N of the set, from --prompt-offset on")
    p.add_argument("--prompt-offset", type=int, default=0,
                   help="skip the set's first K prompts: a calibration subset (--assist-sweep) kept apart from the "
                        "prompts the main runs measure")
    p.add_argument("--new-tokens", type=int, default=128,
                   help="token budget per prompt, both sides (both also stop at EOS)")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="0: greedy (identity checked); > 0: both sides sample at it, one row per seed in --seeds")
    p.add_argument("--seeds", default="0,1,2", help="sampling seeds, one row per prompt and seed (T > 0 only)")
    p.add_argument("--repeats", type=int, default=3,
                   help="timed runs per system and row, in an order shuffled per prompt, seed and repeat; a row's "
                        "s/token is their median")
    p.add_argument("--regimes", default="disk,cpu", help="comma-separated: disk, cpu")
    p.add_argument("--systems", default=",".join(SYSTEMS),
                   help=f"comma-separated subset of: {', '.join(SYSTEMS)} (offspec-resident runs in the cpu regime "
                        "only)")
    p.add_argument("--dtype", default="bfloat16",
                   help="bfloat16 (a difference must be explained by an fp32 recheck) or float32 (identity enforced)")
    p.add_argument("--policy", default="dyspec", help="offspec tree policy")
    p.add_argument("--budget", default="auto", help="offspec tree budget (a number or auto)")
    p.add_argument("--chain-length", type=int, default=8,
                   help=f"{CHAIN}'s length and {DYSPEC_FIXED}'s budget: the chain's best length (bench_accept "
                        "and the ablation in issue #13 found 8 here)")
    p.add_argument("--assist-tokens", type=int, default=5,
                   help="hf-assisted: draft tokens per target pass (transformers' num_assistant_tokens; the start "
                        "value under --assist-schedule heuristic)")
    p.add_argument("--assist-schedule", choices=("constant", "heuristic"), default="constant",
                   help="hf-assisted: num_assistant_tokens_schedule. heuristic: +2 tokens after a pass that accepted "
                        "every draft token, -1 otherwise (restarting from --assist-tokens on every prompt)")
    p.add_argument("--assist-threshold", type=float, default=0.0,
                   help="hf-assisted: assistant_confidence_threshold: drafting stops after a token the draft gives "
                        "less than this probability; 0 = never")
    p.add_argument("--assist-defaults", action="store_true",
                   help="hf-assisted: ignore the three --assist-* options and run transformers' own defaults "
                        "(5.23: 20 tokens, constant, threshold 0.4; what the rows before issue #13 ran). Either way "
                        "the settings transformers used are read back into each row as peer_settings")
    p.add_argument("--assist-sweep", action="store_true",
                   help="run hf-assisted alone under every sweep setting (transformers' defaults; constant 4, 8, 16 "
                        "with threshold 0 and 0.4) and name the best per regime: use a calibration subset "
                        "(--prompts) and its own --rows file")
    p.add_argument("--slots", type=int, default=8,
                   help="offspec ring slots: while the draft grows a tree, the loader prefetches this many layers of "
                        "the next pass (each slot holds one layer: 93 MB for the 1.5B target in bf16)")
    p.add_argument("--no-cold", dest="cold", action="store_false", help="disk regime: keep the page cache warm")
    p.add_argument("--device", default="auto",
                   help="compute device: auto (the GPU when there is one, else the CPU), cpu, or cuda[:N]. On a GPU "
                        "both sides compute there: offspec's streamed target keeps only its --slots ring on the GPU "
                        f"(every layer crosses the link every pass), {INT8} is left out (the int8 copy is the CPU's "
                        "default draft; a GPU's is bf16), and accelerate brings each offloaded layer to the GPU")
    p.add_argument("--no-int8-draft", dest="int8_draft", action="store_false",
                   help=f"leave out {INT8} (offspec-tree with a weight-only int8 draft); the ablations then use "
                        "the bf16 draft")
    p.add_argument("--rows", action="extend", nargs="+", default=[], metavar="FILE",
                   help="measuring: append each row (and fp32 checks) to this JSONL file, and skip the rows it "
                        "already holds; --report-only: any number of files, rendered together")
    p.add_argument("--fresh", action="store_true", help="with --rows: move an existing FILE to FILE.bak and start over")
    p.add_argument("--json", default=None, help="write the summary and rows here [default docs/bench_peers.json "
                                                "with --write-docs]")
    p.add_argument("--plot", default=None, help="PNG of s/token per system [default docs/peers.png with --write-docs]")
    p.add_argument("--write-docs", action="store_true",
                   help="replace the bench_peers section of docs/benchmarks.md (bench_peers_sweep with "
                        "--assist-sweep) and the benchmark table of README.md")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing (no fp32 check either), load no model: summarize the rows in the --rows files")
    args = p.parse_args(argv)
    if args.fresh and not args.rows:
        p.error("--fresh needs --rows FILE")
    if args.fresh and args.report_only:
        p.error("--fresh would move away the rows --report-only is to summarize")
    if args.report_only:
        missing = [f for f in args.rows if not Path(f).is_file()]
        if not args.rows or missing:
            p.error("--report-only needs --rows FILE from an earlier run" + (f"; not found: {', '.join(missing)}"
                                                                             if missing else ""))
    elif len(args.rows) > 1:
        p.error("a measuring run writes one --rows file (give several only with --report-only)")
    args.measure_rows = None if args.report_only or not args.rows else args.rows[0]
    args.systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    unknown = [x for x in args.systems if x not in SYSTEMS]
    if unknown:
        p.error(f"--systems: unknown {', '.join(unknown)} (choose from {', '.join(SYSTEMS)})")
    if REFERENCE not in args.systems and not args.assist_sweep:
        p.error(f"--systems must include {REFERENCE}: every other system is compared with it")
    try:
        args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()]
    except ValueError:
        p.error(f"--seeds: expected whole numbers separated by commas, got {args.seeds!r}")
    if args.prompts < 1 or args.new_tokens < 1 or args.repeats < 1 or args.chain_length < 1 or args.prompt_offset < 0:
        p.error("--prompts, --new-tokens, --repeats and --chain-length must be >= 1, --prompt-offset >= 0")
    if args.temperature < 0 or (args.temperature > 0 and not args.seeds):
        p.error("--temperature must be >= 0, and sampling needs at least one seed")
    args.regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    if not args.regimes or any(r not in ("disk", "cpu") for r in args.regimes):
        p.error(f"--regimes: expected disk and/or cpu, got {','.join(args.regimes)!r}")
    if args.write_docs:
        args.json = args.json or str(ROOT / "docs" / ("bench_peers_sweep.json" if args.assist_sweep else
                                                      "bench_peers.json"))
        args.plot = args.plot or (None if args.assist_sweep else str(ROOT / "docs" / "peers.png"))
    try:
        args.device = _common.compute_device(args.device, here=not args.report_only)
    except OffspecError as e:
        p.error(f"--device: {e}")
    if args.device.type == "cuda":
        args.int8_draft = False
    if args.int8_draft and INT8 in args.systems and not args.report_only and not int8_draft_available():
        p.error(f"offspec.draft.load_resident has no quant= in this checkout, so {INT8} cannot run: "
                "pass --no-int8-draft")
    return p, args


def load_prompts(args, tokenizer) -> list[tuple[str, list[int]]]:
    """(prompt id, chat-templated ids) for --prompts of --prompt-set from --prompt-offset on; HumanEval prompts get
    the instruction the earlier runs gave them."""
    from offspec.prompt import encode_prompt

    return [(pid, encode_prompt(tokenizer, (CODE_INSTRUCTION if args.prompt_set == "code" else "") + text))
            for pid, text in load_prompt_set(args.prompt_set, args.prompt_offset + args.prompts)[args.prompt_offset:]]


def group_rows(rows: list[dict]) -> list[list[dict]]:
    """Timing rows split by (regime, prompt set, temperature, GPU): disk before cpu, then set, then temperature,
    the CPU's rows before a GPU's."""
    groups: dict[tuple, list[dict]] = {}
    for row in rows:
        st = row_settings(row)
        groups.setdefault((row["regime"], st["prompt_set"], st["temperature"], row.get("gpu", "")), []).append(row)
    order = {"disk": 0, "cpu": 1}
    return [groups[k] for k in sorted(groups, key=lambda k: (order.get(k[0], 2), k[1], k[2], k[3]))]


def main(argv=None) -> int:
    p, args = parse_args(argv)
    started, load_at_start = time.time(), _common.load_average()
    old_rows, checks = [], {}
    for path in args.rows:
        rows, file_checks = read_rows_file(path)
        old_rows += rows
        checks.update(file_checks)
    if args.report_only:
        return report(args, old_rows, checks, started, load_at_start)

    dtype = parse_dtype(args.dtype)
    settings = run_settings(args, dtype)
    if args.fresh:
        move_aside(args.measure_rows)
        old_rows, checks = [], {}
    compared = {k: v for k, v in settings.items() if not (args.assist_sweep and k == "assist")}
    kind = SWEEP_KIND if args.assist_sweep else None
    mismatches = settings_mismatches([r for r in old_rows if r.get("kind") == kind], compared)
    if mismatches:
        p.error(f"{args.measure_rows} holds rows measured with other settings ({'; '.join(mismatches)}): "
                "pass the same settings, --fresh, or another --rows file")

    from offspec.demo import ensure_demo_models
    from transformers import AutoTokenizer

    target_dir, draft_dir = ensure_demo_models()
    prompts = load_prompts(args, AutoTokenizer.from_pretrained(str(target_dir)))
    header = _common.run_header(args.device, started, load_at_start)
    if args.assist_sweep:
        sweeps = [summarize_sweep(sweep_regime(args, regime, prompts, target_dir, draft_dir, dtype, settings,
                                               old_rows)) for regime in args.regimes]
        return write_sweep(args, sweeps, header)
    results = [bench_regime(args, regime, prompts, target_dir, draft_dir, dtype, settings, old_rows)
               for regime in args.regimes]

    # Final phase, untimed: explain bf16 differences in float32, or fail.
    fp32_run = dtype == torch.float32
    todo = {} if fp32_run or args.temperature > 0 else fp32_todo(results, checks)
    if todo:
        new_checks = fp32_check(todo, dict(prompts), target_dir, draft_dir)
        checks.update(new_checks)
        if args.measure_rows:
            for entry in new_checks.values():
                append_line(args.measure_rows, entry)
    return finish(args, results, checks, header, "")


def report(args, rows: list[dict], checks: dict, started: float, load_at_start: str) -> int:
    """--report-only: every group of the --rows files (or the sweep rows with --assist-sweep), no model loaded."""
    header = _common.run_header(torch.device("cpu"), started, load_at_start)
    files = ", ".join(f"`{os.path.relpath(f, ROOT) if Path(f).resolve().is_relative_to(ROOT) else f}`"
                      for f in args.rows)
    if args.assist_sweep:
        sweep_rows = [r for r in rows if r.get("kind") == SWEEP_KIND and r["regime"] in args.regimes]
        groups = {}                                  # (regime, prompt set) -> its rows, in the order of --regimes
        for r in sorted(sweep_rows, key=lambda r: args.regimes.index(r["regime"])):
            groups.setdefault((r["regime"], r.get("prompt_set"), r.get("gpu", "")), []).append(r)
        sweeps = [summarize_sweep(group) for group in groups.values()]
        if not sweeps:
            print(f"error: {files} hold no sweep rows for regimes {','.join(args.regimes)}", file=sys.stderr)
            return 2
        return write_sweep(args, sweeps, header + f"\n\nRendered from the sweep rows in {files}. "
                           + _stats.provenance_text(sweep_rows))
    timing = [r for r in rows if r.get("kind") is None and r["regime"] in args.regimes]
    # one row per (regime, prompt set, temperature, prompt, seed): a later file's (or line's) row wins
    timing = list({(r["regime"], row_settings(r)["prompt_set"], row_settings(r)["temperature"], r.get("gpu", ""),
                    *row_key(r)): r for r in timing}.values())
    groups = group_rows(timing)
    if not groups:
        print(f"error: {files} hold no timing rows for regimes {','.join(args.regimes)}", file=sys.stderr)
        return 2
    for group in groups:
        reference = {k: v for k, v in row_settings(group[0]).items() if k != "assist"}
        mixed = settings_mismatches(group, reference)
        if mixed:
            print(f"error: the {group[0]['regime']} rows of {files} mix settings ({'; '.join(mixed)}); render "
                  "them from separate files", file=sys.stderr)
            return 2
    source = (f"Rendered (not measured) by the command above, on the machine it names, from the rows in {files}; the "
              "rows were measured by the same options without --report-only. " + _stats.provenance_text(timing))
    return finish(args, [summarize_group(g) for g in groups], checks, header, source)


def finish(args, results: list[dict], checks: dict, header: str, source: str) -> int:
    """Identity verdicts, then the tables: stdout, --json, --plot, and with --write-docs the docs and README."""
    for r in results:
        fp32_run = r["settings"]["dtype"] == "float32"
        if not r["temperature"]:
            r["identity"] = identity_summary(r["rows"], checks, fp32_run)
            r["fp32_checks"] = {row["id"]: checks[row["id"]] for row in r["rows"] if row["id"] in checks}
    table = markdown(results, header, source)
    print(table)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.plot:
        plot(results, args.plot)
    if args.write_docs:
        _common.write_doc_section("bench_peers", table + (f"\n\n![s/token per system]({Path(args.plot).name})\n"
                                                          if args.plot else ""))
        command = _common.command_line()
        _common.write_doc_section("bench_peers_readme", f"Command: `{command}`\n\n" + readme_markdown(results),
                                  path=README)
    return verdict(results)


def write_sweep(args, sweeps: list[dict], header: str) -> int:
    """The sweep's table (stdout, --json, docs section bench_peers_sweep) and each regime's best setting."""
    body = "\n".join(["## hf-assisted settings sweep (`scripts/bench_peers.py --assist-sweep`)", "", header, "",
                      sweep_markdown(sweeps), "",
                      "The best setting per regime and prompt set (lowest median s/token) is the peer the main "
                      "table runs: "
                      + "; ".join(f"{sm['regime']}, {sm['prompt_set']}: {sm['best']} "
                                  f"(`{sm['settings'][sm['best']]['flags']}`)" for sm in sweeps if sm["best"])
                      + "."])
    print(body)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(sweeps, indent=1))
    if args.write_docs:
        _common.write_doc_section("bench_peers_sweep", body)
    for sm in sweeps:
        if sm["best"]:
            print(f"best hf-assisted setting, {sm['regime']}, {sm['prompt_set']}: {sm['best']}: "
                  f"{sm['settings'][sm['best']]['flags']}", file=sys.stderr)
    return 0


def verdict(results: list[dict]) -> int:
    """Say what the identity check found on stderr; 1 when any difference is not bf16 rounding."""
    checked = [r for r in results if "identity" in r]
    for r in checked:
        print(f"identity {group_name(r)}: {identity_text(r['identity'])}".replace("**", ""), file=sys.stderr)
    failed = sum(r["identity"]["fail"] for r in checked)
    if failed:
        fp32 = all(r["settings"]["dtype"] == "float32" for r in checked)
        why = ("in float32 their outputs must be identical" if fp32 else
               "the float32 recheck differs too, so bf16 rounding does not explain it")
        print(f"FAIL: {failed} prompt(s) where a system's tokens differ from hf-plain; all systems are greedy and "
              f"lossless: {why}", file=sys.stderr)
        return 1
    if any(r["identity"]["unchecked"] for r in checked):
        print("(some bf16 differences are not checked in float32 yet: run without --report-only to check them)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    _common.run_main(main)
