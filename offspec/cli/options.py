"""What several `offspec` commands share: the choices, the model and run options, their parsing into configs,
the models they open, and one-line failures, warnings and JSON reports."""
from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path
from typing import NoReturn, Optional

import click

from offspec.config import (
    AUTO_MAX_TREE_BUDGET,
    DEFAULT_PREFILL_CHUNK,
    FIXED_BUDGET_DEPTH,
    OffloadConfig,
    RunLimits,
    SamplingConfig,
    TreeConfig,
)
from offspec.engine.controller import ONE_ROW_CPU_BUDGET
from offspec.errors import InputError, OffspecError
from offspec.formats.weights import FUSED_MAX_ROWS
from offspec.plan.machine import PINNED_FRACTION

POLICIES = ["auto", "dyspec", "heap", "chain", "static", "sequoia", "none"]   # sequoia.AUTO + grow.POLICIES (likewise)
OFFLOAD_CHOICES = ["auto", "none", "cpu", "disk", "cpu+disk"]     # auto + plan.MODES
TARGET_QUANT_CHOICES = ["none", "int8", "nf4"]   # quant.TARGET_QUANTS (not imported here: keeps --help fast)
RESIDENT_QUANT_CHOICES = ["auto", "on", "off"]   # plan.RESIDENT_QUANTS
DRAFT_QUANT_CHOICES = ["auto", "none", "int8", "int8-held", "nf4", "int4"]   # auto + draft_quant.QUANT_MODES
SELF_DRAFT = "self"            # --draft self (load.SELF_DRAFT, not imported here: keeps --help fast)


def parse_bytes(text: Optional[str]) -> Optional[int]:
    """'24GB', '512MiB', '1.5G', '1000000' -> bytes; None stays None."""
    if text is None:
        return None
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kmgt]?)(i?)b?\s*", text.lower())
    if not m:
        raise InputError(f"cannot read {text!r} as a size (examples: 24GB, 512MiB, 1500000000)")
    number, unit, binary = float(m.group(1)), m.group(2), m.group(3)
    scale = (1024 if binary else 1000) ** "_kmgt".index(unit) if unit else 1
    return int(number * scale)


