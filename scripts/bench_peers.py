#!/usr/bin/env python3
"""offspec against Hugging Face transformers + accelerate offloading, on the same prompts, models and token counts.

Systems per regime, run interleaved prompt by prompt in one process:
  hf-plain           transformers generate, target offloaded by accelerate
  hf-assisted        the same with assistant_model = the draft; --assist-tokens/-schedule/-threshold go on the
                     ASSISTANT's generation_config, where transformers reads them, and each row stores what
                     transformers used (peer_settings, read back after the call) and the target passes a hook
                     counted (peer_passes). Rows from before issue #13 have neither: they ran transformers'
                     defaults (20 tokens, constant, threshold 0.4), not the 5 tokens / threshold 0 they recorded.
  offspec-none       offspec, --tree none (plain autoregressive on offspec's streaming engine)
  offspec-tree       offspec, --tree dyspec (same bf16 models as the peer: the issue's goals are measured on it)
  offspec-tree-int8  offspec-tree with a weight-only int8 copy of the draft, sharing the same target (a labeled
                     extra; --no-int8-draft drops it)
Regimes:
  disk  target layers on disk (accelerate: device_map -> "disk" + offload_folder; offspec: --offload disk).
        With --cold (default) the page cache is dropped for the weights before every target pass
        (posix_fadvise DONTNEED), as for a target bigger than RAM.
  cpu   target layers in host RAM (transformers: device_map {"": "cpu"}, i.e. resident, the peer's best case
        here; offspec: --offload cpu, i.e. streamed through its slot ring).

Resume: with --rows FILE every measured (regime, prompt) row is appended to FILE as it is made, and a rerun of
the same command measures only the prompts FILE lacks (the report covers old and new rows; a regime whose
prompts are all in FILE does not even load its models). Rows measured with other settings (tokens, dtype,
tree, slots, hf-assisted's, ...) stop the run, and so do rows from before issue #13, which do not record what
hf-assisted ran; --fresh moves FILE aside to FILE.bak and starts over.

Identity: every system is greedy and lossless, so all must produce hf-plain's tokens. In float32 any
difference fails the run (exit 1). In bfloat16 a many-token pass and a one-token pass can round a near-tie
differently, so a difference is checked instead of excused: each row records the first differing token per
system, and a final (untimed) phase reruns those prompts in float32 on resident models, transformers generate
against offspec --tree dyspec, up to and including the latest first difference. Identical there: the bf16
difference is reported as rounding ("differ in bf16, identical in fp32"); different there: FAIL, exit 1.
The fp32 results go to FILE too ("kind": "fp32_check" lines), so a rerun does not redo them.

Example (the docs' run):
  python scripts/bench_peers.py --prompts 16 --new-tokens 128 --regimes disk,cpu --rows docs/bench_peers_rows.jsonl --write-docs
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
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402

from offspec.config import OffloadConfig, RuntimeConfig, TreeConfig  # noqa: E402
from offspec.costmodel import GpuSetup, predict_seconds_per_token  # noqa: E402
from offspec.generate import GenerationRequest, run  # noqa: E402
from offspec.load import parse_dtype  # noqa: E402
from offspec.offload import drop_page_cache  # noqa: E402

SYSTEMS = ("hf-plain", "hf-assisted", "offspec-none", "offspec-tree", "offspec-tree-int8")
REFERENCE = "hf-plain"       # every other system's tokens are compared with this one's
INT8 = "offspec-tree-int8"
FP32_CHECK = "fp32_check"    # the "kind" of the rows-file lines that hold a float32 recheck
GPU_LINK_GB_PER_S = 24.0     # PREDICTION inputs: PCIe 4.0 x16 from pinned memory
GPU_DRAFT_CALL_S = 0.008     # one batched forward of the 0.5B draft on a GPU (latency-bound), assumed


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
UNAPPLIED_LABEL = "transformers defaults (settings were not applied: see issue #13)"
DEFAULTS_TEXT = ("transformers 5.23's assistant defaults: num_assistant_tokens 20, schedule constant, "
                 "assistant_confidence_threshold 0.4 (up to 20 draft tokens a pass, a draft cut short after a token "
                 "the draft gives less than 0.4 probability; transformers re-fits that threshold each round only "
                 "when scikit-learn is installed)")


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


def rows_by_id(rows: list[dict], regime: str, ids) -> dict[str, dict]:
    """The rows of `regime` for the prompts in `ids`, by prompt id (a later row for the same prompt wins)."""
    wanted = set(ids)
    return {r["id"]: r for r in rows if r["regime"] == regime and r["id"] in wanted}


def assist_settings(args) -> Optional[AssistSettings]:
    """hf-assisted's settings from the command line; None with --assist-defaults (transformers' own)."""
    if args.assist_defaults:
        return None
    return AssistSettings(num_assistant_tokens=args.assist_tokens, schedule=args.assist_schedule,
                          confidence_threshold=args.assist_threshold)


def run_settings(args, dtype) -> dict:
    """Everything that changes what a row measures; stored in each row so a resume cannot mix settings.

    "assist" replaced "assist_tokens" (issue #13): rows with only the latter asked for 5 tokens but ran
    transformers' defaults, so they must not be resumed into a run that applies its settings."""
    assist = assist_settings(args)
    return {"new_tokens": args.new_tokens, "dtype": str(dtype).replace("torch.", ""), "policy": args.policy,
            "budget": args.budget, "slots": args.slots, "cold": args.cold,
            "assist": "transformers defaults" if assist is None else
            {"num_assistant_tokens": assist.num_assistant_tokens, "schedule": assist.schedule,
             "confidence_threshold": assist.confidence_threshold}}


MISSING = "<not recorded>"   # a setting a row's settings lack: measured before that setting was recorded


def settings_mismatches(rows: list[dict], settings: dict) -> list[str]:
    """'key: file has X, this run Y' for each setting where a row differs. Rows without settings predate them and
    pass; a row WITH settings that lacks one of `settings` differs on it (it was measured before that setting was
    recorded, so what it ran is unknown)."""
    found = {}
    for row in rows:
        if "settings" not in row:
            continue
        for key in settings:
            value = row["settings"].get(key, MISSING)
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


def hf_generate(target, ids, new_tokens: int, assistant=None, assist: Optional[AssistSettings] = None) -> PeerRun:
    """Greedy transformers generate of up to `new_tokens`. It may stop early at EOS: with eos_token_id=None
    transformers still takes the model's EOS from its generation_config (see row_divergences).

    With an assistant, `assist` goes on the assistant's generation_config (None: leave transformers' defaults);
    the call runs on a copy of that config, restored afterwards, because transformers writes the heuristic
    schedule's last token count back into it and the next call would start from there."""
    import transformers

    config = transformers.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=0, do_sample=False,
                                           eos_token_id=None, pad_token_id=0)
    inputs = torch.tensor([ids])
    saved = None if assistant is None else assistant.generation_config
    if assistant is not None:
        assistant.generation_config = copy.deepcopy(saved)
        if assist is not None:
            assistant.generation_config.num_assistant_tokens = assist.num_assistant_tokens
            assistant.generation_config.num_assistant_tokens_schedule = assist.schedule
            assistant.generation_config.assistant_confidence_threshold = assist.confidence_threshold
    try:
        with PeerWatch(target) as watch, torch.no_grad():
            start = time.perf_counter()
            out = target.generate(inputs, attention_mask=torch.ones_like(inputs), generation_config=config,
                                  assistant_model=assistant)
            seconds = time.perf_counter() - start
    finally:
        if assistant is not None:
            assistant.generation_config = saved
    if assistant is not None and len(watch.generators) != 1:
        raise RuntimeError(f"expected one candidate generator from an assisted generate, caught "
                           f"{len(watch.generators)}: this transformers ({transformers.__version__}) "
                           "builds it elsewhere, so its settings cannot be read back")
    return PeerRun(tokens=out[0, len(ids):].tolist(), seconds=seconds, passes=len(watch.fed),
                   max_draft_tokens=max(watch.draft_tokens(len(ids)), default=0),
                   settings=peer_settings(watch.generators[0]) if assistant is not None else None)


