"""make_plan: the search for the context, tree budget and concurrency that fit, or a refusal in one line.

The memory plan: before anything is allocated, where every byte of a run will live, and whether it fits.

    make_plan(target, draft, offload, runtime, limits, machine) -> MemoryPlan   (or BudgetError: one line)
                                                every "auto" resolved: offload mode, tree budget, concurrency
    choose_placement(...) -> Placement   which target layers stay resident, how many ring slots stream the rest

The plan is shape arithmetic: it imports no loading, store or streaming code (load.py carries a plan out).

Inputs are shapes, never weights: ModelSpec comes from config.json and the safetensors headers, so a plan
can be made for machines and models that are not here (`offspec models info --device-memory 24GB`).

Device (the GPU; on a CPU-only run the host RAM itself, one pool with the host items):
  draft weights (+ its int8 copy; or its layers held int8 / nf4, + one dequantized matrix), target globals
  (embed, final norm, lm_head), both KV caches at the run's context, logits of the largest tree, activations
  of the largest forward (rows go through each layer in chunks of prefill_chunk, so a long prompt costs
  chunk-sized intermediates), a reserve for the allocator and library workspaces; what is left holds the
  streaming ring and the resident target layers (a quantized target's held as their blocks plus one dense
  scratch layer where that fits more of them: --resident-quant).
Host: the pinned arena (cpu offload) or the staging buffers (disk offload), a transient for loading, and the
  runtime itself; all of it within min(MemAvailable, the cgroup's limit), the pinned part within a safe
  fraction of that (pinned pages cannot be reclaimed: pinning too much is an OOM kill, not a fallback).

Offload "auto" on a GPU: everything resident if it fits, else layers streamed from host RAM if the arena
fits there, else from disk. On a CPU device auto is "none": host RAM is the device already.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Callable, Optional

import torch

from offspec.config import AUTO_MAX_TREE_BUDGET, LM_HEAD_CHUNK_BYTES, OffloadConfig, RunLimits, RuntimeConfig
from offspec.errors import BudgetError, InputError
from offspec.formats.cpu_bf16 import wide_in_float32
from offspec.formats.draft_quant import HEAD_WORDS, draft_lm_head
from offspec.formats.layout import format_bytes as fmt
from offspec.formats.published import describe as describe_quant
from offspec.formats.published import weight_dtype
from offspec.formats.weights import HELD_DRAFT_QUANTS
from offspec.plan.costmodel import DISK_GBPS
from offspec.plan.costmodel import LINK_GB_PER_S as LINK_GBPS
from offspec.plan.fit import PlanRun, place
from offspec.plan.machine import CUDA_RESERVE_FRACTION, CUDA_RESERVE_MIN, RUNTIME_HOST_BYTES, Machine
from offspec.plan.memory import MemoryPlan, PlanItem, device_bytes
from offspec.plan.passtime import predicted_pass_seconds
from offspec.plan.sizes import (
    ModelSpec,
    TargetLayerSizes,
    activation_nbytes,
    draft_weights_nbytes,
    embed_nbytes,
    globals_nbytes,
    int8_copy_nbytes,
    itemsize,
    kv_bytes_per_token,
    largest_matrix_nbytes,
    logits_nbytes,
    published_runtime,
    split_activation_nbytes,
)

MIN_AUTO_TREE_BUDGET = 16       # a short device lowers the auto maximum, halving, down to this
AUTO_CONCURRENCY = 16           # auto concurrency (--concurrency auto): at most this many requests in flight
CONTEXT_STEP = 256              # a refusal's advice names a context that fits in steps of this many tokens


def make_plan(target: ModelSpec, draft: Optional[ModelSpec], offload: OffloadConfig, runtime: RuntimeConfig,
              limits: RunLimits, machine: Machine, store_dir: Optional[str] = None) -> MemoryPlan:
    """Where everything goes, or BudgetError saying in one line what does not fit and what to change.
    store_dir: where a packed store goes when one is used and offload.store_dir names none (load.store_dir_for).

    An auto tree budget (limits.tree_budget None) is the most that fits, up to AUTO_MAX_TREE_BUDGET: a
    device too short for the largest tree's logits gets a smaller auto maximum (said in the notes).

    Auto concurrency (limits.concurrency None) is the most requests in flight, up to AUTO_CONCURRENCY and
    limits.concurrency_cap, whose plan fits (each adds KV-cache rows, a tree's logits and activations): halved
    from there until it fits, down to 1 (whose refusal is the answer). The plan records the number and that it
    was auto (concurrency_auto).

    A refusal says what would fit, where something does: the longest shorter context (in steps of CONTEXT_STEP
    tokens), else the target or the draft held in nf4 (_what_fits). A published checkpoint's layers are planned
    in its own quantization (published_runtime)."""
    runtime = published_runtime(target, runtime)
    try:
        plan = _plan_with_draft(target, draft, offload, runtime, limits, machine, store_dir)
    except BudgetError as refused:
        fits = _what_fits(target, draft, offload, runtime, limits, machine, store_dir)
        if fits is None:
            raise
        raise BudgetError(f"{refused}; {fits}") from None
    natural = weight_dtype(target.quant) if target.quant != "none" else None
    if natural is not None and runtime.dtype not in (natural, torch.float32):
        name = str(natural).removeprefix("torch.")
        plan = replace(plan, notes=plan.notes + (
            f"{describe_quant(target.quant)} dequantizes in {name}; in {str(runtime.dtype).removeprefix('torch.')} "
            f"its weights are rounded once more (--dtype {name} runs exactly them)",))
    return plan


def _plan_with_draft(target: ModelSpec, draft: Optional[ModelSpec], offload: OffloadConfig, runtime: RuntimeConfig,
                     limits: RunLimits, machine: Machine, store_dir: Optional[str]) -> MemoryPlan:
    """_plan_concurrency; but a twin with --draft-quant int8 reads the target's own resident dense matrices
    (beside their int8 copies), so it needs a plan that keeps every target layer on the device, dense: where
    the plan does not, the twin holds int8 layers of its own (int8-held, the same draft), said in the notes."""
    plan = _plan_concurrency(target, draft, offload, runtime, limits, machine, store_dir)
    if draft is None or not draft.twin or runtime.draft_quant != "int8" or plan.layers.dense_resident:
        return plan
    plan = _plan_concurrency(target, draft, offload, replace(runtime, draft_quant="int8-held"), limits, machine,
                             store_dir)
    return replace(plan, notes=plan.notes + ("--draft self: the target's layers do not all stay on the device "
                                             "dense, so its twin holds int8 layers of its own (int8-held)",))


def _what_fits(target: ModelSpec, draft: Optional[ModelSpec], offload: OffloadConfig, runtime: RuntimeConfig,
               limits: RunLimits, machine: Machine, store_dir: Optional[str]) -> Optional[str]:
    """For a refused run: the one change that fits, as the words to add to the refusal, or None."""
    def fits(changed_runtime: RuntimeConfig, changed_limits: RunLimits) -> bool:
        try:
            _plan_concurrency(target, draft, offload, changed_runtime, changed_limits, machine, store_dir)
            return True
        except (BudgetError, InputError):
            return False
    context = _longest_context(target, draft, limits, lambda n: fits(runtime, replace(limits, context=n)))
    if context is not None:
        return f"a context of {context} tokens (prompt, output and a tree) fits: --context {context}"
    changes = [("--target-quant nf4 fits (that quantized model's output)", replace(runtime, target_quant="nf4")),
               ("--draft-quant nf4 fits", replace(runtime, draft_quant="nf4")),
               ("--target-quant nf4 --draft-quant nf4 fits (that quantized model's output)",
                replace(runtime, target_quant="nf4", draft_quant="nf4"))]
    for words, changed in changes:
        if changed != runtime and (draft is not None or changed.draft_quant == runtime.draft_quant) \
                and (target.quant == "none" or changed.target_quant == runtime.target_quant) \
                and fits(changed, limits):
            return words
    return None


def _longest_context(target: ModelSpec, draft: Optional[ModelSpec], limits: RunLimits,
                     fits: Callable[[int], bool]) -> Optional[int]:
    """The longest context, a multiple of CONTEXT_STEP below the run's, that fits(context); None if none does."""
    model_context = _model_context(target, draft)
    asked = min(limits.context or model_context, model_context)
    hi = (asked - 1) // CONTEXT_STEP                   # in steps: the longest k with fits(k * CONTEXT_STEP)
    if hi < 1 or not fits(CONTEXT_STEP):
        return None
    lo = 1
    while lo < hi:                                     # plans only grow with the context: bisect
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid * CONTEXT_STEP) else (lo, mid - 1)
    return lo * CONTEXT_STEP


