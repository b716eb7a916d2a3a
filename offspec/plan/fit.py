"""Fitting a run's target layers into what its fixed items leave: the placement and the host side, or a refusal."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Optional

from offspec.config import OffloadConfig, RunLimits, RuntimeConfig
from offspec.errors import BudgetError
from offspec.formats.layout import BLOCK_ALIGN, N_STAGING, arena_stride, pinned_arena_layers, round_up
from offspec.formats.layout import format_bytes as fmt
from offspec.formats.published import short as short_quant
from offspec.plan.costmodel import LINK_GB_PER_S as LINK_GBPS
from offspec.plan.costmodel import PAGEABLE_GB_PER_S
from offspec.plan.machine import GB, PINNED_FRACTION, RUNTIME_HOST_BYTES, Machine
from offspec.plan.memory import MemoryPlan, PlanItem, device_bytes
from offspec.plan.passtime import pipelined_dequant_seconds
from offspec.plan.placement import (
    LayerPlan,
    Placement,
    best_host_layers,
    choose_placement,
    dequant_scratch_nbytes,
    split_tiers,
)
from offspec.plan.sizes import ModelSpec, TargetLayerSizes, embed_nbytes, moved_by


@dataclass(frozen=True)
class PlanRun:
    """One plan's run as the search resolved it: what placing its target layers needs."""
    target: ModelSpec
    offload: OffloadConfig
    runtime: RuntimeConfig
    limits: RunLimits
    machine: Machine
    context: int                  # tokens per sequence in both KV caches (capped at the models' context)
    sizes: TargetLayerSizes       # the bytes of one target layer where it lives
    split_extra: Optional[int]    # what a split ring keeps between parts; None: whole slots only (search._split_extra)
    store_dir: Optional[str] = None   # where a packed store goes when offload.store_dir names none

    @property
    def shared(self) -> bool:
        """A CPU device: one pool with the host."""
        return self.machine.kind == "cpu"


@dataclass(frozen=True)
class Room:
    """What a run's fixed items leave the target's layers, and what its host side takes whatever they are."""
    pool: int             # the device's bytes (a CPU device: host memory)
    fixed_bytes: int      # the fixed items' device bytes
    left: int             # what the pool leaves for target layers
    all_layers: int       # every layer resident, as small as --resident-quant allows
    loading: int          # one layer or the embedding, on the host (transient)
    host_fixed: int       # the runtime and the fixed host items (a target global kept there)
    staging: int          # the disk staging buffers
    pinned_budget: int    # host bytes that may be pinned
    stride: int           # one layer's bytes in the host arena


@dataclass(frozen=True)
class HostSide:
    """The host items of a placement, and how much of its arena is pinned."""
    items: tuple[PlanItem, ...]
    arena_budget: int     # the pinned budget less the staging buffers, which pin first
    pinned_layers: int    # the arena's first layers that are pinned
    pinned: bool          # the arena / staging will be pinned (CUDA only)


def place(run: PlanRun, tree_budget: int, fixed: list[PlanItem], notes: list[str]) -> MemoryPlan:
    """Given the fixed device items, place the target's layers and the host side, or refuse."""
    room = _room(run, fixed)
    mode = run.offload.mode
    if mode == "auto":
        mode = _auto_mode(run, room)
        notes.append(f"offload auto -> {mode}")
    placement = _choose(run, room, mode)
    if placement.mode == "cpu+disk":
        placement = _host_tier(run, room, placement, notes)
    host = _host_side(run, room, placement, notes)
    items = list(fixed) + _device_items(run, placement) + list(host.items)
    _check_host(run, room, placement, items)
    return _memory_plan(run, room, tree_budget, placement, host, items, notes)