def peer_cell(run: PeerRun) -> dict:
    """The peer's counters for its cell of a row: passes, tokens per pass and, when assisted, its settings."""
    cell = {"peer_passes": run.passes, "tokens_per_pass": len(run.tokens) / max(run.passes, 1),
            "peer_max_draft_tokens": run.max_draft_tokens}
    if run.settings is not None:
        cell["peer_settings"] = run.settings
    return cell


class HfSystems:
    """The target offloaded by accelerate, and the draft as a plain resident assistant."""

    def __init__(self, target_dir, draft_dir, dtype, regime, offload_folder, cold, assist: Optional[AssistSettings]):
        from transformers import AutoConfig, AutoModelForCausalLM

        n_layers = AutoConfig.from_pretrained(target_dir).num_hidden_layers
        if regime == "disk":
            device_map = {"model.embed_tokens": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
            device_map.update({f"model.layers.{i}": "disk" for i in range(n_layers)})
            self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, device_map=device_map,
                                                               offload_folder=offload_folder)
            # transformers 5 reads disk-offloaded weights straight from the checkpoint's safetensors (the
            # offload folder stays empty unless it must convert), so those files are what must go cold.
            self.weight_files = sorted({str(p) for p in Path(target_dir).glob("*.safetensors")}
                                       | {str(p) for p in Path(offload_folder).rglob("*") if p.is_file()})
            if cold:
                self.target.register_forward_pre_hook(lambda module, args: drop_page_cache(*self.weight_files))
        else:
            # Weights in host RAM, executed where they are. (accelerate's cpu_offload hooks with the CPU as the
            # execution device break assisted generation in transformers 5.23 — "Cannot copy out of meta
            # tensor" — and would only add copies, so the peer gets its best case: no hooks at all.)
            self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=dtype, device_map={"": "cpu"})
            self.weight_files = []
        self.target.eval()
        self.draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=dtype).eval() if draft_dir else None
        self.assist = assist      # None: the assistant runs transformers' defaults

    def generate(self, ids, new_tokens, assisted: bool) -> PeerRun:
        return hf_generate(self.target, ids, new_tokens, self.draft if assisted else None, self.assist)