def _model_context(target: ModelSpec, draft: Optional[ModelSpec]) -> int:
    """The longest context both models take."""
    return min([target.cfg.max_position_embeddings] + ([draft.cfg.max_position_embeddings] if draft else []))


def _plan_concurrency(target: ModelSpec, draft: Optional[ModelSpec], offload: OffloadConfig, runtime: RuntimeConfig,
                      limits: RunLimits, machine: Machine, store_dir: Optional[str]) -> MemoryPlan:
    """make_plan without the context advice: auto concurrency resolved here."""
    if limits.concurrency is not None:
        return _plan_rows(target, draft, offload, runtime, limits, machine, store_dir)
    rows = min(AUTO_CONCURRENCY, max(1, limits.concurrency_cap or AUTO_CONCURRENCY))
    while True:
        try:
            plan = _plan_rows(target, draft, offload, runtime, replace(limits, concurrency=rows), machine, store_dir)
            return replace(plan, concurrency_auto=True)
        except BudgetError:
            if rows == 1:
                raise
            rows //= 2


def _plan_rows(target: ModelSpec, draft: Optional[ModelSpec], offload: OffloadConfig, runtime: RuntimeConfig,
               limits: RunLimits, machine: Machine, store_dir: Optional[str]) -> MemoryPlan:
    """make_plan for a given number of requests in flight (limits.concurrency).

    On a GPU, a target whose embedding is its own tensor (not the lm_head's) keeps it in host memory whenever
    the device cannot hold every layer with it: a pass looks up its rows there and copies them over (kilobytes
    to megabytes, against the gigabyte of an embedding that then holds more layers, or lets the run fit at
    all). Where even that does not fit, the lm_head stays in host memory too, and the logits are computed in
    chunks of it that cross every pass (model.chunked_logits): the pass pays its bytes, the run fits."""
    args = (target, draft, offload, runtime, limits, machine, store_dir)
    if machine.kind == "cpu" or not target.lm_head_stored:
        return _plan_with(*args, on_host=())
    plans, refusal = [], None
    for on_host in ((), ("embed",), ("embed", "lm_head")):
        try:
            plan = _plan_with(*args, on_host=on_host)
        except BudgetError as err:
            refusal = refusal or err        # the on-device plan's refusal is the one to show
            continue
        if not plan.placement.streamed:
            return plan                     # every layer on the device: nothing to gain by moving more
        plans.append(plan)
        if on_host == ("embed",):
            break                           # the lm_head moves only where nothing else fits
    if not plans:
        raise refusal
    # The first of the fastest (predicted): the embedding stays where moving it gains nothing (a --gpu-budget).
    return min(plans, key=lambda p: (round(predicted_pass_seconds(p, LINK_GBPS, DISK_GBPS), 6), -p.tree_budget))