def _room(run: PlanRun, fixed: list[PlanItem]) -> Room:
    """What the fixed items leave; refuses a --host-budget over the host memory, and fixed items over the pool."""
    machine, offload, shared = run.machine, run.offload, run.shared
    fixed_bytes = device_bytes(fixed)
    host_fixed = (0 if shared else RUNTIME_HOST_BYTES) + sum(i.nbytes for i in fixed if i.where == "host")
    loading = max(run.sizes.resident, embed_nbytes(run.target, run.runtime.dtype))
    pool = machine.host_bytes if shared else machine.device_bytes
    left = pool - fixed_bytes - (loading if shared else 0)

    if offload.host_budget is not None and offload.host_budget > machine.host_bytes:
        raise BudgetError(f"--host-budget {fmt(offload.host_budget)} is more than the host memory this run may use "
                          f"({fmt(machine.host_bytes)}, {machine.host_source})")
    pinned_budget = (offload.host_budget if offload.host_budget is not None
                     else int(PINNED_FRACTION * machine.host_bytes))

    if left < 0:
        what = "host memory" if shared else f"the device's {fmt(machine.device_bytes)}"
        raise BudgetError(f"{what} cannot hold the run before any target layer: "
                          + ", ".join(f"{i.what} {fmt(i.nbytes)}" for i in fixed if i.where == "device")
                          + f" = {fmt(fixed_bytes)}; lower --context or --tree-budget, or use a smaller draft")
    return Room(pool, fixed_bytes, left, _all_layers(run), loading, host_fixed,
                N_STAGING * round_up(run.sizes.block, BLOCK_ALIGN), pinned_budget, arena_stride(run.sizes.block))


def _all_layers(run: PlanRun) -> int:
    """Every layer resident, as small as --resident-quant allows: dense, or held quantized with one scratch layer."""
    n_layers, L, B = run.target.cfg.n_layers, run.sizes.resident, run.sizes.block
    if run.runtime.target_quant == "none" or run.runtime.resident_quant == "off":
        return n_layers * L
    if run.runtime.resident_quant == "on":
        return n_layers * B + L
    return min(n_layers * L, n_layers * B + L)


def _auto_mode(run: PlanRun, room: Room) -> str:
    """none if every layer fits on the device; else cpu if the whole arena fits in the pinned budget; else
    cpu+disk, whose host tier _host_tier sizes for the shortest predicted pass (best_host_layers: pinned, then
    pageable RAM, then the disk store; all in RAM resolves to cpu, none to disk)."""
    if run.shared:
        return "none"
    budget = run.offload.gpu_budget if run.offload.gpu_budget is not None else room.left
    if room.all_layers <= budget:
        return "none"
    full_arena = run.target.cfg.n_layers * room.stride
    if (full_arena + room.loading + room.host_fixed <= run.machine.host_bytes
            and full_arena <= room.pinned_budget - room.staging):
        return "cpu"
    return "cpu+disk"


def _choose(run: PlanRun, room: Room, mode: str) -> Placement:
    """The target's layers placed in `mode` within the layer budget (choose_placement)."""
    sizes, quant = run.sizes, run.runtime.target_quant
    split = None if run.split_extra is None else (sizes.part, sizes.part_scratch + run.split_extra)
    return choose_placement(run.target.cfg.n_layers, sizes.resident, replace(run.offload, mode=mode),
                            _layer_budget(run, room, mode), slot_bytes=sizes.slot if quant != "none" else None,
                            held_bytes=sizes.block if quant != "none" else None,
                            resident_quant=run.runtime.resident_quant, split=split)


def _layer_budget(run: PlanRun, room: Room, mode: str) -> Optional[int]:
    """The device bytes for the target's layers in `mode`; refuses a --gpu-budget over what is left, layers
    that cannot all stay resident with no offload, and room for no ring."""
    offload, shared, left, pool = run.offload, run.shared, room.left, room.pool
    if offload.gpu_budget is not None and offload.gpu_budget > left:
        raise BudgetError(f"--gpu-budget {fmt(offload.gpu_budget)} is more than the device leaves for target layers: "
                          f"{fmt(pool)} {'host memory' if shared else 'free'} − {fmt(room.fixed_bytes)} for the draft, "
                          f"globals, caches, logits, activations and reserve = {fmt(left)}; use --gpu-budget "
                          f"{_floor_gb(left)} or less")
    if mode == "none":
        budget = offload.gpu_budget if offload.gpu_budget is not None else left
        if room.all_layers > budget:
            raise BudgetError(f"the target's {run.target.cfg.n_layers} layers ({fmt(room.all_layers)}) do not fit "
                              f"in the {fmt(budget)} the {'machine' if shared else 'device'} leaves for them: use "
                              f"--offload {'disk' if shared else 'cpu or disk'}")
        return budget
    _check_ring(run, room)
    # On a CPU device, with no budget given, nothing stays resident: cpu/disk offload should really stream.
    return offload.gpu_budget if offload.gpu_budget is not None else (None if shared else left)


