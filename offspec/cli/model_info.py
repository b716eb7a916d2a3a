"""`offspec models info`: a model's shapes and the memory plan of a run, with the predicted pass time.

    machine_for(device_bytes, host_bytes)          the machine to plan for: sizes given, else this one
    rates_for(...)                                 the PREDICTED lines' card, link and drive, and their sources
    model_info(target, draft, plan, dtype, rates)  the report's lines: model, layer sizes, plan, PREDICTED times
    twin_line(target, offload, runtime, ...)       whether --draft self would fit, and what it would hold
    draft_vocab_mismatch(target, draft)            why the draft cannot speculate for the target (a WARNING line)

Reads config.json and the safetensors headers only (checkpoint.Checkpoint(..., headers_only=True)): a plan can be
made for weights and machines that are not here. The PREDICTED lines take their rates as given (`offspec doctor`
measures the link and the drive; docs/benchmarks.md has measured tokens per pass).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from offspec.config import OffloadConfig, RunLimits, RuntimeConfig
from offspec.errors import BudgetError
from offspec.formats.gguf_blocks import is_gguf
from offspec.formats.published import describe as describe_quant
from offspec.formats.published import short as short_quant
from offspec.plan.costmodel import DEQUANT, DISK_GBPS, GpuSpec, gpu_keys
from offspec.plan.costmodel import LINK_GB_PER_S as LINK_GBPS
from offspec.plan.machine import Machine
from offspec.plan.memory import MemoryPlan
from offspec.plan.passtime import predicted_pass_seconds, streamed_dequant_seconds
from offspec.plan.sizes import ModelSpec


@dataclass(frozen=True)
class Rates:
    """What the PREDICTED lines assume, and where each figure comes from."""
    tokens_per_pass: float = 8.0    # tokens one target pass yields (the bonus token included, so >= 1)
    link_gbps: float = LINK_GBPS    # host-to-device GB/s of the streamed layers' copies (PCIe 4.0 x16, pinned)
    disk_gbps: float = DISK_GBPS    # read GB/s of the disk store's drive, for disk offload
    card: Optional[GpuSpec] = None  # the card predicted for (None: the measured H100's and H200's own figures)
    link_source: str = "assumed"    # "given", "measured by offspec doctor ...", "assumed", the card's slot
    disk_source: str = "assumed"

    def describe(self) -> str:
        """The 'PREDICTED for:' line's text."""
        card = (f"{self.card.name} ({self.card.bandwidth_gb_per_s:g} GB/s, {self.card.bf16_tflops:g} bf16 TFLOPS: "
                f"dequantization scaled from {DEQUANT.device}'s by memory bandwidth)" if self.card else
                f"the measured cards themselves (dequantization as on {DEQUANT.device}; --gpu NAME predicts for "
                f"one of {gpu_keys()})")
        return (f"{card}; link {self.link_gbps:g} GB/s ({self.link_source}), drive {self.disk_gbps:g} GB/s "
                f"({self.disk_source})")


SAVED_RATES = "measured_rates.json"     # under offspec_home(): what `offspec doctor` last measured here


def save_rates(report: dict) -> None:
    """Keep what a doctor report measured on this machine for later predictions: the pinned link (on CUDA) and
    the drive's cold read rate, each where its section succeeded."""
    import json
    import time

    from offspec.formats.demo import offspec_home
    saved = {"measured": time.strftime("%Y-%m-%d"), "device": report.get("device")}
    link, drive = report.get("link", {}), report.get("drive", {})
    if link.get("status") == "ok" and link.get("pinned_gbps"):
        saved["link_gbps"] = round(link["pinned_gbps"], 1)
    rate = drive.get("read_gbps") or max(drive.get("direct_gbps") or 0, drive.get("buffered_gbps") or 0)
    if drive.get("status") == "ok" and rate:
        saved["disk_gbps"], saved["disk_folder"] = round(rate, 2), drive.get("folder")
    path = offspec_home() / SAVED_RATES
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(saved, indent=1) + "\n")