def _plan_with(target: ModelSpec, draft: Optional[ModelSpec], offload: OffloadConfig, runtime: RuntimeConfig,
               limits: RunLimits, machine: Machine, store_dir: Optional[str], on_host: tuple[str, ...]) -> MemoryPlan:
    """_plan_rows with the target's globals named in on_host ("embed", "lm_head") kept in host memory."""
    if limits.prefill_chunk < 1:
        raise InputError("--prefill-chunk must be at least 1")
    if limits.concurrency < 1:
        raise InputError("--concurrency must be at least 1")
    if limits.tree_budget is not None and limits.tree_budget < 0:
        raise InputError("the tree budget must be >= 0")
    model_context = _model_context(target, draft)
    context = model_context if limits.context is None else min(limits.context, model_context)
    if context < 2:
        raise InputError(f"a context of {context} tokens leaves no room to generate")
    run = PlanRun(target, offload, runtime, limits, machine, context,
                  TargetLayerSizes.of(target.cfg, runtime.dtype, runtime.target_quant),
                  _split_extra(target, runtime, limits, context, machine, offload), store_dir)
    notes: list[str] = []
    tree_budget, fixed = _tree_budget(run, draft, on_host, notes)
    plan = replace(place(run, tree_budget, fixed, notes), draft_head=_draft_head(run, draft, on_host))
    if not on_host:
        return plan
    matrix = embed_nbytes(target, runtime.dtype)
    head = "lm_head" in on_host
    note = (f"the target's embedding ({fmt(matrix)}) stays in host memory: the device holds layers instead"
            if not head else f"the target's embedding and lm_head ({fmt(2 * matrix)}) stay in host memory: the "
            f"lm_head crosses in {fmt(min(LM_HEAD_CHUNK_BYTES, matrix))} chunks every pass (the run fits only so)")
    return replace(plan, layers=replace(plan.layers, embed_on_host=True, lm_head_on_host=head),
                   notes=plan.notes + (note,), host_head_bytes=matrix if head else 0)