def _check_ring(run: PlanRun, room: Room) -> None:
    """Refuses a device that leaves too little for the smallest ring (and for every layer held resident)."""
    sizes, split_extra, left = run.sizes, run.split_extra, room.left
    min_slots = 2 if run.offload.overlap else 1
    ring = sizes.ring_min(min_slots, split_extra)
    if left >= min(ring, room.all_layers):     # (held quantized, all layers may take less than a ring)
        return
    split_min = None if split_extra is None else sizes.split_min(min_slots, split_extra)
    small = "split" if ring == split_min else "compact"
    compact = "" if ring == min_slots * sizes.slot else f" or a {small} ring of {fmt(ring)}"
    raise BudgetError(f"{fmt(left)} is all the {'machine' if run.shared else 'device'} leaves for target layers "
                      f"(of {fmt(room.pool)}: {fmt(room.fixed_bytes)} go to the draft, globals, caches, logits, "
                      f"activations and reserve), too little for {min_slots} streaming slots of {fmt(sizes.slot)}"
                      f"{compact}; lower --context or --tree-budget, or use a smaller draft")


def _host_tier(run: PlanRun, room: Room, placement: Placement, notes: list[str]) -> Placement:
    """Mode cpu+disk: the streamed layers split between host RAM and the disk store."""
    # The host tier holds what fits beside everything else on the host (the disk staging included); on a
    # GPU its first layers are pinned, within the pinned budget, and the rest pageable, as many as make the
    # pass shortest (best_host_layers); the others are read from the disk store.
    shared, B = run.shared, run.sizes.block
    room_bytes = run.machine.host_bytes - room.loading - room.host_fixed - room.staging
    room_bytes -= room.fixed_bytes + placement.device_bytes if shared else 0
    if shared and run.offload.host_budget is not None:    # (a CPU device pins nothing: a given budget caps it)
        room_bytes = min(room_bytes, run.offload.host_budget - room.staging)
    n_ram = max(room_bytes, 0) // room.stride
    if not shared:
        n_ram = best_host_layers(len(placement.streamed), min(n_ram, len(placement.streamed)), B,
                                 room.pinned_budget, room.staging,
                                 pipelined_dequant_seconds(placement, run.runtime.target_quant))
    placement = split_tiers(placement, n_ram)
    notes.append(f"{len(placement.host_layers)} streamed layers in host RAM, {len(placement.disk_layers)} read "
                 f"from the disk store" if placement.mode == "cpu+disk" else f"offload cpu+disk -> {placement.mode}")
    return placement


def _device_items(run: PlanRun, placement: Placement) -> list[PlanItem]:
    """The device items of the target's decoder layers: ring, what a split ring keeps, resident layers, scratch."""
    quant, sizes = run.runtime.target_quant, run.sizes
    L, B = sizes.resident, sizes.block
    items = []
    if placement.n_slots:
        items.append(PlanItem("device", f"ring: {placement.n_slots} slots",
                              placement.n_slots * placement.ring_slot_nbytes, _ring_note(placement, quant, L, B)))
    if placement.split:
        items.append(PlanItem("device", "MLP intermediates between parts", run.split_extra,
                              f"{run.limits.concurrency * run.context} rows × (hidden + intermediate)"))
        if sizes.part_scratch:
            items.append(PlanItem("device", "dequantization scratch", sizes.part_scratch,
                                  "the largest dense part, the ring's parts dequantize into"))
    if placement.resident_held:
        items.append(PlanItem("device", f"resident target layers ({len(placement.resident)}, {short_quant(quant)})",
                              len(placement.resident) * B, f"held quantized, {fmt(B)} each"))
    if placement.scratch_nbytes:
        users = " and ".join((["the held layers"] if placement.resident_held else [])
                             + (["the ring's layers"] if placement.compact else []))
        items.append(PlanItem("device", "dequantization scratch", placement.scratch_nbytes,
                              f"one dense layer {users} dequantize into, every pass"))
    if placement.resident and not placement.resident_held:
        items.append(PlanItem("device", f"resident target layers ({len(placement.resident)})",
                              len(placement.resident) * L))
    return items


