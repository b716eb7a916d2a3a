"""`offspec` command line: generate | batch | bench | models (demo, info, prepare).

Thin by design: options map one to one onto the config dataclasses; known failures (OffspecError, and OS
errors such as a full disk) become one line on stderr, `offspec: error: ...`, and exit code 1; Ctrl-C exits
with 130. Every command that loads models closes the engine (the streamer's threads) on the way out.
"""
from __future__ import annotations

import errno
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from typing import NoReturn, Optional

import click

from offspec.cli.model_info import Rates
from offspec.config import (
    AUTO_MAX_TREE_BUDGET,
    DEFAULT_PREFILL_CHUNK,
    OffloadConfig,
    RunLimits,
    RuntimeConfig,
    SamplingConfig,
    TreeConfig,
)
from offspec.engine.controller import MIN_JOIN_CHUNK, ONE_ROW_CPU_BUDGET, ROW_GAIN
from offspec.engine.request import check_max_new_tokens, check_text
from offspec.errors import BudgetError, InputError, OffspecError
from offspec.formats.quant import FUSED_MAX_ROWS
from offspec.plan.core import AUTO_CONCURRENCY, PINNED_FRACTION

POLICIES = ["dyspec", "heap", "chain", "static", "none"]
OFFLOAD_CHOICES = ["auto", "none", "cpu", "disk", "cpu+disk"]     # auto + plan.MODES
TARGET_QUANT_CHOICES = ["none", "int8", "nf4"]   # quant.TARGET_QUANTS (not imported here: keeps --help fast)
RESIDENT_QUANT_CHOICES = ["auto", "on", "off"]   # plan.RESIDENT_QUANTS
DRAFT_QUANT_CHOICES = ["auto", "none", "int8", "int8-held", "nf4"]   # auto + quant.QUANT_MODES


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
        click.option("--draft", type=click.Path(), default=None,
                     help="Draft model: a folder, a GGUF file or a hub id, like --target; same tokenizer as the target (embedding rows "
                          "may differ). Default: the embedded Qwen2.5-Coder-0.5B-Instruct "
                          "when --target is not given, else none (plain autoregressive)."),
        click.option("--draft-quant", type=click.Choice(DRAFT_QUANT_CHOICES), default="auto", show_default=True,
                     help="How the draft's matrices are held. int8 = beside each its int8 copy (one scale per row, "
                          "+50% draft memory), which a prompt's tokens in a draft call read when the call covers at most "
                          f"{FUSED_MAX_ROWS} of that prompt's tokens (its own count, never its batch's): such a call on a "
                          "CPU reads every weight, so reading half the bytes makes it faster (draft-call times: "
                          "docs/notes/2026-11-26-draft-int8-copy.md). int8-held / nf4 = held ONLY "
                          "quantized (per-row int8: 0.50x; bitsandbytes nf4: 0.28x of bf16; lm_head stays dense) to free "
                          "device memory for resident target layers: each call dequantizes a matrix at a time (slower on "
                          "a CPU; int8-held reads int8 directly where the copy would). Output is unchanged either way "
                          "(the target verifies every token), only acceptance may move slightly, and a prompt's tokens "
                          "do not depend on what shares its passes. auto = int8 on a CPU in bfloat16, none on a GPU (where "
                          "a draft call is latency-bound) and in float32 or float16 (where the int8 kernel is slower)."),
        click.option("--target-quant", type=click.Choice(TARGET_QUANT_CHOICES), default="none", show_default=True,
                     help="Store, pin, read and stream the target's decoder layers quantized (nf4, by bitsandbytes: "
                          "4.5 bits a weight, 0.28x the bf16 bytes; int8: symmetric, one scale a row, 0.50x) and "
                          "dequantize each "
                          "on the device right before it runs. This CHANGES the target: the output is exactly the "
                          "quantized target's (its greedy tokens, its distribution). Quantized once into a packed store "
                          "(as for --offload disk), reused while weights, dtype and quantization match."),
        click.option("--resident-quant", type=click.Choice(RESIDENT_QUANT_CHOICES), default="auto", show_default=True,
                     help="With --target-quant: hold the resident target layers (those --gpu-budget keeps on the device) "
                          "as their quantized blocks, 0.28x (nf4) / 0.50x (int8) of bf16 plus one dense scratch layer, "
                          "and dequantize each into the scratch right before it runs, every pass: about 2x (int8) / "
                          "3.5x (nf4) as many layers stay resident, so fewer stream; the price is a dequantization per "
                          "held layer per pass (its cost on a GPU and a CPU: "
                          "docs/notes/2026-11-23-held-quantized-layers-and-drafts.md). "
                          "auto = held only where that keeps more layers resident (never when all fit dense); off = "
                          "resident layers dequantized once, dense."),
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
        click.option("--store-dir", default=None, help="Disk-mode packed store folder. Default: under $OFFSPEC_HOME/stores."),
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
                     help="Disk offload reads: direct = O_DIRECT where the filesystem allows it (falls back to buffered "
                          "where it refuses, said in the report), several reads in flight; buffered = through the page "
                          "cache, each range dropped after it is read. `offspec doctor` measures both on your drive."),
        click.option("--no-overlap", is_flag=True,
                     help="Debug: copy each layer, then compute (no prefetch). Default: overlap."),
        click.option("--tree", "policy", type=click.Choice(POLICIES), default="dyspec", show_default=True,
                     help="Tree growth policy; none = plain autoregressive with the target alone."),
        click.option("--tree-budget", default="auto", show_default=True,
                     help="Max tree nodes per target pass, or 'auto' (chosen from measured draft and target times, "
                          f"up to {AUTO_MAX_TREE_BUDGET}; one prompt on a CPU whose target streams: "
                          f"{ONE_ROW_CPU_BUDGET} every round)."),
        click.option("--threshold", type=float, default=None,
                     help="DySpec threshold C. Default: adaptive (C set so the tree fills the budget)."),
        click.option("--max-depth", type=int, default=TreeConfig.max_depth, show_default=True, help="Deepest tree level."),
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
                     help="Rank tree nodes by the acceptance rates this run observes (by depth and draft probability), "
                          "not by raw draft probabilities. Output is unchanged either way. Off by default, like "
                          "--ngram (measured with it)."),
        click.option("--temperature", type=float, default=0.0, show_default=True, help="0 = greedy."),
        click.option("--top-p", type=float, default=1.0, show_default=True, help="Nucleus sampling mass (1 = off)."),
        click.option("--top-k", type=int, default=0, show_default=True, help="Keep the k most likely tokens (0 = off)."),
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
                             o["draft_quant"], o["target_quant"], o["resident_quant"])   # before any model is read
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
    if o["max_depth"] < 1 or o["branching"] < 1:
        raise InputError("--max-depth and --branching must be at least 1")
    tree = TreeConfig(policy=o["policy"], budget=parse_auto_count(o["tree_budget"], "--tree-budget", 0),
                      threshold=o["threshold"], max_depth=o["max_depth"], branching=o["branching"],
                      prune=not o["no_prune"], ngram=o["ngram"] == "on", calibrate=o["calibrate"] == "on")
    sampling = SamplingConfig(temperature=o["temperature"], top_p=o["top_p"], top_k=o["top_k"], seed=o["seed"])
    return runtime, offload, tree, sampling


