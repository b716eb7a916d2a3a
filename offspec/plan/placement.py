"""Where the target's layers live: which stay resident, the ring they stream through, and the tier each comes from."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

from offspec.config import ModelConfig, OffloadConfig
from offspec.errors import BudgetError, InputError
from offspec.formats.layout import LAYER_PARTS, arena_stride, pinned_arena_layers
from offspec.formats.layout import format_bytes as fmt
from offspec.formats.quant import TARGET_QUANTS, target_layout
from offspec.plan.costmodel import DISK_GBPS, PAGEABLE_GB_PER_S, transfer_seconds
from offspec.plan.costmodel import LINK_GB_PER_S as LINK_GBPS
from offspec.plan.sizes import TargetLayerSizes, ring_slot_nbytes

MODES = ("none", "cpu", "disk", "cpu+disk")   # cpu+disk: host RAM for what fits, the disk store for the rest
RESIDENT_QUANTS = ("auto", "on", "off")   # a quantized target's resident layers held quantized:
                                          # where more fit | always | never


@dataclass(frozen=True)
class Placement:
    """Which target layers stay on the compute device and how many ring slots the rest stream through."""
    mode: str                   # "none" | "cpu" | "disk" | "cpu+disk": where the streamed layers live
    n_layers: int               # decoder layers of the target
    layer_nbytes: int           # bytes of one packed (dense) layer, as a resident layer takes them
    resident: tuple[int, ...]   # layers kept on the device for good (the first layers)
    n_slots: int                # ring slots; 0 when nothing streams
    slot_nbytes: Optional[int] = None   # bytes of one ring slot; None = layer_nbytes (a quantized layer's
                                        # slot holds its block and the dense layer it dequantizes into)
    held_nbytes: Optional[int] = None   # resident layers held quantized (--resident-quant): the bytes of one,
                                        # its block; None = resident layers are dense (layer_nbytes each)
    in_host: tuple[int, ...] = ()       # mode cpu+disk: the streamed layers held in host RAM (the rest: disk)
    compact: bool = False               # quantized: slots hold blocks only (slot_nbytes = the block), each
                                        # dequantized at its use into the shared scratch layer on the compute
                                        # queue; chosen only where whole slots do not fit
    split_nbytes: Optional[int] = None  # a split ring (slots of a layer's largest part, slot_nbytes, each layer
                                        # streamed in its parts; quantized: compact too), paying these bytes once:
                                        # the MLP's intermediates kept between parts (+ quantized: the dense part
                                        # its parts dequantize into); chosen only where no whole-layer ring fits

    @property
    def split(self) -> bool:
        return self.split_nbytes is not None

    @property
    def host_layers(self) -> tuple[int, ...]:
        """Streamed layers copied from the host arena each pass."""
        return {"cpu": self.streamed, "cpu+disk": self.in_host}.get(self.mode, ())

    @property
    def disk_layers(self) -> tuple[int, ...]:
        """Streamed layers read from the disk store each pass."""
        host = set(self.host_layers)
        return tuple(i for i in self.streamed if i not in host) if self.mode in ("disk", "cpu+disk") else ()

    @property
    def streamed(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.n_layers) if i not in self.resident)

    @property
    def ring_slot_nbytes(self) -> int:
        return self.layer_nbytes if self.slot_nbytes is None else self.slot_nbytes

    @property
    def resident_held(self) -> bool:
        """Resident layers are held quantized and dequantized into one scratch layer every pass."""
        return self.held_nbytes is not None and bool(self.resident)

    @property
    def dequantized_in_line(self) -> int:
        """Layers dequantized on the compute queue every pass, in line with compute: the held resident ones and
        a compact ring's."""
        return (len(self.resident) if self.resident_held else 0) + (len(self.streamed) if self.compact else 0)

    @property
    def resident_nbytes(self) -> int:
        """Device bytes of one resident layer: its quantized block when held so, else the dense layer."""
        return self.held_nbytes if self.resident_held else self.layer_nbytes

    @property
    def scratch_nbytes(self) -> int:
        """The dense layer that held quantized resident layers and a compact ring's layers dequantize into, one
        for them all (else 0; a split ring's part scratch is in split_nbytes)."""
        return self.layer_nbytes if self.resident_held or (self.compact and not self.split) else 0

    @property
    def device_bytes(self) -> int:
        """Device memory the target's decoder layers take: resident layers (+ their scratch) + ring (+ what a split
        ring keeps between parts)."""
        return (len(self.resident) * self.resident_nbytes + self.scratch_nbytes + self.n_slots * self.ring_slot_nbytes
                + (self.split_nbytes or 0))