def run_offspec(engine, ids, new_tokens, tree: TreeConfig, offload: str):
    """-> (tokens, seconds, RunReport, steps)"""
    request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=new_tokens, tree=tree, ignore_eos=True)
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
        draft_q = load_resident(ckpt, torch.device("cpu"), dtype, quant="int8")
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


def measure_regime(args, regime: str, prompts, target_dir, draft_dir, dtype, settings) -> list[dict]:
    """Load every system for `regime`, measure `prompts` interleaved, append each row to --rows as it is made."""
    from offspec.load import load_engine

    tmp = tempfile.mkdtemp(prefix=f"bench-peers-{regime}-")
    print(f"\n== regime {regime}: loading transformers + accelerate ...", file=sys.stderr)
    hf = HfSystems(target_dir, draft_dir, dtype, regime, os.path.join(tmp, "hf-offload"), args.cold,
                   assist_settings(args))
    print(f"== regime {regime}: loading offspec ...", file=sys.stderr)
    offload = OffloadConfig(mode=regime, store_dir=os.path.join(tmp, "offspec-store") if regime == "disk" else None,
                            drop_page_cache=args.cold, n_slots=args.slots)
    loaded = load_engine(target_dir, draft_dir, offload, RuntimeConfig(device=torch.device("cpu"), dtype=dtype))
    engine_q = int8_draft_engine(loaded.engine, draft_dir, dtype) if args.int8_draft else None
    plain, tree = TreeConfig(policy="none"), TreeConfig(policy=args.policy,
                                                        budget=None if args.budget == "auto" else int(args.budget))
    # In interleaving order: (system, how to run it) -> (tokens, seconds, RunReport or PeerRun, steps or None).
    def peer(assisted: bool):
        def measure(ids, n):
            result = hf.generate(ids, n, assisted)
            return result.tokens, result.seconds, result, None
        return measure

    runners = [("hf-plain", peer(False)), ("hf-assisted", peer(True)),
               ("offspec-none", lambda ids, n: run_offspec(loaded.engine, ids, n, plain, regime)),
               ("offspec-tree", lambda ids, n: run_offspec(loaded.engine, ids, n, tree, regime))]
    if engine_q is not None:
        runners.append((INT8, lambda ids, n: run_offspec(engine_q, ids, n, tree, regime)))
    rows = []
    try:
        for _, measure in runners:       # warm-up (not counted): one short generation per system
            measure(prompts[0][1], 4)
        for pid, ids in prompts:
            out = {system: measure(ids, args.new_tokens) for system, measure in runners}
            row = make_row(regime, pid, ids, out, settings)
            rows.append(row)
            print(f"{regime} {pid}: " + ", ".join(f"{s} {row[s]['seconds_per_token']:.3f} s/tok"
                                                  f" (agree {row[s]['agreement_with_hf_plain']:.2f})"
                                                  for s, _ in runners), file=sys.stderr)
            if args.rows:
                append_line(args.rows, row)
    finally:
        loaded.engine.close()            # only the original engine: engine_q shares its target and streamer
        # The disk regime's offspec store is GBs; a resumed benchmark would otherwise leave one per run.
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def make_row(regime, pid, ids, out: dict, settings: dict) -> dict:
    """One (regime, prompt) row from {system: (tokens, seconds, RunReport or PeerRun, steps)}."""
    ref = out[REFERENCE][0]
    row = {"regime": regime, "id": pid, "prompt_tokens": len(ids), "settings": settings, "first_divergence": {}}
    for system, (toks, secs, report, steps) in out.items():
        row[system] = {"seconds_per_token": secs / max(len(toks), 1), "tokens": len(toks),
                       "agreement_with_hf_plain": agreement(toks, ref)}
        index = first_divergence(toks, ref)
        if index is not None:
            row["first_divergence"][system] = index
        if system in ("offspec-tree", INT8):
            row[system].update(tree_stats(report, steps))
        elif system == "offspec-none":
            row[system].update(target_seconds=report.target_seconds, passes=report.passes,
                               gb_streamed=report.gb_streamed, transfer_seconds=report.transfer_seconds)
        else:
            row[system].update(peer_cell(report))
    return row