def saved_rates() -> dict:
    """What save_rates kept ({} when doctor has not run here, or its file is unreadable)."""
    import json

    from offspec.formats.demo import offspec_home
    try:
        saved = json.loads((offspec_home() / SAVED_RATES).read_text())
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def rates_for(tokens_per_pass: float, link_gbps: Optional[float], disk_gbps: Optional[float], gpu: Optional[str],
              planning_here: bool, saved: dict) -> Rates:
    """The PREDICTED lines' rates: each given one; else, when the plan is for this machine itself (planning_here,
    no --gpu), what `offspec doctor` measured here (saved: its saved rates); else the card's slot, or the assumed
    ones. gpu: a card of costmodel.GPUS (--gpu); None: this machine's card where offspec knows it."""
    from offspec.errors import InputError
    from offspec.plan.costmodel import find_gpu
    card = find_gpu(gpu) if gpu else None
    if gpu and card is None:
        raise InputError(f"--gpu {gpu}: not a card offspec has figures for (one of {gpu_keys()})")
    here = planning_here and not gpu
    if here and torch.cuda.is_available():
        card = find_gpu(torch.cuda.get_device_name())
    saved = saved if here else {}
    doctor = f"measured by offspec doctor, {saved.get('measured', '?')}"
    if link_gbps is not None:
        link, link_source = link_gbps, "given"
    elif saved.get("link_gbps"):
        link, link_source = saved["link_gbps"], doctor
    elif card is not None:
        link, link_source = card.link_gb_per_s, f"assumed: the {card.name}'s slot"
    else:
        link, link_source = LINK_GBPS, "assumed: PCIe 4.0 x16"
    if disk_gbps is not None:
        disk, disk_source = disk_gbps, "given"
    elif saved.get("disk_gbps"):
        disk, disk_source = saved["disk_gbps"], doctor
    else:
        disk, disk_source = DISK_GBPS, "assumed: `offspec doctor` measures yours"
    return Rates(tokens_per_pass, link, disk, card, link_source, disk_source)


def machine_for(device_bytes: Optional[int], host_bytes: Optional[int]) -> Machine:
    """The machine a plan is made for: a GPU of device_bytes (present or not) when given; else this machine's GPU
    (its free memory now), or this CPU. host_bytes: the usable host RAM; None = this machine's."""
    if device_bytes is not None or not torch.cuda.is_available():
        return Machine.given(device_bytes, host_bytes)
    measured = Machine.measure(torch.device("cuda"))
    if host_bytes is None:
        return measured
    return Machine("cuda", measured.device_bytes, host_bytes, "given", measured.name)


def draft_vocab_mismatch(target, draft) -> Optional[str]:
    """Why `draft` cannot speculate for `target` (checkpoint.Checkpoints), else None: where both folders hold
    tokenizer files, the checks a run makes (vocab.check_same_tokenizer, each model's rows covering its own
    tokenizer); else, from the headers alone, their embedding row counts (vocab.rows_mismatch)."""
    from offspec.errors import CheckpointError
    from offspec.formats.hub import model_name
    from offspec.formats.open import load_tokenizer
    from offspec.model.vocab import check_rows_cover_tokenizer, check_same_tokenizer, rows_mismatch, token_id_count

    if not all(c.has_tokenizer for c in (target, draft)):
        return rows_mismatch(target.config.vocab_size, draft.config.vocab_size)
    try:
        target_tok, draft_tok = load_tokenizer(target.path), load_tokenizer(draft.path)
        check_same_tokenizer(target_tok, draft_tok)
        for c, tok, who in ((target, target_tok, "target"), (draft, draft_tok, "draft")):
            check_rows_cover_tokenizer(c.config.vocab_size, token_id_count(tok), f"{who} {model_name(c.path)}")
    except CheckpointError as e:
        return f"{e}; a run with this draft is refused"
    return None


