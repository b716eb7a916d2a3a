#!/usr/bin/env python3
"""The transformers peer: Hugging Face transformers generate with accelerate offloading the target, plain or with
the draft as its assistant (assisted generation), on the models and prompts offspec runs. scripts/bench_peers.py
measures it beside offspec through offspec.bench.runner; run alone, this script sweeps the assistant's settings.

hf-assisted's settings (AssistSettings) go on the ASSISTANT's generation_config, where transformers reads them, and
every cell stores what transformers actually used (peer_settings, read back after the call), the target passes a
hook counted (peer_passes) and the draft tokens those passes verified (peer_draft_tokens).

Regimes: disk (accelerate: decoder layers -> "disk", read from the checkpoint's safetensors; with cold, the page
cache is dropped for those files before every target pass, as for a target bigger than RAM) and cpu (every
weight in host RAM, executed where it lies: the peer's best case on a CPU). On a GPU the non-layer weights and
the compute go there; accelerate brings each offloaded layer to it for its forward.

Run as a script, it sweeps: hf-assisted alone under each of SWEEP (transformers' defaults; constant 4, 8 and 16
draft tokens with confidence threshold 0 and 0.4) on a calibration subset of prompts (--prompt-offset keeps it
apart from the measured prompts), rows appended to --rows; bench_peers runs the setting with the lowest median
s/token for its regime and prompt set (best_setting). Every sweep row records its new tokens and repeats. Example:
  python scripts/peer_hf.py --regime disk --prompt-set chat --prompt-offset 32 --prompts 5 \
      --rows docs/bench_peers/sweep-disk-chat.jsonl
"""
from __future__ import annotations

import argparse
import copy
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))                 # this checkout's offspec, not an installed one
sys.path.insert(0, str(ROOT / "scripts"))

import _common  # noqa: E402

from offspec.bench import runner as bench  # noqa: E402
from offspec.bench.prompt_sets import PROMPT_SETS, load_prompt_set  # noqa: E402
from offspec.engine.metrics import synchronize  # noqa: E402
from offspec.stream.disk import drop_page_cache  # noqa: E402

SWEEP_KIND = "sweep"         # the "kind" of sweep rows
CODE_INSTRUCTION = "Complete this Python function:\n\n"   # put before each HumanEval prompt


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


# The sweep: transformers' defaults, then constant schedules of 4, 8 and 16 draft tokens, each with confidence
# threshold 0 (draft all k) and 0.4 (stop a draft at a token the draft gives < 0.4, transformers' default).
SWEEP: tuple[Optional[AssistSettings], ...] = (None, *(AssistSettings(k, "constant", t)
                                                      for k in (4, 8, 16) for t in (0.0, 0.4)))


def assist_label(assist: Optional[AssistSettings]) -> str:
    """'constant 8, threshold 0' / 'transformers defaults': a sweep setting in a few words."""
    if assist is None:
        return "transformers defaults"
    return f"{assist.schedule} {assist.num_assistant_tokens}, threshold {assist.confidence_threshold:g}"


def assist_record(assist: Optional[AssistSettings]):
    """How settings and sweep rows store an AssistSettings."""
    return "transformers defaults" if assist is None else {
        "num_assistant_tokens": assist.num_assistant_tokens, "schedule": assist.schedule,
        "confidence_threshold": assist.confidence_threshold}