def _host_side(run: PlanRun, room: Room, placement: Placement, notes: list[str]) -> HostSide:
    """The host items (arena, staging, loading, runtime) and how much of the arena is pinned."""
    shared = run.shared
    n_host = len(placement.host_layers)
    arena_budget = room.pinned_budget - (room.staging if placement.disk_layers else 0)   # the staging buffers pin first
    pinned_layers = 0 if shared else pinned_arena_layers(n_host, run.sizes.block, arena_budget)
    pinned = not shared and pinned_layers == n_host and (bool(n_host) or bool(placement.disk_layers))
    items = []
    if placement.host_layers:
        nbytes = n_host * room.stride
        note = ("pinned" if pinned_layers == n_host else
                "pageable: the CPU is the device" if shared else
                f"{pinned_layers} layers pinned (the pinned budget {fmt(arena_budget)}), {n_host - pinned_layers} "
                f"pageable, copied about {LINK_GBPS / PAGEABLE_GB_PER_S:.0f}x slower")
        items.append(PlanItem("host", f"host arena ({n_host} layers)", nbytes, note))
        if not shared and pinned_layers < n_host:
            notes.append(f"the host arena ({fmt(nbytes)}) is over the pinned budget ({fmt(arena_budget)}): "
                         f"{n_host - pinned_layers} of its layers are pageable (--host-budget sets the budget)")
    if placement.disk_layers:
        items.append(PlanItem("host", "disk staging buffers", room.staging, f"{N_STAGING} × {fmt(run.sizes.block)}"))
    items.append(PlanItem("host", "loading (transient)", room.loading, "one layer or the embedding at a time"))
    if not shared:
        items.append(PlanItem("host", "runtime (Python, torch, tokenizer)", RUNTIME_HOST_BYTES))
    return HostSide(tuple(items), arena_budget, pinned_layers, pinned)


def _check_host(run: PlanRun, room: Room, placement: Placement, items: list[PlanItem]) -> None:
    """Refuses a run whose host side (a CPU device: everything) is more than the host memory it may use."""
    machine = run.machine
    host_total = sum(i.nbytes for i in items if i.where == "host") + (room.fixed_bytes + placement.device_bytes
                                                                       if run.shared else 0)
    if host_total > machine.host_bytes:
        fix = ("use --offload auto (what fits in RAM, the rest read from disk) or disk" if placement.mode == "cpu" else
               "lower --context or --tree-budget")
        raise BudgetError(f"the run needs {fmt(host_total)} of host memory but {fmt(machine.host_bytes)} is available "
                          f"({machine.host_source}): {fix}")


def _memory_plan(run: PlanRun, room: Room, tree_budget: int, placement: Placement, host: HostSide,
                 items: list[PlanItem], notes: list[str]) -> MemoryPlan:
    """The plan's record: the layer plan the loader carries out, and the items, notes and bytes of the run."""
    offload, limits, B = run.offload, run.limits, run.sizes.block
    layers = LayerPlan(placement, run.runtime.target_quant, offload.store_dir or run.store_dir, host.arena_budget,
                       offload.overlap, offload.drop_page_cache, offload.disk_io,
                       scratch_nbytes=dequant_scratch_nbytes(placement, run.sizes))
    if not layers.from_store:
        layers = replace(layers, store_dir=None)           # no store is read: name no folder
    return MemoryPlan(machine=run.machine, context=run.context, tree_budget=tree_budget,
                      prefill_chunk=limits.prefill_chunk, concurrency=limits.concurrency, layers=layers,
                      layer_budget=room.left if offload.gpu_budget is None else offload.gpu_budget,
                      host_pinned=host.pinned, items=tuple(items), notes=tuple(notes),
                      streamed_bytes=moved_by(run.sizes.moved, B, placement.streamed), block_nbytes=B,
                      layer_moved=run.sizes.moved, pinned_layers=host.pinned_layers,
                      pinned_budget=room.pinned_budget, draft_quant=run.runtime.draft_quant)


def _ring_note(p: Placement, quant: str, L: int, B: int) -> str:
    """How the ring's slots hold a layer, for its plan item (L: a dense layer's bytes, B: the block's)."""
    quant = short_quant(quant)
    if p.split:
        return (f"split: a layer's parts in turn, {fmt(p.ring_slot_nbytes)} the largest"
                + (f", {quant}, dequantized at its use" if quant != "none" else ""))
    if quant == "none":
        return f"{fmt(L)} per layer"
    if p.compact:
        return f"{quant} block {fmt(B)} per slot, compact: dequantized at its use"
    return f"{quant} block {fmt(B)} + dense layer {fmt(L)} per slot"


def _floor_gb(n: int) -> str:
    return f"{math.floor(n / GB * 10) / 10:g}GB" if n >= GB else f"{max(n // 10**6, 0)}MB"