def twin_words(plan: MemoryPlan) -> str:
    """What a plan with --draft self holds for the twin, in words."""
    own = sum(i.nbytes for i in plan.items if i.what in ("draft weights", "draft int8 copy"))
    head = {"int8": ", its lm_head beside an int8 copy", "int4": ", its lm_head held int4"}.get(plan.draft_head, "")
    held = ("int8 copies of the target's resident matrices" if plan.draft_quant == "int8" else
            f"the target's layers held {plan.draft_quant}{head}")
    shared = "embedding" if plan.draft_head == "int4" else "embedding and lm_head"
    return f"{held}, {own / 1e9:.2f} GB on the device, the target's {shared} shared"


def twin_line(target: ModelSpec, offload: OffloadConfig, runtime: RuntimeConfig, limits: RunLimits,
              machine: Machine) -> str:
    """Whether --draft self would fit in this run (a run planned without it), and what it would hold."""
    from offspec.formats.draft_quant import auto_twin_quant
    from offspec.plan.search import make_plan
    quant = auto_twin_quant(machine.kind, runtime.dtype)
    try:
        plan = make_plan(target, target.as_twin(), offload, replace(runtime, draft_quant=quant), limits, machine)
    except BudgetError as refused:
        return f"--draft self:    would not fit ({quant}): {refused}"
    return (f"--draft self:    fits: {twin_words(plan)}; {len(plan.placement.resident)} of {target.cfg.n_layers} "
            f"target layers resident beside it")