# ------------------------------------------------------------------ one generate call

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
                temperature: float = 0.0, seed: int = 0, eos_ids: Optional[list[int]] = None) -> PeerRun:
    """transformers generate of up to `new_tokens`: greedy at temperature 0, else sampling at `temperature` (no
    top-k or top-p, as offspec's SamplingConfig) from torch's generator seeded with `seed`. It stops at any of
    `eos_ids` (offspec's stop tokens, load.Models.eos_ids, so both sides stop alike; None: the model's
    generation_config's EOS ids); the stop token itself is not counted (offspec does not emit it either).

    With an assistant, `assist` goes on the assistant's generation_config (None: leave transformers' defaults);
    the call runs on a copy of that config, restored afterwards, because transformers writes the heuristic
    schedule's last token count back into it and the next call would start from there."""
    import transformers

    sampling = dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature > 0 else \
        dict(do_sample=False)
    config = transformers.GenerationConfig(max_new_tokens=new_tokens, min_new_tokens=0, eos_token_id=eos_ids,
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
    eos = eos_ids if eos_ids is not None else target.generation_config.eos_token_id
    eos = set([eos] if isinstance(eos, int) else (eos or []))
    if tokens and tokens[-1] in eos:
        tokens = tokens[:-1]
    drafted = watch.draft_tokens(len(ids))
    return PeerRun(tokens=tokens, seconds=seconds, passes=len(watch.fed), max_draft_tokens=max(drafted, default=0),
                   draft_tokens=sum(drafted),
                   settings=peer_settings(watch.generators[0]) if assistant is not None else None)


def peer_cell(run: PeerRun) -> dict:
    """A cell in offspec.bench.runner's form, with the peer's counters: passes, tokens per pass, draft tokens verified
    and, when assisted, the settings transformers used."""
    cell = {"tokens": run.tokens, "seconds": run.seconds, "passes": run.passes,
            "tokens_per_pass": len(run.tokens) / max(run.passes, 1), "peer_max_draft_tokens": run.max_draft_tokens,
            "peer_draft_tokens": run.draft_tokens}
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

    def __init__(self, target_dir, draft_dir, dtype, regime, offload_folder, cold,
                 device: torch.device = torch.device("cpu"), eos_ids: Optional[list[int]] = None):
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
        self.eos_ids = eos_ids      # the tokens a generation stops at (None: the target's generation_config's)

    def runner(self, assisted: bool, assist: Optional[AssistSettings] = None, temperature: float = 0.0):
        """An offspec.bench.runner runner: one generate call (assisted: with the draft under `assist`; None =
        transformers' defaults)."""
        def measure(ids, new_tokens, seed):
            return peer_cell(hf_generate(self.target, ids, new_tokens, self.draft if assisted else None, assist,
                                         temperature=temperature, seed=seed, eos_ids=self.eos_ids))
        return measure


def encoded_prompts(prompt_set: str, count: int, offset: int, tokenizer) -> list[tuple[str, list[int]]]:
    """(prompt id, chat-templated ids) for `count` prompts of the set from `offset` on; HumanEval prompts get
    CODE_INSTRUCTION before them."""
    from offspec.engine.prompt import encode_prompt

    return [(pid, encode_prompt(tokenizer, (CODE_INSTRUCTION if prompt_set == "code" else "") + text))
            for pid, text in load_prompt_set(prompt_set, offset + count)[offset:]]


# ------------------------------------------------------------------ the sweep

def assist_of(record) -> Optional[AssistSettings]:
    """The AssistSettings an assist_record stored (None: transformers' defaults)."""
    if record == "transformers defaults":
        return None
    return AssistSettings(record["num_assistant_tokens"], record["schedule"], record["confidence_threshold"])


def best_setting(rows: list[dict], regime: str, prompt_set: str) -> Optional[dict]:
    """The sweep rows' best setting for (regime, prompt set): {"label", "assist" (an assist_record), "seconds_per_
    token" (its median CI), "prompts"}; the lowest median s/token over the prompts every setting ran. None
    without rows."""
    rows = [r for r in rows if r.get("kind") == SWEEP_KIND and r["regime"] == regime
            and r["prompt_set"] == prompt_set]
    if not rows:
        return None
    labels = set.intersection(*(set(r["systems"]) for r in rows))
    cis = {label: bench.median_ci([r["systems"][label]["seconds_per_token"] for r in rows]) for label in labels}
    best = min(cis, key=lambda label: cis[label]["median"])
    return {"label": best, "assist": assist_record(next(a for a in SWEEP if assist_label(a) == best)),
            "seconds_per_token": cis[best], "prompts": len(rows)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=_common.HelpFormatter)
    p.add_argument("--regime", choices=("disk", "cpu"), required=True)
    p.add_argument("--prompt-set", choices=PROMPT_SETS, default="code")
    p.add_argument("--prompts", type=int, default=5, help="calibration prompts, from --prompt-offset on")
    p.add_argument("--prompt-offset", type=int, default=32,
                   help="skip the set's first K prompts, so the calibration subset is not the measured one")
    p.add_argument("--new-tokens", type=int, default=64, help="token budget per prompt (transformers stops at EOS)")
    p.add_argument("--repeats", type=int, default=1, help="timed runs per setting and prompt, order shuffled")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="auto", help="auto (the GPU when there is one), cpu or cuda[:N]")
    p.add_argument("--no-cold", dest="cold", action="store_false", help="disk regime: keep the page cache warm")
    p.add_argument("--rows", required=True, help="JSONL file the sweep rows are appended to (a rerun resumes)")
    args = p.parse_args(argv)
    if args.prompts < 1 or args.new_tokens < 1 or args.repeats < 1 or args.prompt_offset < 0:
        p.error("--prompts, --new-tokens and --repeats must be >= 1, --prompt-offset >= 0")
    args.device = _common.compute_device(args.device)
    return args


def main(argv=None) -> int:
    from transformers import AutoTokenizer

    from offspec.engine.load import parse_dtype
    from offspec.formats.demo import ensure_demo_models

    args = parse_args(argv)
    bench.check_appendable(args.rows)
    dtype = parse_dtype(args.dtype)
    target_dir, draft_dir = ensure_demo_models()
    prompts = encoded_prompts(args.prompt_set, args.prompts, args.prompt_offset,
                              AutoTokenizer.from_pretrained(str(target_dir)))
    extra = {"kind": SWEEP_KIND, "regime": args.regime, "prompt_set": args.prompt_set,
             "settings": {"dtype": args.dtype, "cold": args.cold, "device": args.device.type,
                          "new_tokens": args.new_tokens, "repeats": args.repeats},
             "command": _common.command_line()}
    old = [r for r in bench.read_rows(args.rows) if r.get("kind") == SWEEP_KIND and r["regime"] == args.regime
           and r["prompt_set"] == args.prompt_set]
    tmp = tempfile.mkdtemp(prefix="peer-sweep-")
    try:
        hf = HfSystems(target_dir, draft_dir, dtype, args.regime, os.path.join(tmp, "offload"), args.cold,
                       device=args.device)
        runners = {assist_label(a): hf.runner(True, a) for a in SWEEP}
        bench.measure(prompts, runners, args.new_tokens, repeats=args.repeats, done=[bench.row_key(r) for r in old],
                      extra=extra, on_row=lambda row: (bench.append_row(args.rows, row), print(
                          f"{row['id']}: " + ", ".join(f"{k} {c['seconds_per_token']:.3f}"
                                                       for k, c in row["systems"].items()), file=sys.stderr)))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    best = best_setting(bench.read_rows(args.rows), args.regime, args.prompt_set)
    print(f"best hf-assisted setting, {args.regime}, {args.prompt_set}: {best['label']} "
          f"({bench.fmt_ci(best['seconds_per_token'])} s/token over {best['prompts']} prompts)")
    return 0


if __name__ == "__main__":
    _common.run_main(main)