def parse_context(text: str) -> Optional[int]:
    """--context: 'auto' -> None (from the prompts), else a whole number >= 2."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise InputError(f"--context must be 'auto' or a whole number of tokens, not {text!r}") from None
    if value < 2:
        raise InputError("--context must be at least 2 tokens")
    return value


def parse_auto_count(text: str, option: str, minimum: int) -> Optional[int]:
    """An 'auto'-or-number option (--concurrency, --tree-budget, --prefill-per-pass): 'auto' -> None."""
    if text == "auto":
        return None
    try:
        value = int(text)
    except ValueError:
        raise InputError(f"{option} must be 'auto' or a whole number, not {text!r}") from None
    if value < minimum:
        raise InputError(f"{option} must be at least {minimum}")
    return value


def default_device() -> str:
    import torch
    return "cuda" if torch.cuda.is_available() else "cpu"


def model_options(f):
    """Options shared by generate, batch and bench."""
    options = [
        click.option("--target", type=click.Path(), default=None,
                     help="Target model: a folder (Hugging Face layout; AWQ, GPTQ and compressed-tensors "
                          "checkpoints as published), a GGUF file (the first part of a split one), or a hub id such "
                          "as Qwen/Qwen2.5-7B-Instruct, "
                          "read from the local Hugging Face cache (downloaded there unless HF_HUB_OFFLINE=1). "
                          "Default: the embedded Qwen2.5-Coder-1.5B-Instruct."),
        click.option("--draft", type=click.Path(), multiple=True,
                     help="Draft model: a folder, a GGUF file or a hub id, like --target; same tokenizer as the target "
                          "(embedding rows may differ). 'self' = the target's own layers held quantized on the device "
                          "(--draft-quant auto: int4 in bfloat16, on a GPU and a CPU) beside the target's embedding, "
                          "built at load from the target's weights: no second model to find, and it accepts more "
                          "tokens a pass than a small draft (a folder named self: ./self). Given more than once "
                          "(--draft self --draft DIR): offspec takes, of those that fit, each in turn until each has "
                          "been measured on this machine, then the fastest (seconds a token, recorded per model pair "
                          "and device under $OFFSPEC_HOME/drafts; the report's plan note says which and why). "
                          "Default: the embedded Qwen2.5-Coder-0.5B-Instruct when --target is not given (and the "
                          "demo target's twin beside it where the target streams); else self where the memory plan "
                          "streams target layers and fits the twin beside them, the target alone where not (all "
                          "resident: a twin's round costs about what it saves; offspec bench takes self)."),
        click.option("--draft-quant", type=click.Choice(DRAFT_QUANT_CHOICES), default="auto", show_default=True,
                     help="How the draft's matrices are held. int8 = beside each its int8 copy (one scale per row, "
                          "+50% draft memory), which a prompt's tokens in a draft call read when the call covers at "
                          f"most {FUSED_MAX_ROWS} of that prompt's tokens (its own count, never its batch's): such a "
                          "call on a CPU reads every weight, so reading half the bytes makes it faster (draft-call "
                          "times: docs/notes/2026-11-26-draft-int8-copy.md). int8-held / nf4 = held ONLY quantized "
                          "(per-row int8: 0.50x; bitsandbytes nf4: 0.28x of bf16; lm_head stays dense) to free device "
                          "memory for resident target layers: each call dequantizes a matrix at a time (slower on a "
                          "CPU; int8-held reads int8 directly where the copy would). int4 = held ONLY in 4-bit groups "
                          "of 64, lm_head too (0.28x), read in 4 bits by PyTorch's int4 matmul on a CPU and a GPU "
                          "(bfloat16 there), never dequantized. Output is unchanged either way "
                          "(the target verifies every token), only acceptance may move slightly, and a prompt's tokens "
                          "do not depend on what shares its passes. auto = int8 on a CPU in bfloat16, none on a GPU "
                          "(where a draft call is latency-bound) and in float32 or float16 (where the int8 kernel is "
                          "slower); for --draft self, int4 in bfloat16 (nf4 on a GPU where its kernel cannot run), "
                          "else nf4 on a GPU and int8 on a CPU."),
        click.option("--target-quant", type=click.Choice(TARGET_QUANT_CHOICES), default="none", show_default=True,
                     help="Store, pin, read and stream the target's decoder layers quantized (nf4, by bitsandbytes: "
                          "4.5 bits a weight, 0.28x the bf16 bytes; int8: symmetric, one scale a row, 0.50x) and "
                          "dequantize each on the device right before it runs. This CHANGES the target: the output is "
                          "exactly the quantized target's (its greedy tokens, its distribution). Quantized once into a "
                          "packed store (as for --offload disk), reused while weights, dtype and quantization match."),
        click.option("--resident-quant", type=click.Choice(RESIDENT_QUANT_CHOICES), default="auto", show_default=True,
                     help="With --target-quant: hold the resident target layers (those --gpu-budget keeps on the "
                          "device) as their quantized blocks, 0.28x (nf4) / 0.50x (int8) of bf16 plus one dense "
                          "scratch layer, and dequantize each into the scratch right before it runs, every pass: about "
                          "2x (int8) / 3.5x (nf4) as many layers stay resident, so fewer stream; the price is a "
                          "dequantization per held layer per pass (its cost on a GPU and a CPU: "
                          "docs/notes/2026-11-23-held-quantized-layers-and-drafts.md). auto = held only where that "
                          "keeps more layers resident (never when all fit dense); off = resident layers dequantized "
                          "once, dense."),
        click.option("--device", default=default_device, show_default="cuda if available, else cpu",
                     help="Compute device for both models."),
        click.option("--dtype", default="bfloat16", show_default=True,
                     help="Weight and compute dtype: bfloat16, float16 or float32 (float32 for bit-exact greedy)."),
        click.option("--offload", type=click.Choice(OFFLOAD_CHOICES), default="auto", show_default=True,
                     help="Where the target's decoder layers live: none = all on the device; cpu = host RAM, streamed; "
                          "disk = packed store on disk, streamed; cpu+disk = streamed layers in host RAM (the first "
                          "pinned, within --host-budget, more pageable, as many as make the predicted pass shortest), "
                          "the rest read from the disk store in the same pass, their reads overlapping the RAM "
                          "layers' copies. auto, on a GPU: none if the whole target fits beside everything else, else "
                          "cpu if its layers fit in pinned RAM, else cpu+disk (the memory plan decides; "
                          "`offspec models info` shows it); on a CPU-only run: none (there the 'device' is host RAM "
                          "already and streaming would only add copies)."),
        click.option("--gpu-budget", default=None, help="Device bytes for the target's decoder layers, ring included "
                     "(e.g. 20GB); decides how many layers stay resident. Refused when above what the memory plan "
                     "leaves after the draft, globals, KV caches, logits and activations. Default: all of that "
                     "on a GPU; on the CPU, nothing resident beyond the streaming ring."),
        click.option("--slots", "n_slots", type=int, default=2, show_default=True,
                     help="Device slots in the streaming ring, in layers (>= 2; 1 only with --no-overlap); a ring "
                     "split into layers' parts, where two whole layers do not fit, asks for this many layers' parts."),
        click.option("--store-dir", default=None,
                     help="Disk-mode packed store folder. Default: under $OFFSPEC_HOME/stores."),
        click.option("--host-budget", default=None, help="Host RAM that may be pinned (the arena, the disk staging; "
                     "e.g. 64GB); an arena above it has its first layers pinned and the rest pageable (slower "
                     "copies, said in the report). "
                     "Refused when above the host memory the run may use. "
                     f"Default: {PINNED_FRACTION:.0%} of min(MemAvailable, the cgroup's memory limit)."),
        click.option("--context", "context", default="auto", show_default=True,
                     help="Tokens one sequence may reach (prompt + generated + one tree): sizes both KV caches. auto = "
                          "the longest prompt + --max-new-tokens + the largest tree, capped at the models' context."),
        click.option("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, show_default=True,
                     help="Rows each layer processes at a time in one forward: a long prompt's activations stay this "
                          "size (a streamed target still moves each layer once)."),
        click.option("--disk-io", type=click.Choice(["direct", "buffered"]), default="direct", show_default=True,
                     help="Disk offload reads: direct = O_DIRECT where the filesystem allows it (falls back to "
                          "buffered where it refuses, said in the report), several reads in flight; buffered = through "
                          "the page cache, each range dropped after it is read. `offspec doctor` measures both on your "
                          "drive."),
        click.option("--no-overlap", is_flag=True,
                     help="Debug: copy each layer, then compute (no prefetch). Default: overlap."),
        click.option("--tree", "policy", type=click.Choice(POLICIES), default="auto", show_default=True,
                     help="Tree growth policy; sequoia = the fixed tree Sequoia's DP finds best for the acceptance "
                          "by rank measured on this draft and target (cached per pair); dyspec = DySpec's tree, grown "
                          "by the draft's probabilities; auto = sequoia where the draft is the target's twin (--draft "
                          "self), dyspec with a separate draft; none = plain autoregressive with the target alone."),
        click.option("--tree-budget", default="auto", show_default=True,
                     help="Max tree nodes per target pass, or 'auto' (chosen from measured draft and target times, "
                          f"up to {AUTO_MAX_TREE_BUDGET}; one prompt on a CPU whose target streams: "
                          f"{ONE_ROW_CPU_BUDGET} every round)."),
        click.option("--threshold", type=float, default=None,
                     help="DySpec threshold C. Default: adaptive (C set so the tree fills the budget)."),
        click.option("--max-depth", default="auto", show_default=True,
                     help="Deepest tree level, or 'auto': with an auto --tree-budget no bound of its own (the budget "
                          "planner prices each level as a draft call, so the measured costs choose the depth with the "
                          f"size), with a fixed budget {FIXED_BUDGET_DEPTH}."),
        click.option("--branching", type=int, default=TreeConfig.branching, show_default=True,
                     help="Candidate children examined per node per depth."),
        click.option("--no-prune", is_flag=True,
                     help="dyspec: run the draft on every node that could still join the tree. Default: only on nodes "
                          "at least as likely as the lowest node of last round's full tree (fewer draft rows)."),
        click.option("--ngram", type=click.Choice(["on", "off"]), default="on" if TreeConfig.ngram else "off",
                     show_default=True,
                     help="Graft continuations the prompt and the generated text already contain (prompt lookup) onto "
                          "each tree, at no draft call; they take tree budget only when likely. Off by default: "
                          "measured level on chat and worse on code (docs/notes/2026-11-25-tree-levers.md)."),
        click.option("--calibrate", type=click.Choice(["on", "off"]), default="on" if TreeConfig.calibrate else "off",
                     show_default=True,
                     help="Rank tree nodes by the acceptance rates observed (by depth and draft probability), not "
                          "by raw draft probabilities, learned from this pair's earlier runs on "
                          "($OFFSPEC_HOME/calibration). Output is unchanged either way. Off by default: level with "
                          "the demo's draft, whose probabilities already match (docs/benchmarks.md)."),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass (1 = off)."),
        click.option("--top-k", type=int, default=0, show_default=True,
                     help="Keep the k most likely tokens (0 = off)."),
        click.option("--seed", type=int, default=0, show_default=True, help="Random seed for sampling."),
    ]
    for option in reversed(options):
        f = option(f)
    return f


def build_configs(o: dict, check_device: bool = True):
    """check_device False: the device is a Ray worker's, not this machine's (CUDA need not be here)."""
    import torch

    from offspec.engine.load import parse_device, parse_dtype, runtime_config

    runtime = runtime_config(parse_device(o["device"], check_available=check_device), parse_dtype(o["dtype"]),
                             o["draft_quant"], o["target_quant"], o["resident_quant"],
                             twin=SELF_DRAFT in draft_of(o))   # before any model is read
    if check_device and runtime.device.type == "cpu" and runtime.dtype == torch.float16:   # (a worker's: its own)
        warn("--dtype float16 on a CPU: CPUs have no fast float16 matmuls, so this runs far slower than "
             "--dtype bfloat16 (or float32); use bfloat16")
    if o["n_slots"] < (1 if o["no_overlap"] else 2):
        raise InputError("--slots must be at least 2 (1 only with --no-overlap)")
    if o["prefill_chunk"] < 1:
        raise InputError("--prefill-chunk must be at least 1")
    # "auto" stays: the memory plan resolves it from the sizes (plan.make_plan).
    offload = OffloadConfig(mode=o["offload"], gpu_budget=parse_bytes(o["gpu_budget"]), n_slots=o["n_slots"],
                            store_dir=o["store_dir"], host_budget=parse_bytes(o["host_budget"]), disk_io=o["disk_io"],
                            overlap=not o["no_overlap"])
    if o["temperature"] < 0:
        raise InputError("--temperature must be >= 0")
    if not 0 < o["top_p"] <= 1:
        raise InputError("--top-p must be in (0, 1]")
    if o["top_k"] < 0:
        raise InputError("--top-k must be >= 0 (0 = off)")
    if o["threshold"] is not None and not 0 <= o["threshold"] <= 1:
        raise InputError("--threshold must be in [0, 1]")
    if o["branching"] < 1:
        raise InputError("--branching must be at least 1")
    tree = TreeConfig(policy=o["policy"], budget=parse_auto_count(o["tree_budget"], "--tree-budget", 0),
                      threshold=o["threshold"], max_depth=parse_auto_count(o["max_depth"], "--max-depth", 1),
                      branching=o["branching"],
                      prune=not o["no_prune"], ngram=o["ngram"] == "on", calibrate=o["calibrate"] == "on")
    sampling = SamplingConfig(temperature=o["temperature"], top_p=o["top_p"], top_k=o["top_k"], seed=o["seed"])
    return runtime, offload, tree, sampling


def draft_of(o: dict) -> tuple[str, ...]:
    """The run's drafts as given: --draft (each); with --tree none, none; with a --target and no --draft, the
    target's twin (SELF_DRAFT: optional, dropped by the plan where it does not fit); with neither, the demo draft
    (resolve_models adds it)."""
    if o["policy"] == "none":
        return ()
    if not o["draft"] and o["target"] is not None:
        return (SELF_DRAFT,)
    return tuple(o["draft"])


def resolve_models(o: dict) -> tuple[str, tuple[str, ...]]:
    """(target, drafts): the embedded demo pair where no --target is given (with the demo target's twin beside
    its draft, optional: Models.plan keeps it where the target streams and the records say it is faster)."""
    if o["target"] is None:
        from offspec.formats.demo import ensure_demo_models
        target, draft = ensure_demo_models()
        if o["policy"] == "none":
            return str(target), ()
        return str(target), tuple(o["draft"]) or (str(draft), SELF_DRAFT)
    if not o["draft"] and o["policy"] != "none":
        click.echo("note: no --draft given: the target drafts for itself (--draft self) where its layers stream and "
                   "its twin fits beside them, else it runs alone (the report says which ran)", err=True)
    return o["target"], draft_of(o)


def open_from_options(o: dict, check_device: bool = True, need_draft: bool = False):
    """The model folders opened (configs, headers, tokenizer; no weights) and the configs: (models, configs).
    check_device False: the models run on Ray workers (build_configs). need_draft: a --target's default twin is
    not optional (bench compares it with plain decoding): where it does not fit, the plan refuses the run."""
    from offspec.engine.load import Models

    configs = build_configs(o, check_device)
    target, drafts = resolve_models(o)
    optional = not o["draft"] and not (need_draft and o["target"] is not None)
    return Models.open(target, drafts, optional_twin=optional, draft_quant=o["draft_quant"]), configs


def run_limits(o: dict, tree: TreeConfig, sampling: bool, longest: int, concurrency: Optional[int] = 1,
               prompts: Optional[int] = None) -> RunLimits:
    """--context auto: the longest sequence the run can make (prompt + new tokens, `longest`), one full tree
    and its root on top, so the last rounds still get whole trees; the plan caps it at the models' context.
    concurrency None (--concurrency auto): the memory plan's most, no more than the job's `prompts`."""
    context = parse_context(o["context"])
    if context is None:
        tree_room = tree.budget if tree.budget is not None else AUTO_MAX_TREE_BUDGET
        context = longest + (tree_room if tree.policy != "none" else 0) + 2
    return RunLimits(context=context, tree_budget=tree.budget, prefill_chunk=o["prefill_chunk"], sampling=sampling,
                     concurrency=concurrency, concurrency_cap=prompts)


def fail(message: str) -> NoReturn:
    """One line on stderr, exit 1."""
    click.echo(f"offspec: error: {' '.join(str(message).split())}", err=True)
    sys.exit(1)


def warn(message: str) -> None:
    """One line on stderr; the run goes on."""
    click.echo(f"offspec: warning: {' '.join(str(message).split())}", err=True)


def known_cause(err: BaseException) -> Optional[BaseException]:
    """The OffspecError or OSError behind `err` (itself, or what a worker-thread wrapper was raised from)."""
    seen = set()
    while err is not None and id(err) not in seen:
        if isinstance(err, (OffspecError, OSError)):
            return err
        seen.add(id(err))
        err = err.__cause__
    return None


# The options most runs set, listed first in the help of generate, batch and bench (by parameter name).
ESSENTIAL_OPTIONS = {"prompt_file", "output", "max_new_tokens", "new_tokens", "temperatures", "concurrency",
                     "json_path", "target", "draft", "device", "dtype", "offload", "target_quant", "policy",
                     "temperature", "seed"}


class GroupedCommand(click.Command):
    """A command whose --help lists its options in two sections: "Options" (ESSENTIAL_OPTIONS, the ones most
    runs set) and "Advanced options" (the rest), each in declaration order. Every option appears once."""

    def format_options(self, ctx, formatter):
        sections = {"Options": [], "Advanced options": []}
        help_option = self.get_help_option(ctx)
        for param in self.get_params(ctx):
            record = param.get_help_record(ctx)
            if record is not None and isinstance(param, click.Option):
                essential = param.name in ESSENTIAL_OPTIONS or param is help_option
                sections["Options" if essential else "Advanced options"].append(record)
        for title, records in sections.items():
            if records:
                with formatter.section(title):
                    formatter.write_dl(records)


def check_writable(path: str) -> None:
    """Fail before any model is loaded when the output cannot be written."""
    file = Path(path).expanduser()
    parent = file.resolve().parent
    if file.is_dir():
        raise InputError(f"cannot write {path}: it is a folder")
    if not parent.is_dir():
        raise InputError(f"cannot write {path}: folder {parent} does not exist")
    if not os.access(parent, os.W_OK) or (file.exists() and not os.access(file, os.W_OK)):
        raise InputError(f"cannot write {path}: permission denied")


def write_json(path: str, data: dict) -> None:
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "w") as f:
            json.dump(data, f, indent=2)
        os.replace(tmp, path)
    except OSError as e:
        raise InputError(f"cannot write {path}: {e}") from None


def write_report(path: str, data: dict, target, draft) -> None:
    """A command's --json report: `data` (its numbers) with which offspec, which models (target, draft: their
    folders, or None) and which settings (this command's options) made it: metrics.provenance."""
    from offspec.engine.metrics import provenance

    ctx = click.get_current_context()
    write_json(path, {**provenance(ctx.command_path, dict(ctx.params), *(None if m is None else str(m)
                                                                          for m in (target, draft))), **data})


def headers_checkpoint(name: str):
    """A model folder or hub id -> its checkpoint.Checkpoint from config and safetensors headers alone: a hub id
    not cached is planned from the hub's headers, its weights never downloaded (hub.resolve_headers)."""
    from offspec.formats.checkpoint import Checkpoint
    from offspec.formats.hub import resolve_headers
    from offspec.formats.open import open_checkpoint
    folder, headers = resolve_headers(name)
    return open_checkpoint(folder, headers_only=True) if headers is None else \
        Checkpoint(folder, headers_only=True, headers=headers)


def models_of(models) -> tuple:
    """The target and draft folders of a load.Models, for write_report."""
    return models.target.path, models.draft.path if models.draft is not None else None