def model_info(target, draft, plan: MemoryPlan, dtype: torch.dtype, rates: Rates, twin: bool = False) -> str:
    """The report `offspec models info` prints. target, draft: checkpoint.Checkpoints (headers are enough; draft
    may be None); plan: their memory plan (plan.make_plan) in `dtype`; twin: the draft is the target's (--draft
    self)."""
    from offspec.formats.hub import model_name
    from offspec.formats.layout import matrix_params
    from offspec.plan.costmodel import (
        REFERENCE_GPU,
        GpuSetup,
        dequant_figure,
        dequant_seconds,
        pass_compute_seconds,
        predict_seconds_per_token,
    )

    cfg = target.config
    layer_bytes, block = plan.placement.layer_nbytes, plan.block_nbytes
    quant = short_quant(plan.target_quant)
    dtype_name = str(dtype).replace("torch.", "")
    lines = [
        f"folder:          {target.path}",
        f"architecture:    {cfg.arch} ({', '.join(target.raw_config.get('architectures') or [])})",
        f"parameters:      {target.parameter_count() / 1e9:.3f} B",
        "stored dtype:    " + (f"GGML blocks (runs in {str(target.dtype).replace('torch.', '')} unless --dtype says)"
                                 if is_gguf(target.quant) else str(target.dtype).replace("torch.", "")),
        f"layers:          {cfg.n_layers} (hidden {cfg.hidden_size}, heads {cfg.n_heads}/{cfg.n_kv_heads} kv, "
        f"mlp {cfg.intermediate_size}, vocab {cfg.vocab_size}, context {cfg.max_position_embeddings})",
        f"bytes per layer: {layer_bytes / 1e6:.1f} MB in {dtype_name}; all layers {cfg.n_layers * layer_bytes / 1e9:.2f} GB",
    ]
    if target.quant != "none":
        lines.append(f"quantization:    {describe_quant(target.quant)}, read as published ({quant})")
    if plan.layer_moved:            # a GGUF whose matrices' types differ between layers
        moved = plan.moved_by(range(cfg.n_layers))
        lines.append(f"{quant} layer:       {block / 1e6:.1f} MB stored (each matrix at its largest type), "
                     f"{moved / cfg.n_layers / 1e6:.1f} MB moved on average ({moved / cfg.n_layers / layer_bytes:.2f}x); "
                     f"all layers {moved / 1e9:.2f} GB moved")
    elif plan.target_quant != "none":
        lines.append(f"{quant} layer:       {block / 1e6:.1f} MB stored and moved ({block / layer_bytes:.2f}x); "
                     f"all layers {cfg.n_layers * block / 1e9:.2f} GB")
    if twin:
        lines.append(f"draft:           self: {twin_words(plan)}")
    elif draft is not None:
        lines.append(f"draft:           {draft.path} ({draft.parameter_count() / 1e9:.3f} B parameters, "
                     f"{draft.config.n_layers} layers)")
        mismatch = draft_vocab_mismatch(target, draft)
        if mismatch:
            lines.append(f"WARNING:         {mismatch}")
    for c in (target, draft):
        if c is not None and c.incomplete:
            lines.append(f"weights incomplete (enough to plan, not to run): {model_name(c.path)}: {'; '.join(c.incomplete)}")
    lines.append(plan.describe())
    lines.append(f"PREDICTED for:   {rates.describe()}")
    figure, card = dequant_figure(quant), rates.card
    measured = (f"{figure[0]} on {DEQUANT.device}" + (f", scaled to the {card.name}" if card else "")
                if figure else "")
    if plan.streamed_bytes:
        seconds = predicted_pass_seconds(plan, rates.link_gbps, rates.disk_gbps, card=card)
        disk = plan.disk_read_bytes
        via = f"{rates.link_gbps:g} GB/s" + (f", {disk / 1e9:.2f} GB of it read at {rates.disk_gbps:g} GB/s" if disk else "")
        dequant, beside = streamed_dequant_seconds(plan, card), ""
        if dequant:
            beside = f"; the streamed layers' dequantization, {dequant:.3f} s, beside the copies ({measured})"
        elif quant != "none" and not plan.placement.compact and not figure:
            beside = f"; {quant}'s dequantization is not measured, so not counted"
        lines.append(f"PREDICTED pass:  {seconds:.3f} s to stream {plan.streamed_bytes / 1e9:.2f} GB at {via} "
                     f"(the copy stream overlaps compute{beside})")
        held = plan.placement.dequantized_in_line
        compute = pass_compute_seconds(matrix_params(cfg), cfg.n_layers, plan.tree_budget + 1, card)
        setup = GpuSetup(link_gb_per_s=plan.streamed_bytes / seconds / 1e9,
                         dequant_s_per_layer=dequant_seconds(quant, layer_bytes, card))
        per_token = predict_seconds_per_token(plan.streamed_bytes, setup, rates.tokens_per_pass,
                                              draft_seconds_per_round=0.0, compute_seconds_per_pass=compute,
                                              held_layers=held)
        lines.append(f"PREDICTED compute: {compute:.3f} s a pass over a {plan.tree_budget + 1}-token tree "
                     f"(bf16, from the {REFERENCE_GPU.spec.name}'s measured layer"
                     + (f", scaled to the {card.name})" if card else ")"))
        if held or compute > seconds:
            lines.append(f"PREDICTED pass, all in: {per_token['pass_seconds']:.3f} s (max(stream, compute)"
                         + (f" + {held} held layers' dequantization)" if held else ")"))
        lines.append(f"PREDICTED speed: {per_token['seconds_per_token']:.3f} s/token at {rates.tokens_per_pass:g} tokens "
                     f"per pass (--tokens-per-pass; the draft's time not counted)")
    else:
        lines.append("PREDICTED pass:  nothing streams (compute-bound)")
    p = plan.placement
    if p.dequantized_in_line:
        which = " and ".join(([f"{len(p.resident)} resident layers held {quant}"] if p.resident_held else [])
                             + ([f"the {len(p.streamed)} streamed layers of a compact ring"] if p.compact else []))
        cost = (f"counts {dequant_seconds(quant, layer_bytes, card) * 1e3:.1f} ms a layer, {measured}"
                if figure else f"counts none: {quant}'s dequantization is not measured")
        lines.append(f"held layers:     {which}: dequantized every pass, on the compute queue (PREDICTED speed "
                     f"{cost})")
    return "\n".join(lines)