def place_layers(n_layers: int, layer_bytes: int, offload: OffloadConfig,
                 layer_budget: Optional[int], slot_bytes: Optional[int] = None,
                 held_bytes: Optional[int] = None, compact: bool = False,
                 split_nbytes: Optional[int] = None) -> Placement:
    """Spend `layer_budget` device bytes on the target's layers: the ring first (n_slots slots of slot_bytes,
    default layer_bytes), then resident layers, first layers first. layer_budget None: nothing resident
    beyond the ring (a CPU device, where cpu/disk offload should really stream).

    held_bytes (a quantized target's block): resident layers are held quantized, held_bytes each, plus one
    dense scratch layer (layer_bytes) they all dequantize into; e.g. a budget of 10 dense bf16 layers and a
    2-slot nf4 ring (slots of 1.28 layers) holds 7 dense or (10 - 2.56 - 1) / 0.28 = 23 held nf4 layers.

    compact (a quantized target; slot_bytes = its block): the slots hold blocks only and the one dense scratch
    layer is paid whether or not a resident layer is held.

    split_nbytes (slot_bytes = the block's largest part; compact too for a quantized target): a split ring,
    paying split_nbytes once, whose offload.n_slots counts layers: it gets as many part slots as hold that many
    layers (n_slots × parts), or the most that fit, at least the minimum."""
    mode = offload.mode
    if mode not in MODES:
        raise InputError(f"unknown offload mode {mode!r} (expected one of {', '.join(MODES)})")
    min_slots = 2 if offload.overlap else 1
    if offload.n_slots < min_slots:
        raise InputError(f"n_slots={offload.n_slots}: streaming needs at least 2 slots (1 only with overlap off)")
    each, scratch = (layer_bytes, 0) if held_bytes is None else (held_bytes, layer_bytes)
    all_layers = n_layers * each + scratch
    if split_nbytes is not None or compact:                             # what the ring itself pays once
        scratch = split_nbytes if split_nbytes is not None else layer_bytes
    paid = compact or split_nbytes is not None
    slot = layer_bytes if slot_bytes is None else slot_bytes
    wanted = offload.n_slots * (len(LAYER_PARTS) if split_nbytes is not None else 1)
    everything = Placement(mode, n_layers, layer_bytes, resident=tuple(range(n_layers)), n_slots=0,
                           held_nbytes=held_bytes)
    if mode == "none":
        if layer_budget is not None and layer_budget < all_layers:
            held = "" if held_bytes is None else " held quantized, with their dequantization scratch"
            raise BudgetError(f"{fmt(layer_budget)} for target layers cannot hold all {n_layers} layers{held} "
                              f"({fmt(all_layers)}): use --offload cpu or disk")
        return everything
    if layer_budget is None:
        return Placement(mode, n_layers, layer_bytes, resident=(), n_slots=wanted, slot_nbytes=slot_bytes,
                         compact=compact, split_nbytes=split_nbytes)
    if layer_budget >= all_layers:     # held quantized, every layer may fit in less than a ring would take
        return everything
    ring_min = min_slots * slot + (scratch if paid else 0)
    if layer_budget < ring_min:
        kept = ("" if not paid or not scratch else
                f" + {fmt(scratch)} kept between parts" if split_nbytes is not None else
                f" + the {fmt(scratch)} dequantization scratch")
        what = "slots of a layer's largest part" if split_nbytes is not None else "slots"
        raise BudgetError(f"{fmt(layer_budget)} for target layers is too small to stream: it needs at least "
                          f"{fmt(ring_min)} ({min_slots} {what} × {fmt(slot)}{kept})")
    n_slots = min(wanted, (layer_budget - (scratch if paid else 0)) // slot)
    room = layer_budget - n_slots * slot - scratch       # the scratch is paid once, by the first held layer
    ring_layers = -(-n_slots // len(LAYER_PARTS)) if split_nbytes is not None else n_slots   # layers the ring holds
    n_resident = max(0, min(room // each, n_layers - ring_layers))
    return Placement(mode, n_layers, layer_bytes, resident=tuple(range(n_resident)), n_slots=n_slots,
                     slot_nbytes=slot_bytes, held_nbytes=held_bytes if n_resident else None, compact=compact,
                     split_nbytes=split_nbytes)


def best_host_layers(n_streamed: int, n_ram: int, block_nbytes: int, pinned_budget: int, staging: int,
                     dequant_s: float = 0.0) -> int:
    """How many of n_streamed layers to hold in host RAM (at most n_ram fit), the rest read from the disk store,
    for the shortest PREDICTED pass on a GPU (transfer_seconds at LINK_GBPS, PAGEABLE_GB_PER_S, DISK_GBPS, the
    layers' dequantization beside the copies dequant_s in all). The
    arena's first layers are pinned (pinned_arena_layers, within the pinned budget less the disk staging while
    any layer is read from disk), its others pageable. A pageable RAM layer is not always better than a disk
    one: past the point where the reads hide under the copies, the drive is the cheaper place for a layer that
    cannot be pinned. Ties keep more in RAM."""
    def seconds(n_host: int) -> float:
        disk = n_streamed - n_host
        pinned = pinned_arena_layers(n_host, block_nbytes, pinned_budget - (staging if disk else 0))
        return transfer_seconds(pinned * block_nbytes, (n_host - pinned) * block_nbytes, disk * block_nbytes,
                                LINK_GBPS, PAGEABLE_GB_PER_S, DISK_GBPS, dequant_s=dequant_s)
    return min(range(n_ram + 1), key=lambda n: (seconds(n), -n))


def split_tiers(placement: Placement, n_host: int) -> Placement:
    """Mode cpu+disk with n_host of the streamed layers held in host RAM. The others, read from the disk store,
    are spread evenly through the pass (the k-th of D at position floor((k + 1/2) S / D) of the S streamed
    layers), so that each disk read overlaps the copies of the host layers before it instead of the reads
    queueing at the pass's end. All of them in RAM is mode cpu; none, mode disk."""
    streamed = placement.streamed
    n_host = max(0, min(n_host, len(streamed)))
    if n_host == len(streamed):
        return replace(placement, mode="cpu", in_host=())
    if n_host == 0:
        return replace(placement, mode="disk", in_host=())
    D = len(streamed) - n_host
    disk = {streamed[int((k + 0.5) * len(streamed) / D)] for k in range(D)}
    return replace(placement, mode="cpu+disk", in_host=tuple(i for i in streamed if i not in disk))


def check_resident_quant(resident_quant: str, quantized: bool) -> None:
    """One line for a --resident-quant that cannot be: unknown, or "on" for a target that is not quantized."""
    if resident_quant not in RESIDENT_QUANTS:
        raise InputError(f"unknown --resident-quant {resident_quant!r}; choose one of {', '.join(RESIDENT_QUANTS)}")
    if resident_quant == "on" and not quantized:
        raise InputError("--resident-quant on holds resident layers quantized: it needs --target-quant int8 or nf4, "
                         "or a published quantized checkpoint (AWQ, GPTQ, compressed-tensors)")


def choose_placement(n_layers: int, layer_bytes: int, offload: OffloadConfig, layer_budget: Optional[int],
                     slot_bytes: Optional[int] = None, held_bytes: Optional[int] = None,
                     resident_quant: str = "auto", split: Optional[tuple[int, int]] = None) -> Placement:
    """place_layers, with a quantized target's resident layers dense or held quantized (held_bytes: its block;
    None for a dense target) as resident_quant says: "on" held, "off" dense, "auto" held only where that keeps
    MORE layers resident (a tie stays dense: a held layer costs a dequantization every pass, a dense one
    nothing). A budget no placement fits raises the BudgetError of the held one.

    Where whole slots do not fit: a quantized target's compact ring; where nothing whole fits, a split ring, as
    `split` gives it: (the slot, its largest part; what it pays once: TargetLayerSizes.split_min's part scratch
    and MLP intermediates). Layers resident beside a split ring are dense (they are few: a split ring is for a
    device that cannot hold two whole layers), whatever resident_quant says."""
    check_resident_quant(resident_quant, quantized=held_bytes is not None)
    try:
        return _choose_held(n_layers, layer_bytes, offload, layer_budget, slot_bytes, held_bytes, resident_quant)
    except BudgetError:
        if offload.mode == "none" or (held_bytes is None and split is None):
            raise
    # Whole slots do not fit: a quantized target's compact ring (blocks only, each dequantized at its use into
    # the shared scratch; its dequantization no longer overlaps compute, the copies still do).
    if held_bytes is not None:
        try:
            return _choose_held(n_layers, layer_bytes, offload, layer_budget, held_bytes, held_bytes, resident_quant,
                                compact=True)
        except BudgetError:
            if split is None:
                raise
    # Nor that: a split ring, each layer streamed in its parts through slots of the largest part (a quantized
    # one compact as well, dequantized at its use into a part-sized scratch).
    return place_layers(n_layers, layer_bytes, offload, layer_budget, split[0], compact=held_bytes is not None,
                        split_nbytes=split[1])


def _choose_held(n_layers: int, layer_bytes: int, offload: OffloadConfig, layer_budget: Optional[int],
                 slot_bytes: Optional[int], held_bytes: Optional[int], resident_quant: str,
                 compact: bool = False) -> Placement:
    """choose_placement with the slots as given: dense or held resident layers as resident_quant says."""
    if held_bytes is None or resident_quant == "off":
        return place_layers(n_layers, layer_bytes, offload, layer_budget, slot_bytes, compact=compact)
    held = place_layers(n_layers, layer_bytes, offload, layer_budget, slot_bytes, held_bytes, compact)
    if resident_quant == "on":
        return held
    try:
        dense = place_layers(n_layers, layer_bytes, offload, layer_budget, slot_bytes, compact=compact)
    except BudgetError:
        return held
    return held if len(held.resident) > len(dense.resident) else dense


@dataclass(frozen=True)
class LayerPlan:
    """How the target's decoder layers are loaded, every choice made: what load.open_target_layers carries out
    (it decides nothing). make_plan builds one for a run; LayerPlan.of for a caller with no memory plan."""
    placement: Placement          # resident layers and ring slots; placement.mode: where the streamed layers live
    quant: str = "none"           # "none" | "int8" | "nf4": the layers stored, moved and dequantized so
    store_dir: Optional[str] = None   # the packed store's folder (disk mode, or any quantized target); else None
    host_budget: Optional[int] = None  # host bytes the arena may pin; None: as many as it needs
    overlap: bool = True          # copy the next layers while computing; False: copy then compute (debug)
    drop_page_cache: bool = True  # disk: drop each piece from the page cache once read
    disk_io: str = "direct"       # disk: "direct" (O_DIRECT where the filesystem takes it) | "buffered"
    embed_on_host: bool = False   # the target's embedding stays in host memory (a lookup of the pass's rows)
    lm_head_on_host: bool = False  # ... and its lm_head: the logits computed in chunks that cross each pass
    scratch_nbytes: int = 0       # the device scratch layers dequantize into (dequant_scratch_nbytes); 0: none

    @property
    def from_store(self) -> bool:
        """The layers are read from a packed store: disk mode, or a target quantized here (once, into it; a
        published quantization is packed from its checkpoint as it is)."""
        return self.placement.mode in ("disk", "cpu+disk") or self.quant in TARGET_QUANTS[1:]

    @property
    def dense_resident(self) -> bool:
        """Every layer stays on the device, dense, read straight from the checkpoint: no store, no ring."""
        return not self.placement.streamed and not self.from_store and self.quant == "none"

    @staticmethod
    def of(cfg: ModelConfig, offload: OffloadConfig, dtype: torch.dtype, *, quant: str = "none",
           resident_quant: str = "auto", store_dir: Optional[str] = None,
           placement: Optional[Placement] = None) -> "LayerPlan":
        """The layer plan of `offload` alone: its mode, and resident layers within its gpu_budget (no budget:
        nothing resident beyond the ring; a budget too small for whole slots: a split or compact ring), unless
        `placement` is given. For tools and tests that load layers without a memory plan (so a split ring's
        intermediates are not counted); a run's plan comes from make_plan."""
        sizes = TargetLayerSizes.of(cfg, dtype, quant)
        if placement is None:
            layout = target_layout(cfg, dtype, quant)
            placement = choose_placement(cfg.n_layers, layout.dense.nbytes, offload, offload.gpu_budget,
                                         slot_bytes=ring_slot_nbytes(layout),
                                         held_bytes=None if quant == "none" else layout.nbytes,
                                         resident_quant=resident_quant,
                                         split=(sizes.part, sizes.part_scratch))
            if placement.mode == "cpu+disk":     # the host tier: the streamed layers offload.host_budget holds
                stride = arena_stride(target_layout(cfg, dtype, quant).nbytes)
                fits = len(placement.streamed) if offload.host_budget is None else offload.host_budget // stride
                placement = split_tiers(placement, fits)
        return LayerPlan(placement, quant, store_dir or offload.store_dir, offload.host_budget, offload.overlap,
                         offload.drop_page_cache, offload.disk_io,
                         scratch_nbytes=dequant_scratch_nbytes(placement, sizes))


def dequant_scratch_nbytes(placement: Placement, sizes: TargetLayerSizes) -> int:
    """The one dense scratch on the device that quantized layers dequantize into: held resident layers and a
    compact ring share a whole layer (Placement.scratch_nbytes); a split compact ring's parts, its largest dense
    part (TargetLayerSizes.part_scratch, counted in its split_nbytes); else 0."""
    return sizes.part_scratch if placement.compact and placement.split else placement.scratch_nbytes