def resolve_models(o: dict) -> tuple[str, Optional[str]]:
    if o["target"] is None:
        from offspec.formats.demo import ensure_demo_models
        target, draft = ensure_demo_models()
        return str(target), (o["draft"] or str(draft)) if o["policy"] != "none" else None
    if o["draft"] is None and o["policy"] != "none":
        click.echo("note: no --draft given; running the target alone (plain autoregressive)", err=True)
    return o["target"], (o["draft"] if o["policy"] != "none" else None)


def open_from_options(o: dict, check_device: bool = True):
    """The model folders opened (configs, headers, tokenizer; no weights) and the configs: (models, configs).
    check_device False: the models run on Ray workers (build_configs)."""
    from offspec.engine.load import Models

    configs = build_configs(o, check_device)
    target, draft = resolve_models(o)
    return Models.open(target, draft), configs


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


class OffspecGroup(click.Group):
    """Turns known failures into one line and exit 1; Ctrl-C into exit 130 without a traceback."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("\noffspec: interrupted", err=True)
            sys.exit(130)
        except click.exceptions.Exit:
            raise
        except Exception as e:
            cause = known_cause(e)
            if isinstance(cause, OSError) and cause.errno == errno.EPIPE:
                raise                       # click quiets a closed pipe (`offspec generate ... | head`) itself
            if isinstance(cause, OffspecError):
                fail(str(cause))
            if isinstance(cause, OSError):
                fail(f"{cause.strerror or cause}" + (f": {cause.filename}" if cause.filename else ""))
            torch = sys.modules.get("torch")
            if torch is not None and isinstance(e, torch.OutOfMemoryError):
                fail(f"out of device memory ({str(e).splitlines()[0]}); lower --gpu-budget or --tree-budget, "
                     "or offload the target (--offload cpu|disk)")
            raise


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


@click.group(cls=OffspecGroup)
@click.version_option(package_name="offspec")
def main():
    """offspec: run LLMs too big for one GPU, fast. The target's layers stream from host RAM or disk
    through the device; a resident draft grows token trees that one target pass verifies. Output is
    exactly the target's own (greedy), or has exactly its distribution (sampling)."""


@main.command(cls=GroupedCommand)
@click.argument("prompt", required=False)
@click.option("--prompt-file", type=click.Path(dir_okay=False), default=None,
              help="Read the prompt from this file ('-' = stdin). Default: the PROMPT argument, else stdin.")
@click.option("--raw", is_flag=True, help="Send the text as is, without the chat template.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True, help="Stop after this many tokens.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); generation ends before it. Default: none.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the full report (tokens, text, timings) to this JSON file. Default: none.")
@click.option("--quiet", is_flag=True, help="Print only the generated text (no report on stderr).")
@model_options
def generate(prompt, prompt_file, raw, max_new_tokens, stop, json_path, quiet, **o):
    """Generate text for PROMPT (or --prompt-file, or stdin)."""
    from offspec.engine.generate import GenerationRequest, run
    from offspec.engine.prompt import encode_prompt

    text = read_prompt(prompt, prompt_file)
    check_max_new_tokens(max_new_tokens, "--max-new-tokens")
    if json_path:
        check_writable(json_path)
    models, (runtime, offload, tree, sampling) = open_from_options(o)
    ids = encode_prompt(models.tokenizer, text, raw=raw)
    request = GenerationRequest(prompt_ids=tuple(ids), max_new_tokens=max_new_tokens, stop_strings=tuple(stop),
                                tree=tree, sampling=sampling)
    loaded = models.load(offload, runtime, run_limits(o, tree, not sampling.greedy, len(ids) + max_new_tokens))

    def on_text(delta):
        sys.stdout.write(delta)
        sys.stdout.flush()

    try:
        report, _ = run(loaded.engine, request, start=loaded.start, on_text=on_text)
    finally:
        loaded.engine.close()
    sys.stdout.write("\n")
    sys.stdout.flush()
    if not quiet:
        click.echo(report.summary(), err=True)
    if json_path:
        write_report(json_path, report.to_dict(), *models_of(models))