def bench_regime(args, regime, prompts, target_dir, draft_dir, dtype, settings, old_rows) -> dict:
    """Measure the prompts of `regime` that --rows lacks; summarize old and new rows together."""
    done = rows_by_id(old_rows, regime, [pid for pid, _ in prompts])
    todo = [(pid, ids) for pid, ids in prompts if pid not in done]
    if args.rows:
        print(f"== regime {regime}: {len(done)} of {len(prompts)} prompts reused from {args.rows}, "
              f"{len(todo)} to measure", file=sys.stderr)
    new = measure_regime(args, regime, todo, target_dir, draft_dir, dtype, settings) if todo else []
    gc.collect()     # the regime's models are garbage now; free them before the next regime loads its own
    rows = {**done, **{r["id"]: r for r in new}}
    return summarize_regime(regime, [rows[pid] for pid, _ in prompts])


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


def summarize_regime(regime: str, rows: list[dict]) -> dict:
    """Medians per system over the rows that have it: a system a row lacks (older runs, --no-int8-draft) is
    absent there, and None in the summary when no row has it."""
    med = {s: median_or_none(r[s]["seconds_per_token"] for r in rows if s in r) for s in SYSTEMS}
    with_system = {s: sum(s in r for r in rows) for s in SYSTEMS}
    identical = {s: sum(s in r and r[s]["agreement_with_hf_plain"] == 1.0 for r in rows) for s in SYSTEMS}
    tree_rows = [r["offspec-tree"] for r in rows]
    int8_rows = [r[INT8] for r in rows if INT8 in r]
    assisted = [r["hf-assisted"] for r in rows if "hf-assisted" in r]
    peer_labels = {}                       # {label: rows}, in row order
    for cell in assisted:
        peer_labels[peer_label(cell)] = peer_labels.get(peer_label(cell), 0) + 1
    tokens_per_pass = statistics.median(t["tokens_per_pass"] for t in tree_rows)
    draft_per_round = statistics.median(t["draft_seconds"] / t["passes"] for t in tree_rows)
    # Cost-model check on this machine: "link" = the measured streaming rate, compute from offspec-none passes.
    none_rows = [r["offspec-none"] for r in rows]
    bytes_per_pass = statistics.median(n["gb_streamed"] * 1e9 / n["passes"] for n in none_rows)
    gbps = median_or_none(n["gb_streamed"] / n["transfer_seconds"] for n in none_rows if n["transfer_seconds"] > 0)
    pass_tree = statistics.median(t["target_seconds"] / t["passes"] for t in tree_rows)
    predicted_here = predict_seconds_per_token(int(bytes_per_pass), GpuSetup(link_gb_per_s=gbps or float("inf")),
                                               tokens_per_pass, draft_per_round, compute_seconds_per_pass=pass_tree)
    # On a GPU the draft is latency-bound: GPU_DRAFT_CALL_S per batched call, one call per tree depth plus the
    # catch-up call. Rows without depths (older runs) take the deepest tree allowed (32): an upper bound.
    calls = statistics.median(t.get("mean_depth", 32) + 1 for t in tree_rows)
    predicted_gpu = predict_seconds_per_token(int(bytes_per_pass), GpuSetup(link_gb_per_s=GPU_LINK_GB_PER_S),
                                              tokens_per_pass, calls * GPU_DRAFT_CALL_S)
    return {"regime": regime, "prompts": len(rows), "median_seconds_per_token": med, "rows_with_system": with_system,
            "identical_outputs": identical,
            "speedup_tree_vs_hf_assisted": ratio(med["hf-assisted"], med["offspec-tree"]),
            "speedup_tree_vs_hf_plain": ratio(med["hf-plain"], med["offspec-tree"]),
            "speedup_tree_vs_offspec_none": ratio(med["offspec-none"], med["offspec-tree"]),
            "speedup_int8_tree_vs_hf_assisted": ratio(med["hf-assisted"], med[INT8]),
            "tokens_per_pass": tokens_per_pass,
            "tokens_per_pass_int8": median_or_none(t["tokens_per_pass"] for t in int8_rows),
            # hf-assisted as it ran: rows from before issue #13 counted no passes and read nothing back
            "tokens_per_pass_hf_assisted": median_or_none(c["tokens_per_pass"] for c in assisted if "peer_passes" in c),
            "hf_assisted_settings": peer_labels,
            "draft_seconds_per_round": draft_per_round,
            "draft_seconds_per_round_int8": median_or_none(t["draft_seconds"] / t["passes"] for t in int8_rows),
            "streamed_gb_per_pass": bytes_per_pass / 1e9, "measured_gb_per_s": gbps,
            "target_pass_seconds_tree": pass_tree,
            "costmodel_predicted_here": predicted_here["seconds_per_token"],
            "costmodel_measured_here": med["offspec-tree"],
            "costmodel_gpu_24gbps": predicted_gpu["seconds_per_token"], "rows": rows}