def _tree_budget(run: PlanRun, draft: Optional[ModelSpec], on_host: tuple[str, ...],
                 notes: list[str]) -> tuple[int, list[PlanItem]]:
    """The run's tree budget and its fixed device items: the given budget, or (auto) the most that leaves the
    smallest ring room, halving from AUTO_MAX_TREE_BUDGET down to MIN_AUTO_TREE_BUDGET."""
    limits, context = run.limits, run.context
    if draft is None or limits.tree_budget is not None:
        tree_budget = 0 if draft is None else limits.tree_budget   # no draft: plain decoding, no trees
        return tree_budget, _fixed_device_items(run, draft, tree_budget, on_host)
    ring = run.sizes.ring_min(2 if run.offload.overlap else 1, run.split_extra)
    pool = run.machine.host_bytes if run.shared else run.machine.device_bytes
    tree_budget = min(AUTO_MAX_TREE_BUDGET, context)
    while True:
        fixed = _fixed_device_items(run, draft, tree_budget, on_host)
        if pool - device_bytes(fixed) >= ring or tree_budget <= MIN_AUTO_TREE_BUDGET:
            break
        tree_budget //= 2
    if tree_budget < min(AUTO_MAX_TREE_BUDGET, context):
        notes.append(f"auto tree budget capped at {tree_budget} nodes: larger trees' logits do not fit")
    return tree_budget, fixed


def _split_extra(target: ModelSpec, runtime: RuntimeConfig, limits: RunLimits, context: int, machine: Machine,
                 offload: OffloadConfig) -> Optional[int]:
    """What a split ring would keep between parts (split_activation_nbytes over the largest pass); None where no
    ring is made smaller than whole slots: a CPU run with no --gpu-budget streams everything through whole slots."""
    if machine.kind == "cpu" and offload.gpu_budget is None:
        return None
    return split_activation_nbytes(target.cfg, runtime.dtype, limits.concurrency * context)


def _draft_head(run: PlanRun, draft: Optional[ModelSpec], on_host: tuple[str, ...]) -> str:
    """How the draft keeps its lm_head in this plan (draft_quant.draft_lm_head)."""
    if draft is None:
        return "as is"
    return draft_lm_head(run.runtime.draft_quant, run.machine.kind, run.runtime.dtype, draft.twin, "lm_head" in on_host)


def _draft_weight_items(draft: ModelSpec, runtime: RuntimeConfig, head: str) -> list[PlanItem]:
    """The draft's weights on the device: dense or held quantized, with its lm_head as `head` says
    (_draft_head), and its int8 copy or dequantization temporary."""
    dtype = runtime.dtype
    held = runtime.draft_quant in HELD_DRAFT_QUANTS
    name = "--draft self: the target's own" if draft.twin else Path(draft.name).name
    items = [PlanItem("device", "draft weights", draft_weights_nbytes(draft, dtype, runtime.draft_quant, head),
                      name + (f", layers held {runtime.draft_quant}" if held else
                              f", layers held int4, {HEAD_WORDS[head]}" if runtime.draft_quant == "int4" else ""))]
    if runtime.draft_quant == "int8":
        items.append(PlanItem("device", "draft int8 copy", int8_copy_nbytes(draft.cfg, dtype), "--draft-quant int8"))
    if held:
        items.append(PlanItem("device", "draft dequantization temporary", largest_matrix_nbytes(draft.cfg, dtype),
                              "one dense matrix a call"))
    return items