def read_prompt(prompt: Optional[str], prompt_file: Optional[str]) -> str:
    if prompt is not None and prompt_file is not None:
        raise InputError("give the prompt as an argument or with --prompt-file, not both")
    if prompt_file is not None:
        try:
            text = sys.stdin.read() if prompt_file == "-" else Path(prompt_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InputError(f"cannot read prompt file {prompt_file}: {e}") from None
    elif prompt is not None:
        text = prompt
    elif not sys.stdin.isatty():
        text = sys.stdin.read()
    else:
        raise InputError("no prompt: give one as an argument, with --prompt-file, or on stdin")
    check_text(text, where=prompt_file if prompt_file != "-" else None)
    return text


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
    from offspec.formats.checkpoint import Checkpoint, open_checkpoint
    from offspec.formats.hub import resolve_headers
    folder, headers = resolve_headers(name)
    return open_checkpoint(folder, headers_only=True) if headers is None else \
        Checkpoint(folder, headers_only=True, headers=headers)


def models_of(models) -> tuple:
    """The target and draft folders of a load.Models, for write_report."""
    return models.target.path, models.draft.path if models.draft is not None else None


def nothing_valid(message: str) -> None:
    """A job with nothing valid to run failed: one line, exit 2 (as when no prompt ran at all)."""
    click.echo(f"offspec: error: {message}", err=True)
    sys.exit(2)


# ------------------------------------------------------------------ batch
@main.command(cls=GroupedCommand)
@click.argument("prompt_file", type=click.Path(dir_okay=False))
@click.option("-o", "--output", "output", required=True, type=click.Path(dir_okay=False),
              help="Results, one JSON line per prompt in the order prompts finish; rerunning skips ids already there.")
@click.option("--max-new-tokens", type=int, default=256, show_default=True, help="Default per prompt.")
@click.option("--stop", multiple=True, help="Stop string (repeatable); generation ends before it. Default: none.")
@click.option("--raw", is_flag=True, help="Send prompts as is, without the chat template.")
@click.option("--strict", is_flag=True, help="Stop at the first malformed line instead of skipping it.")
@click.option("--concurrency", default="auto", show_default=True,
              help="Prompts in flight at once (in each worker): every target pass streams the layers once for all "
                   "of them (each with its own tree, KV-cache rows and randomness; outputs are the same as one at a "
                   f"time). auto = the most, up to {AUTO_CONCURRENCY}, that the memory plan fits, and of those only "
                   f"as many as the measured pass and draft costs say add at least {ROW_GAIN:.0%} to tokens/s "
                   "(finished prompts are then not all refilled); 1 = one at a time.")
@click.option("--workers", type=int, default=None,
              help="Run the job on Ray with this many workers, each with its own engine: one GPU each where the "
                   "cluster has GPUs, else --worker-cpus cores each. Needs Ray (pip install -e '.[ray]'). "
                   "Default: no Ray, one engine in this process.")
@click.option("--ray-address", default=None,
              help="With --workers: the Ray cluster to join ('auto' = the one `ray start` runs on this node, or "
                   "HOST:PORT / ray://HOST:PORT). Default: a local Ray started for the job and stopped after it.")
@click.option("--worker-cpus", type=int, default=1, show_default=True,
              help="With --workers: CPU cores each worker claims from Ray (and its torch threads).")
@click.option("--prefill-per-pass", default="auto", show_default=True,
              help="A prompt joining while others decode is fed at most this many tokens a pass, so a long prompt "
                   "does not stall their passes. auto = from measured pass times: a chunk costs the others at most "
                   f"one more pass's fixed cost, and is at least {MIN_JOIN_CHUNK} tokens (whole prompts at once when "
                   "passes are transfer-bound).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the job's totals (tokens/s, passes, prompts per pass, GB per token; per worker with "
                   "--workers) here. Default: none.")
@model_options
def batch(prompt_file, output, max_new_tokens, stop, raw, strict, concurrency, prefill_per_pass, workers,
          ray_address, worker_cpus, json_path, **o):
    """Run every prompt of PROMPT_FILE (.txt: one per line; .jsonl: {id, prompt | messages, max_new_tokens?},
    or OpenAI batch lines {custom_id, body: {messages, max_tokens, temperature, top_p, stop, seed}}, whose
    results are in OpenAI's batch output shape).

    --concurrency prompts are in flight at once, sharing every target pass; each prompt's output is what it
    would be alone. Each finished prompt is one complete line in OUTPUT; Ctrl-C (exit 130) or a kill loses
    no finished line, and rerunning the same command continues where it stopped. --workers N shards the job
    over N Ray workers (docs/cluster.md); this process stays the only writer of OUTPUT."""
    from tqdm import tqdm

    from offspec.engine.generate import GenerationRequest
    from offspec.engine.prompt import encode_prompt
    from offspec.jobs.cluster import RaySetup, engines_on_ray, import_ray
    from offspec.jobs.prompt_files import ResultFile, read_prompt_file
    from offspec.jobs.runner import BatchRun, engine_here, write_results

    check_max_new_tokens(max_new_tokens, "--max-new-tokens")
    concurrency = parse_auto_count(concurrency, "--concurrency", 1)
    prefill_per_pass = parse_auto_count(prefill_per_pass, "--prefill-per-pass", 1)
    ray = None
    if workers is None:
        if ray_address is not None:
            raise InputError("--ray-address needs --workers")
    else:
        if workers < 1 or worker_cpus < 1:
            raise InputError("--workers and --worker-cpus must be at least 1")
        ray = import_ray()
    if json_path:
        check_writable(json_path)
    items, bad = read_prompt_file(prompt_file)
    for b in bad:
        if strict:
            raise InputError(f"{prompt_file}: {b}")
        click.echo(f"offspec: skipping {prompt_file} {b}", err=True)
    if not items:
        nothing_valid(f"{prompt_file}: no valid prompt found (all {len(bad)} lines were skipped)")
    results = ResultFile(output)
    try:
        todo = [it for it in items if it.id not in results.done]
        if len(todo) < len(items):
            click.echo(f"resuming: {len(items) - len(todo)} of {len(items)} prompts already in {output}", err=True)
        if not todo:
            click.echo("nothing to do", err=True)
            return
        models, (runtime, offload, tree, sampling) = open_from_options(o, check_device=workers is None)
        failed = 0

        def skip(item, e) -> str:
            """The line for a prompt that cannot run; with --strict the job stops there instead."""
            nonlocal failed
            if strict:
                raise InputError(f"{prompt_file} line {item.line}: {e}") from None
            failed += 1
            return f"offspec: skipping {prompt_file} line {item.line} (id {item.id}): {e}"

        # Every prompt is tokenized before loading: the longest one sizes the KV caches (--context auto).
        requests = []
        for item in todo:
            try:
                ids = encode_prompt(models.tokenizer, item.prompt, raw=raw)
                requests.append((item, GenerationRequest(prompt_ids=tuple(ids), stop_strings=item.stop_strings(stop),
                                                         max_new_tokens=item.max_new_tokens or max_new_tokens,
                                                         tree=tree, sampling=item.sampling(sampling))))
            except InputError as e:
                click.echo(skip(item, e), err=True)
        if not requests:
            nothing_valid(f"{prompt_file}: no prompt could be encoded ({failed} skipped)")
        longest = max(len(r.prompt_ids) + r.max_new_tokens for _, r in requests)
        samples = any(not r.sampling.greedy for _, r in requests)     # an OpenAI line may set its own temperature
        limits = run_limits(o, tree, samples, longest, concurrency, prompts=len(requests))
        run = BatchRun(models, offload, runtime, limits, prefill_per_pass, [r for _, r in requests])
        if ray is None:
            source = engine_here(run)
        else:
            setup = RaySetup(workers, worker_cpus, ray_address, device=o["device"] if device_given() else None,
                             draft_quant=o["draft_quant"], target=o["target"], draft=o["draft"])
            source = engines_on_ray(run, setup, ray, notify=lambda text: tqdm.write(f"offspec: {text}", file=sys.stderr))
        with source as running:
            if running.where:
                click.echo(running.where, err=True)
            try:
                write_results(running, requests, results, skip)
            except KeyboardInterrupt:
                click.echo(f"\noffspec: interrupted; finished prompts are saved in {output}; rerun to resume", err=True)
                sys.exit(130)
        job = running.report
    finally:
        results.close()
    job.skipped = len(bad) + failed
    click.echo(f"{job.summary()}; results in {output}", err=True)
    if job.passes:
        click.echo(job.pass_line(), err=True)
    for worker in job.workers:
        click.echo(f"  {worker.line()}", err=True)
    if json_path:
        write_report(json_path, job.to_dict(), *models_of(models))
    if failed or bad:
        sys.exit(2 if job.prompts == 0 else 0)


# ------------------------------------------------------------------ serve
SERVE_CONTEXT = 4096      # --context auto for a server: tokens a request may reach (capped at the models' context)
LOOPBACK = ("127.0.0.1", "localhost", "::1")


@main.command(cls=GroupedCommand)
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on. Another than this machine's loopback needs --api-key (or --no-key-ok).")
@click.option("--port", type=int, default=8000, show_default=True, help="TCP port.")
@click.option("--api-key", envvar="OFFSPEC_API_KEY", default=None,
              help="Require `Authorization: Bearer KEY` on every route but /health. Default: $OFFSPEC_API_KEY, else "
                   "none.")
@click.option("--no-key-ok", is_flag=True, help="Listen on a non-loopback --host without an API key (anyone who "
              "reaches the port can use the model).")
@click.option("--model-name", default=None, help="The model name clients send and /v1/models lists. Default: the "
              "target's folder or file name.")
@click.option("--concurrency", default="auto", show_default=True,
              help=f"Requests in flight at once, sharing every target pass (each with its own tree, KV-cache rows "
                   f"and randomness; each answer is what it would be alone). auto = the most, up to "
                   f"{AUTO_CONCURRENCY}, that the memory plan fits.")
@click.option("--max-waiting", type=int, default=64, show_default=True,
              help="Requests that may wait for a free row; one more is answered 429 with Retry-After.")
@click.option("--max-tokens", type=int, default=2048, show_default=True,
              help="The most new tokens a request may ask for (max_tokens), and what one that asks for none gets "
                   "(both capped by the context).")
@model_options
def serve(host, port, api_key, no_key_ok, model_name, concurrency, max_waiting, max_tokens, **o):
    """Serve the target (with its draft) over the OpenAI HTTP API: POST /v1/chat/completions and /v1/completions
    (streaming or not), GET /v1/models and /health. Requests in flight share every target pass; a request waits for a
    free row at most --max-waiting deep. Needs the serve extra: pip install -e ".[serve]". Supported fields and
    errors: docs/serving.md."""
    if api_key is not None and not api_key.strip():
        raise InputError("--api-key (or $OFFSPEC_API_KEY) is empty: give a key, or leave it out")
    if host not in LOOPBACK and api_key is None and not no_key_ok:
        raise InputError(f"--host {host} listens beyond this machine: give --api-key (or $OFFSPEC_API_KEY), or "
                         f"--no-key-ok to let anyone who reaches port {port} use the model")
    if max_waiting < 0 or max_tokens < 1:
        raise InputError("--max-waiting must be at least 0 and --max-tokens at least 1")
    check_max_new_tokens(max_tokens, "--max-tokens")
    import importlib.util
    missing = [m for m in ("fastapi", "uvicorn") if importlib.util.find_spec(m) is None]
    if missing:
        raise InputError(f"offspec serve needs FastAPI and uvicorn ({', '.join(missing)} missing): "
                         f'pip install -e ".[serve]"')
    import uvicorn

    from offspec.serve.app import EngineService, ServeConfig, make_app

    concurrency = parse_auto_count(concurrency, "--concurrency", 1)
    if o["context"] == "auto":
        o = {**o, "context": str(SERVE_CONTEXT)}
    models, (runtime, offload, tree, sampling) = open_from_options(o)
    limits = run_limits(o, tree, True, SERVE_CONTEXT, concurrency, prompts=None)
    loaded = models.load(offload, runtime, limits)
    service = EngineService(loaded.engine, loaded.plan.concurrency, max_waiting)
    name = model_name or Path(str(models.target.path)).name
    cfg = ServeConfig(model=name, tree=tree, sampling=sampling, max_tokens=min(max_tokens, loaded.plan.context - 2),
                      max_waiting=max_waiting, context=loaded.plan.context, api_key=api_key)
    shown = f"[{host}]" if ":" in host else host
    click.echo(f"offspec: serving {name} at http://{shown}:{port}/v1 ({loaded.plan.concurrency} requests in flight, "
               f"context {loaded.plan.context} tokens; {loaded.plan.layers_line()})", err=True)
    try:
        uvicorn.run(make_app(service, cfg, models.tokenizer), host=host, port=port, log_level="warning")
    finally:
        service.close()


def device_given() -> bool:
    """--device was given on the command line (else its default: this machine's, which a Ray worker's is not)."""
    return click.get_current_context().get_parameter_source("device") != click.core.ParameterSource.DEFAULT


# ------------------------------------------------------------------ bench
@main.command(cls=GroupedCommand)
@click.argument("prompt_file", type=click.Path(dir_okay=False))
@click.option("--systems", default="default,none", show_default=True,
              help="Comma-separated systems, all on one loaded engine: default (the tree options given), none "
                   "(plain autoregressive), or <policy>-<N>, a policy at a fixed budget of N nodes (chain-8, "
                   "dyspec-16: the ablations a default is judged against). Speedups are over none.")
@click.option("--prompt-tokens", type=int, default=128, show_default=True, help="Cut each prompt to this many tokens.")
@click.option("--new-tokens", type=int, default=128, show_default=True, help="Tokens generated per prompt (EOS ignored).")
@click.option("--temperatures", default="0,0.6", show_default=True, help="Comma-separated temperatures to run.")
@click.option("--repeats", type=int, default=1, show_default=True,
              help="Timed runs per system and prompt, in an order drawn per prompt and repeat; a prompt's s/token is "
                   "their median.")
@click.option("--limit", type=int, default=None, help="Use only the first N prompts. Default: all.")
@click.option("--rows", "rows_path", type=click.Path(dir_okay=False), default=None,
              help="Append each prompt's row to this JSONL file as it is measured; a rerun with the same options "
                   "measures only the (prompt, temperature) rows it lacks and summarizes those of its prompts, "
                   "temperatures and systems (rows measured with other options stop it). Default: none.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the summary and every row to this JSON file. Default: none.")
@model_options
def bench(prompt_file, systems, prompt_tokens, new_tokens, temperatures, repeats, limit, rows_path, json_path, **o):
    """Systems measured side by side on one engine, loaded as generate loads it: the same prompts, a fixed
    number of new tokens (EOS ignored, the Sequoia/DySpec protocol), interleaved per prompt, with medians and
    bootstrap 95% intervals over prompts. A system's s/token is its wall time over its tokens, prefill included."""
    from offspec.bench import runner as b

    temps, names = check_bench_options(systems, prompt_tokens, new_tokens, temperatures, repeats, limit, o)
    for path in (rows_path, json_path):
        if path:
            check_writable(path)
    b.check_appendable(rows_path)
    items = read_bench_prompts(prompt_file, limit)
    models, (runtime, offload, tree, sampling) = open_from_options(o)
    trees = {name: b.system_tree(name, tree) for name in names}
    prompts = b.bench_prompts(models.tokenizer, items, prompt_tokens)
    settings = json.loads(json.dumps({
        "prompt_tokens": prompt_tokens, "new_tokens": new_tokens, "repeats": repeats, "tree": vars(tree),
        "models": [str(p) for p in models_of(models)], "device": str(runtime.device), "dtype": o["dtype"],
        "offload": o["offload"], "target_quant": o["target_quant"], "draft_quant": o["draft_quant"]}))
    rows = b.resumed_rows(rows_path, prompts, trees, temps, sampling.seed, settings, warn)
    if len(rows) < len(prompts) * len(temps):
        longest = max(len(ids) for _, ids in prompts) + new_tokens
        limits = b.bench_limits(trees.values(), longest, any(t > 0 for t in temps))
        limits = replace(limits, context=parse_context(o["context"]) or limits.context,
                         prefill_chunk=o["prefill_chunk"])
        loaded = models.load(offload, runtime, limits)
        setup = {"settings": settings, "plan": {"offload": loaded.plan.mode, "target_quant": loaded.plan.target_quant,
                                                "draft_quant": runtime.draft_quant}}
        try:
            rows += measure_bench(loaded.engine, prompts, trees, sampling, temps, new_tokens, repeats,
                                  {b.row_key(r) for r in rows}, rows_path, setup)
        finally:
            loaded.engine.close()
    report = []
    for t in temps:
        summary = b.summarize([r for r in rows if r["temperature"] == t])
        click.echo(f"temperature {t:g}:\n{b.format_table(summary)}")
        report += [{"temperature": t, **s} for s in summary]
    if json_path:
        write_report(json_path, {"summary": report, "rows": rows}, *models_of(models))


def check_bench_options(systems, prompt_tokens, new_tokens, temperatures, repeats, limit, o) -> tuple[list, list]:
    """(temperatures, system names) checked before any model is opened."""
    from offspec.bench import runner as b

    temps = b.parse_temperatures(temperatures)
    if prompt_tokens < 1 or new_tokens < 1 or repeats < 1:
        raise InputError("--prompt-tokens, --new-tokens and --repeats must be at least 1")
    if limit is not None and limit < 1:
        raise InputError("--limit must be at least 1")
    names = list(dict.fromkeys(x.strip() for x in systems.split(",") if x.strip()))
    for name in names:
        b.system_tree(name, TreeConfig())       # an unknown name fails here
    if b.PLAIN not in names or len(names) < 2:
        raise InputError(f"--systems must name {b.PLAIN} (the speedups' reference) and at least one other system")
    if o["policy"] == "none":
        raise InputError("bench compares against a tree policy; choose one with --tree")
    if o["target"] is not None and o["draft"] is None:
        raise InputError("bench compares plain and speculative decoding: give a --draft for the --target")
    return temps, names


def read_bench_prompts(prompt_file: str, limit: Optional[int]):
    from offspec.jobs.prompt_files import read_prompt_file

    items, bad = read_prompt_file(prompt_file)
    for line in bad:
        click.echo(f"offspec: skipping {prompt_file} {line}", err=True)
    if not items:
        raise InputError(f"{prompt_file}: no usable prompts")
    return items[:limit] if limit else items


def measure_bench(engine, prompts, trees: dict, sampling, temps, new_tokens: int, repeats: int, done: set,
                  rows_path: Optional[str], setup: dict) -> list[dict]:
    """The rows `done` lacks, each printed (and appended to rows_path) as it is made."""
    from offspec.bench import runner as b

    def on_row(row):
        if rows_path:
            b.append_row(rows_path, row)
        click.echo(f"T={row['temperature']:g} {row['id']}: " + ", ".join(
            f"{name} {cell['seconds_per_token']:.4f} s/token, {cell['tokens_per_pass']:.2f} tokens/pass"
            for name, cell in row["systems"].items()), err=True)

    rows = []
    for t in temps:
        s = replace(sampling, temperature=t)
        runners = {name: b.offspec_runner(engine, tree, s, ignore_eos=True) for name, tree in trees.items()}
        rows += b.measure(prompts, runners, new_tokens, temperature=t, seeds=(None,) if t == 0 else (sampling.seed,),
                          repeats=repeats, done=done, on_row=on_row, extra=setup)
    return rows


# ------------------------------------------------------------------ doctor
@main.command()
@click.option("--target", type=click.Path(), default=None,
              help="Target model folder (or hub id) to plan and advise for. Default: the embedded demo target when "
                   "it is prepared (`offspec models demo`), else none.")
@click.option("--draft", type=click.Path(), default=None,
              help="Draft model folder. Default: the demo draft with the demo target, else none.")
@click.option("--device", default=default_device, show_default="cuda if available, else cpu",
              help="Compute device to check.")
@click.option("--store-dir", default=None,
              help="Folder whose drive is measured. Default: the target's packed store if built, else "
                   "$OFFSPEC_HOME/stores.")
@click.option("--quick", is_flag=True, help="Smaller probes: seconds rather than a minute.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Write the full report to this JSON file. Default: none.")
def doctor(target, draft, device, store_dir, quick, json_path):
    """Check this machine for offspec: devices and free memory, host memory and its cgroup limit, the largest
    pinned buffer, host-to-device bandwidth (pinned and pageable), the cold read rate of the store's drive, and
    the flags to run a target with (from the memory plan and the measured rates)."""
    from offspec.cli.doctor import check, summary
    from offspec.engine.load import parse_device
    from offspec.formats.demo import DEFAULT_DRAFT, DEFAULT_TARGET, demo_model_dir, is_complete

    if json_path:
        check_writable(json_path)
    dev = parse_device(device)
    if target is None and is_complete(demo_model_dir(DEFAULT_TARGET)):
        target = str(demo_model_dir(DEFAULT_TARGET))
        if draft is None and is_complete(demo_model_dir(DEFAULT_DRAFT)):
            draft = str(demo_model_dir(DEFAULT_DRAFT))
    try:                           # a hub id: planned from its headers, no weights fetched
        checkpoints, unreadable = [headers_checkpoint(m) if m else None for m in (target, draft)], None
    except OffspecError as err:    # the machine's checks still run; the advice says why there is none
        checkpoints, unreadable = [None, None], str(err)
    report = check(*checkpoints, dev, store_dir, quick, progress=lambda line: click.echo(line, err=True))
    if unreadable:
        report["advice"] = {"status": "failed", "error": unreadable}
    report.update(target=target, draft=draft)
    click.echo(summary(report))
    if json_path:
        write_report(json_path, report, target, draft)
    failed = [name for name, section in report.items() if isinstance(section, dict) and section.get("status") == "failed"]
    if failed:
        click.echo(f"offspec: doctor: {', '.join(failed)} failed (details in the report)", err=True)
        sys.exit(1)


# ------------------------------------------------------------------ models
@main.group()
def models():
    """Prepare and inspect model folders."""


@models.command("demo")
@click.option("--gguf", is_flag=True, help="Print the models' GGUF files instead (their parts joined once), which "
              "--target and --draft take as they are.")
def models_demo(gguf):
    """Prepare the embedded default models (join the GGUF parts, convert once) and print their folders."""
    from offspec.formats.demo import DEFAULT_DRAFT, DEFAULT_TARGET, ensure_demo_gguf, ensure_demo_models
    target, draft = (ensure_demo_gguf(DEFAULT_TARGET), ensure_demo_gguf(DEFAULT_DRAFT)) if gguf else \
        ensure_demo_models()
    click.echo(f"target: {target}")
    click.echo(f"draft:  {draft}")


@models.command("info")
@click.argument("model_dir", type=click.Path())
@click.option("--draft", "draft_dir", type=click.Path(), default=None,
              help="Draft model folder, GGUF file or hub id (as MODEL_DIR) to plan beside the target. Default: none.")
@click.option("--device-memory", default=None,
              help="Plan for a GPU with this much free memory (e.g. 24GB), present or not. Default: this machine's "
                   "GPU (its free memory now), or this CPU.")
@click.option("--host-memory", default=None,
              help="Plan for this much usable host RAM (e.g. 64GB). Default: this machine's min(MemAvailable, cgroup limit).")
@click.option("--dtype", default="bfloat16", show_default=True, help="Weight and compute dtype of the run.")
@click.option("--offload", type=click.Choice(OFFLOAD_CHOICES), default="auto", show_default=True,
              help="Offload mode to plan (auto: as generate would choose).")
@click.option("--gpu-budget", default=None,
              help="As for generate: device bytes for the target's layers. Default: what the plan leaves.")
@click.option("--host-budget", default=None,
              help=f"As for generate: host bytes that may be pinned. Default: {PINNED_FRACTION:.0%} of the host memory.")
@click.option("--slots", "n_slots", type=int, default=2, show_default=True,
              help="Streaming ring slots, in layers (a split ring: this many layers' parts).")
@click.option("--context", default="4096", show_default=True,
              help="Tokens per sequence the KV caches hold (capped at the models' context), or 'auto' = the models' context.")
@click.option("--tree-budget", default="auto", show_default=True, help=f"Largest tree per pass, or auto (up to {AUTO_MAX_TREE_BUDGET}).")
@click.option("--prefill-chunk", type=int, default=DEFAULT_PREFILL_CHUNK, show_default=True,
              help="Rows each layer processes at a time.")
@click.option("--draft-quant", type=click.Choice(DRAFT_QUANT_CHOICES), default="auto", show_default=True,
              help="As for generate (auto: int8 when planning for this CPU in bfloat16, none for a GPU).")
@click.option("--target-quant", type=click.Choice(TARGET_QUANT_CHOICES), default="none", show_default=True,
              help="As for generate: plan the target's layers stored and streamed quantized (int8 or nf4).")
@click.option("--resident-quant", type=click.Choice(RESIDENT_QUANT_CHOICES), default="auto", show_default=True,
              help="As for generate: with --target-quant, resident layers held quantized (+ one dense scratch layer) "
                   "where that keeps more of them on the device.")
@click.option("--tokens-per-pass", type=float, default=Rates.tokens_per_pass, show_default=True,
              help="For the PREDICTED s/token: tokens one target pass yields (measured values: "
                   "docs/benchmarks.md, \"Tokens per target pass vs tree budget\").")
@click.option("--link-gbps", type=float, default=Rates.link_gbps, show_default=True,
              help="Host-to-device bandwidth in GB/s for the predicted pass time (PCIe 4.0 x16 pinned ≈ 24).")
@click.option("--disk-gbps", type=float, default=Rates.disk_gbps, show_default=True,
              help="Read rate of the disk store's drive in GB/s for disk offload (a PCIe 4.0 NVMe ≈ 3–7).")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the plan as JSON. Default: none.")
def models_info(model_dir, draft_dir, device_memory, host_memory, dtype, offload, gpu_budget, host_budget, n_slots,
                context, tree_budget, prefill_chunk, draft_quant, target_quant, resident_quant, tokens_per_pass, link_gbps,
                disk_gbps, json_path):
    """The model(s), and the memory plan of a run on a given machine: where every layer lives, what the
    device and host hold, the predicted pass time; for a GPU, every target quantization and offload mode
    planned side by side, the one auto uses and the fastest marked. Reads config.json and the safetensors
    headers (or a GGUF file's header) only, so the weights need not be here (plan a 70B on a 24 GB GPU from its
    headers).

    MODEL_DIR: a model folder, a GGUF file, or a hub id (owner/name): from the local Hugging Face cache when it
    holds the model, else its config, tokenizer and safetensors headers are read from the hub, never its
    weights."""
    import torch

    from offspec.cli.model_info import machine_for, model_info
    from offspec.engine.load import parse_dtype
    from offspec.formats.quant import auto_draft_quant
    from offspec.plan.core import ModelSpec, make_plan
    from offspec.plan.options import compare

    if json_path:
        check_writable(json_path)
    if prefill_chunk < 1:
        raise InputError("--prefill-chunk must be at least 1")
    if tokens_per_pass < 1:
        raise InputError("--tokens-per-pass must be at least 1 (every pass yields its bonus token)")
    target = headers_checkpoint(model_dir)
    draft = headers_checkpoint(draft_dir) if draft_dir else None
    dt = parse_dtype(dtype)
    machine = machine_for(parse_bytes(device_memory), parse_bytes(host_memory))
    runtime = RuntimeConfig(device=torch.device("cpu"), dtype=dt, target_quant=target_quant, resident_quant=resident_quant,
                            draft_quant=auto_draft_quant(machine.kind, dt) if draft_quant == "auto" else draft_quant)
    specs = (ModelSpec.of(target), ModelSpec.of(draft) if draft else None)
    offload_config = OffloadConfig(mode=offload, gpu_budget=parse_bytes(gpu_budget), n_slots=n_slots,
                                   host_budget=parse_bytes(host_budget))
    limits = RunLimits(context=parse_context(context), tree_budget=parse_auto_count(tree_budget, "--tree-budget", 0),
                       prefill_chunk=prefill_chunk)
    # On a GPU, every quantization and offload mode is planned too: the fastest is named beside auto's choice.
    options = (compare(*specs, offload_config, runtime, limits, machine, link_gbps, disk_gbps)
               if machine.kind == "cuda" else None)
    try:
        plan = (options.auto.plan if options is not None and options.auto is not None else
                make_plan(*specs, offload_config, runtime, limits, machine))     # (refused: says why in one line)
    except BudgetError:
        if options is not None and options.options:
            click.echo(options.table(), err=True)     # what would fit, before the one line that says why not
        raise
    click.echo(model_info(target, draft, plan, dt, Rates(tokens_per_pass, link_gbps, disk_gbps)))
    if options is not None:
        click.echo(options.table())
    if json_path:
        write_report(json_path, {**plan.to_dict(), **({"compared": options.to_dict()} if options is not None else {})},
                     target.path, draft.path if draft is not None else None)


@models.command("prepare")
@click.argument("model_dir", type=click.Path())
@click.option("--dtype", default="bfloat16", show_default=True, help="Dtype of the packed layers.")
@click.option("--target-quant", type=click.Choice(TARGET_QUANT_CHOICES), default="none", show_default=True,
              help="Quantize the layers into the store (as generate --target-quant uses them).")
@click.option("--store-dir", default=None, help="Where to write the store (pass the same --store-dir to "
              "generate --offload disk). Default: under $OFFSPEC_HOME/stores.")
def models_prepare(model_dir, dtype, target_quant, store_dir):
    """Build the packed disk store (one aligned block per layer) used by --offload disk.

    MODEL_DIR: a model folder, a GGUF file, or a hub id (owner/name) from the local Hugging Face cache, as --target
    takes."""
    import torch

    from offspec.config import RuntimeConfig
    from offspec.engine.load import parse_dtype, store_dir_for
    from offspec.formats.checkpoint import open_checkpoint
    from offspec.formats.demo import offspec_home
    from offspec.formats.hub import resolve_model
    from offspec.formats.quant import check_target_quant, target_layout
    from offspec.plan.core import ModelSpec, published_runtime
    from offspec.stream.stores import prepare_disk_store
    ckpt = open_checkpoint(resolve_model(model_dir))
    dt = parse_dtype(dtype)
    # A published checkpoint's store holds its layers as published (its own quantization, no flag).
    target_quant = published_runtime(ModelSpec.of(ckpt), RuntimeConfig(torch.device("cpu"), dt,
                                                                        target_quant=target_quant)).target_quant
    check_target_quant(target_quant, torch.device("cpu"), dt)    # the store is quantized on this CPU
    target = Path(store_dir) if store_dir else store_dir_for(ckpt, dt, offspec_home(), target_quant)
    prepare_disk_store(ckpt.layer_tensors, ckpt.config.n_layers, target_layout(ckpt.config, dt, target_quant),
                       str(target), progress=True, source_id=ckpt.fingerprint())
    click.echo(str(target))


if __name__ == "__main__":
    main()