def fmt(value: Optional[float], spec: str, suffix: str = "") -> str:
    """A number for a table cell, or '-' for a system the rows lack."""
    return "-" if value is None else f"{value:{spec}}{suffix}"


def systems_present(results: list[dict]) -> list[str]:
    return [s for s in SYSTEMS if any(r["median_seconds_per_token"][s] is not None for r in results)]


def peer_text(results: list[dict]) -> str:
    """What hf-assisted ran, by each row's read-back settings (per regime when they differ), and what the rows
    from before issue #13 ran instead of what they asked for."""
    labels = [r["hf_assisted_settings"] for r in results]
    if all(list(l) == list(labels[0]) for l in labels) and len(labels[0]) == 1:
        text = f"hf-assisted settings, as each row stores them: {next(iter(labels[0]))} (every row)."
    else:
        text = "hf-assisted settings, as each row stores them: " + "; ".join(
            f"{r['regime']}: " + ", ".join(f"{label} ({n} rows)" for label, n in r["hf_assisted_settings"].items())
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


def markdown(results: list[dict], args, dtype, started: float, load_at_start: str) -> str:
    systems = systems_present(results)
    lines = ["## offspec vs transformers + accelerate (`scripts/bench_peers.py`)", "",
             _common.run_header(torch.device("cpu"), started, load_at_start), "",
             *([f"Rendered from the rows in `{args.rows}`, measured by the same command without --report-only "
                "(interleaved prompt by prompt, one process per regime).", ""] if args.report_only else []),
             f"dtype {str(dtype).replace('torch.', '')}, greedy, {args.new_tokens} new tokens, "
             f"HumanEval prompts (chat template), page cache {'dropped before every pass' if args.cold else 'warm'} "
             f"in the disk regime. {peer_text(results)} "
             f"offspec: {args.slots} ring slots, tree {args.policy}, budget {args.budget}."
             + (f" {INT8}: offspec-tree with a weight-only int8 draft (same target); an extra, the goals are "
                "measured with offspec-tree (the peer's bf16 models)." if INT8 in systems else ""),
             "", "| regime | system | median s/token | vs hf-plain | identical outputs |", "|---|---|---|---|---|"]
    for r in results:
        med = r["median_seconds_per_token"]
        for s in systems:
            have = r["rows_with_system"][s]
            lines.append(f"| {r['regime']} | {s} | {fmt(med[s], '.3f')} | {fmt(ratio(med['hf-plain'], med[s]), '.2f', 'x')} | "
                         + (f"{r['identical_outputs'][s]}/{have} |" if have else "- |"))
    lines += ["", "Outputs of all systems vs hf-plain, per prompt: "
              + "; ".join(f"{r['regime']}: {identity_text(r['identity'])}" for r in results) + "."]
    lines += ["", "| regime | offspec-tree vs hf-assisted | int8-draft tree vs hf-assisted | vs offspec-none | "
              "tokens/pass (bf16 / int8 draft) | hf-assisted tokens/pass | "
              "cost model: predicted / measured s/token here | PREDICTED on a GPU, 24 GB/s |",
              "|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['regime']} | {fmt(r['speedup_tree_vs_hf_assisted'], '.2f', 'x')} | "
                     f"{fmt(r['speedup_int8_tree_vs_hf_assisted'], '.2f', 'x')} | "
                     f"{fmt(r['speedup_tree_vs_offspec_none'], '.2f', 'x')} | "
                     f"{r['tokens_per_pass']:.2f} / {fmt(r['tokens_per_pass_int8'], '.2f')} | "
                     f"{fmt(r['tokens_per_pass_hf_assisted'], '.2f')} | "
                     f"{r['costmodel_predicted_here']:.3f} / {r['costmodel_measured_here']:.3f} | "
                     f"{r['costmodel_gpu_24gbps']:.3f} |")
    lines += ["", "Cost model (`offspec/costmodel.py`, a prediction): s/token = (max(streamed bytes / link, compute) + "
              "draft per round) / tokens per pass. 'Here' uses this run's measured streaming rate, target pass time "
              "and draft time, and is checked against the measured s/token. 'On a GPU' assumes "
              f"{GPU_LINK_GB_PER_S:g} GB/s pinned PCIe, {GPU_DRAFT_CALL_S * 1000:g} ms per batched draft call, one call "
              "per tree depth plus one, and this run's tokens per pass; it is not a measurement. hf-assisted "
              "tokens/pass: its new tokens over the target forward passes a hook counted ('-': rows from before "
              "issue #13, which counted none)."]
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    systems = systems_present(results)
    fig, ax = plt.subplots(figsize=(7, 3.5))
    width = 0.8 / max(len(systems), 1)
    for j, s in enumerate(systems):
        xs = [i + (j - (len(systems) - 1) / 2) * width for i in range(len(results))]
        ax.bar(xs, [r["median_seconds_per_token"][s] or 0.0 for r in results], width, label=s)
    ax.set_xticks(range(len(results)), [r["regime"] for r in results])
    ax.set_ylabel("median seconds / token (lower is better)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


# ------------------------------------------------------------------ main

def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--prompts", type=int, default=16, help="HumanEval prompts to run (the first N)")
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--regimes", default="disk,cpu", help="comma-separated: disk, cpu")
    p.add_argument("--dtype", default="bfloat16",
                   help="bfloat16 (a difference must be explained by an fp32 recheck) or float32 (identity enforced)")
    p.add_argument("--policy", default="dyspec", help="offspec tree policy")
    p.add_argument("--budget", default="auto", help="offspec tree budget (a number or auto)")
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
    p.add_argument("--slots", type=int, default=8,
                   help="offspec ring slots: while the draft grows a tree, the loader prefetches this many layers of "
                        "the next pass (each slot holds one layer: 93 MB for the 1.5B target in bf16)")
    p.add_argument("--no-cold", dest="cold", action="store_false", help="disk regime: keep the page cache warm")
    p.add_argument("--no-int8-draft", dest="int8_draft", action="store_false",
                   help=f"leave out {INT8} (offspec-tree with a weight-only int8 draft)")
    p.add_argument("--rows", default=None,
                   help="append raw per-prompt rows (and fp32 checks) to this JSONL file; a rerun with the same "
                        "file skips the prompts it already holds")
    p.add_argument("--fresh", action="store_true", help="with --rows: move an existing FILE to FILE.bak and start over")
    p.add_argument("--json", default=str(ROOT / "docs" / "bench_peers.json"))
    p.add_argument("--plot", default=str(ROOT / "docs" / "peers.png"))
    p.add_argument("--write-docs", action="store_true", help="replace the bench_peers section of docs/benchmarks.md")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing (no fp32 check either): summarize the rows already in --rows")
    args = p.parse_args()
    if args.fresh and not args.rows:
        p.error("--fresh needs --rows FILE")
    if args.fresh and args.report_only:
        p.error("--fresh would move away the rows --report-only is to summarize")
    if args.report_only and (not args.rows or not Path(args.rows).is_file()):
        p.error("--report-only needs --rows FILE from an earlier run")
    if args.int8_draft and not args.report_only and not int8_draft_available():
        p.error(f"offspec.draft.load_resident has no quant= in this checkout, so {INT8} cannot run: "
                "pass --no-int8-draft")
    return p, args


def main() -> int:
    from offspec.demo import ensure_demo_models, humaneval_prompts
    from offspec.prompt import encode_prompt

    p, args = parse_args()
    started, load_at_start = time.time(), _common.load_average()
    dtype = parse_dtype(args.dtype)
    settings = run_settings(args, dtype)
    if args.fresh:
        move_aside(args.rows)
    old_rows, checks = read_rows_file(args.rows)
    # --report-only labels hf-assisted by what each row read back (peer_settings), not by the --assist-* options.
    compared = {k: v for k, v in settings.items() if not (args.report_only and k == "assist")}
    mismatches = settings_mismatches(old_rows, compared)
    if mismatches:
        p.error(f"{args.rows} holds rows measured with other settings ({'; '.join(mismatches)}): "
                "pass the same settings, --fresh, or another --rows file")

    target_dir, draft_dir = ensure_demo_models()
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(str(target_dir))
    prompts = [(h["id"], encode_prompt(tokenizer, "Complete this Python function:\n\n" + h["prompt"]))
               for h in humaneval_prompts(args.prompts)]
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    ids = [pid for pid, _ in prompts]
    if args.report_only:
        stored = {r: rows_by_id(old_rows, r, ids) for r in regimes}
        results = [summarize_regime(r, [stored[r][pid] for pid in ids if pid in stored[r]]) for r in regimes
                   if stored[r]]
        if not results:
            p.error(f"{args.rows} holds no rows for regimes {','.join(regimes)} and these prompts: nothing to report")
    else:
        results = [bench_regime(args, regime, prompts, target_dir, draft_dir, dtype, settings, old_rows)
                   for regime in regimes]

    # Final phase, untimed: explain bf16 differences in float32, or fail.
    fp32_run = dtype == torch.float32
    todo = {} if fp32_run or args.report_only else fp32_todo(results, checks)
    if todo:
        new_checks = fp32_check(todo, dict(prompts), target_dir, draft_dir)
        checks.update(new_checks)
        if args.rows:
            for entry in new_checks.values():
                append_line(args.rows, entry)
    for r in results:
        r["identity"] = identity_summary(r["rows"], checks, fp32_run)
        r["fp32_checks"] = {row["id"]: checks[row["id"]] for row in r["rows"] if row["id"] in checks}

    table = markdown(results, args, dtype, started, load_at_start)
    print(table)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(results, indent=1))
    plot(results, args.plot)
    if args.write_docs:
        _common.write_doc_section("bench_peers", table + f"\n\n![s/token per system]({Path(args.plot).name})\n")
    return verdict(results, fp32_run)


def verdict(results: list[dict], fp32_run: bool) -> int:
    """Say what the identity check found on stderr; 1 when any difference is not bf16 rounding."""
    for r in results:
        print(f"identity {r['regime']}: {identity_text(r['identity'])}".replace("**", ""), file=sys.stderr)
    failed = sum(r["identity"]["fail"] for r in results)
    if failed:
        why = ("in float32 their outputs must be identical" if fp32_run else
               "the float32 recheck differs too, so bf16 rounding does not explain it")
        print(f"FAIL: {failed} prompt(s) where a system's tokens differ from hf-plain; all systems are greedy and "
              f"lossless: {why}", file=sys.stderr)
        return 1
    if any(r["identity"]["unchecked"] for r in results):
        print("(some bf16 differences are not checked in float32 yet: run without --report-only to check them)",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