def _fixed_device_items(run: PlanRun, draft: Optional[ModelSpec], tree_budget: int,
                        on_host: tuple[str, ...]) -> list[PlanItem]:
    """Every device item but the target's decoder layers (and the target's globals that stay on the host, as
    host items: on_host names them, "embed" and "lm_head")."""
    target, runtime, limits, machine, context = run.target, run.runtime, run.limits, run.machine, run.context
    dtype = runtime.dtype
    fixed = _draft_weight_items(draft, runtime, _draft_head(run, draft, on_host)) if draft is not None else []
    matrix = embed_nbytes(target, dtype)
    if "lm_head" in on_host:
        fixed.append(PlanItem("device", "target norm", target.cfg.hidden_size * itemsize(dtype)))
        fixed.append(PlanItem("device", "lm_head chunk", min(LM_HEAD_CHUNK_BYTES, matrix),
                              "the host lm_head crosses this much at a time"))
        fixed.append(PlanItem("host", "target lm_head", matrix, "its chunks cross every pass"))
    elif "embed" in on_host:
        fixed.append(PlanItem("device", "target norm, lm_head", globals_nbytes(target, dtype) - matrix))
    else:
        fixed.append(PlanItem("device", "target embed, norm, lm_head", globals_nbytes(target, dtype)))
    if "embed" in on_host:
        fixed.append(PlanItem("host", "target embedding", matrix, "looked up on the host, the pass's rows copied over"))
    # Every request in flight has its own KV-cache rows and its own tree in each pass; a pass may carry all of
    # their prompts at once (the worst case for the hidden states of the packed rows).
    B = limits.concurrency
    per = f" × {B} rows" if B > 1 else ""
    fixed.append(PlanItem("device", "target KV cache", B * kv_bytes_per_token(target.cfg, dtype) * context,
                          f"{context} tokens{per}"))
    if draft is not None:
        fixed.append(PlanItem("device", "draft KV cache", B * kv_bytes_per_token(draft.cfg, dtype) * context,
                              f"{context} tokens{per}"))
    sampling = limits.sampling and draft is not None
    d_cfg = draft.cfg if draft else None
    if limits.tree_budget is None and B > 1:
        # The auto budget is one node budget per pass shared by every row in flight (costmodel.BudgetPlanner):
        # tree_budget nodes in all, at least one a row, and each row's root.
        logits = logits_nbytes(target.cfg, d_cfg, dtype, tree_budget + 2 * B - 1, sampling)
        counted = f"{tree_budget} nodes shared by {B} rows + a node and a root each"
    else:
        logits = B * logits_nbytes(target.cfg, d_cfg, dtype, tree_budget, sampling)
        counted = f"{tree_budget + 1} rows{per}"
    fixed.append(PlanItem("device", "tree logits", logits,
                          counted + (", T>0 draft distributions" if sampling else "")))
    cpu = machine.kind == "cpu"
    act = max(activation_nbytes(m.cfg, dtype, B * context, limits.prefill_chunk, context, cpu,
                                cpu and wide_in_float32(torch.device("cpu"), dtype))
              for m in ([target] + ([draft] if draft else [])))
    fixed.append(PlanItem("device", "activations of the largest forward", act,
                          f"{B * context} rows in chunks of {min(B * context, limits.prefill_chunk)}"))
    if machine.kind == "cpu":
        fixed.append(PlanItem("device", "runtime (Python, torch, tokenizer)", RUNTIME_HOST_BYTES))
    else:
        reserve = max(CUDA_RESERVE_MIN, int(CUDA_RESERVE_FRACTION * machine.device_bytes))
        fixed.append(PlanItem("device", "reserve (allocator, workspaces)", reserve))
    return fixed
