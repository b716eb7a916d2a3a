"""The memory plan: before anything is allocated, where every byte of a run will live, and whether it fits.

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
  chunk-sized intermediates), a reserve for the allocator and library workspaces; what is left holds the streaming ring and the resident target layers (a quantized
  target's held as their blocks plus one dense scratch layer where that fits more of them: --resident-quant).
Host: the pinned arena (cpu offload) or the staging buffers (disk offload), a transient for loading, and the
  runtime itself; all of it within min(MemAvailable, the cgroup's limit), the pinned part within a safe
  fraction of that (pinned pages cannot be reclaimed: pinning too much is an OOM kill, not a fallback).

Offload "auto" on a GPU: everything resident if it fits, else layers streamed from host RAM if the arena
fits there, else from disk. On a CPU device auto is "none": host RAM is the device already.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Callable, Optional, Union

import psutil
import torch

from offspec.config import (
    AUTO_MAX_TREE_BUDGET,
    LM_HEAD_CHUNK_BYTES,
    ModelConfig,
    OffloadConfig,
    RunLimits,
    RuntimeConfig,
    attention_rows,
)
from offspec.errors import BudgetError, InputError
from offspec.formats.layout import (
    BLOCK_ALIGN,
    LAYER_PARTS,
    N_STAGING,
    LayerLayout,
    arena_stride,
    layer_shapes,
    pinned_arena_layers,
    round_up,
)
from offspec.formats.layout import format_bytes as fmt
from offspec.formats.published import describe as describe_quant
from offspec.formats.published import per_layer_sizes, weight_dtype
from offspec.formats.published import short as short_quant
from offspec.formats.quant import HELD_DRAFT_QUANTS, TARGET_QUANTS, QuantizedLayout, held_matrix_nbytes, target_layout
from offspec.plan.costmodel import LINK_GB_PER_S as LINK_GBPS
from offspec.plan.costmodel import PAGEABLE_GB_PER_S, dequant_seconds

GB = 10**9
GIB = 2**30
MODES = ("none", "cpu", "disk", "cpu+disk")   # cpu+disk: host RAM for what fits, the disk store for the rest
RESIDENT_QUANTS = ("auto", "on", "off")   # a quantized target's resident layers held quantized: where more fit | always | never
MIN_AUTO_TREE_BUDGET = 16       # a short device lowers the auto maximum, halving, down to this
PINNED_FRACTION = 0.8           # default pinned budget: this share of the host memory the run may use
CUDA_RESERVE_MIN = 512 << 20    # allocator fragmentation, cuBLAS / attention workspaces, CUDA graphs: at least
CUDA_RESERVE_FRACTION = 0.04    # ... or this share of the device, whichever is larger
RUNTIME_HOST_BYTES = 1 << 30    # the process itself: Python, torch, tokenizer, page tables
DISK_GBPS = 3.0                 # a PREDICTION input: a PCIe 4.0 NVMe drive's lower end, GB/s (the link: costmodel)
AUTO_CONCURRENCY = 16           # auto concurrency (--concurrency auto): at most this many requests in flight
CONTEXT_STEP = 256              # a refusal's advice names a context that fits in steps of this many tokens


@dataclass(frozen=True)
class ModelSpec:
    """What the plan needs of one model (from config.json and the safetensors headers; no weight is read)."""
    cfg: ModelConfig
    lm_head_stored: bool   # lm_head is its own tensor (untied, or saved anyway); else it shares the embedding
    name: str              # for messages: the folder
    quant: str = "none"    # a published quantization its layers are stored in (published.py), else "none"

    @staticmethod
    def of(ckpt) -> "ModelSpec":
        """From a checkpoint.Checkpoint (headers only is enough)."""
        return ModelSpec(ckpt.config, ckpt.has_lm_head, str(ckpt.path), ckpt.quant)


def published_runtime(target: ModelSpec, runtime: RuntimeConfig) -> RuntimeConfig:
    """The run's target quantization: a published checkpoint's own (no flag needed); --target-quant int8 | nf4
    quantizes a full-precision one only."""
    if target.quant == "none" or runtime.target_quant == target.quant:
        return runtime
    if runtime.target_quant != "none":
        raise InputError(f"{target.name} is already quantized ({describe_quant(target.quant)}): --target-quant "
                         f"{runtime.target_quant} applies to full-precision checkpoints; leave it out")
    return replace(runtime, target_quant=target.quant)


@dataclass(frozen=True)
class Machine:
    kind: str                  # "cuda" | "cpu": a CPU device shares one pool with the host
    device_bytes: int          # device memory the run may use (free memory now, or as given)
    host_bytes: int            # host memory the run may use: min(MemAvailable, cgroup limit - usage), or as given
    host_source: str           # where host_bytes comes from, for messages
    name: str = ""             # the device, for reports

    @staticmethod
    def measure(device: torch.device) -> "Machine":
        """This machine now. On CUDA, the device's free memory (call before allocating anything)."""
        host, source = host_memory_limit()
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return Machine("cuda", int(free), host, source, torch.cuda.get_device_name(device))
        return Machine("cpu", host, host, source, "cpu")

    @staticmethod
    def given(device_bytes: Optional[int], host_bytes: Optional[int]) -> "Machine":
        """A machine described by the user (`models info --device-memory 24GB --host-memory 64GB`); a size
        not given is this machine's. A device size means a GPU of that size."""
        host, source = (host_bytes, "given") if host_bytes is not None else host_memory_limit()
        if device_bytes is None:
            return Machine("cpu", host, host, source, "cpu (this machine)")
        return Machine("cuda", device_bytes, host, source, f"a {device_bytes / GB:.0f} GB GPU")


def host_memory_limit() -> tuple[int, str]:
    """-> (bytes of host memory a run may use, what bounds it): MemAvailable, or less when this process's
    cgroup (v2 memory.max, v1 memory.limit_in_bytes) leaves less. MemAvailable is host-wide: in a container
    only the cgroup knows that the process would be killed long before."""
    available = psutil.virtual_memory().available
    cgroup = _cgroup_available()
    if cgroup is not None and cgroup < available:
        return cgroup, "cgroup memory limit"
    return available, "MemAvailable"


def _cgroup_available() -> Optional[int]:
    """limit - (usage - inactive file pages) of this process's memory cgroup, None when unlimited/unknown."""
    try:
        lines = Path("/proc/self/cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":                                   # v2: 0::/path
            base, names = Path("/sys/fs/cgroup"), ("memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):                # v1: N:memory:/path
            base, names = Path("/sys/fs/cgroup/memory"), ("memory.limit_in_bytes", "memory.usage_in_bytes",
                                                               "total_inactive_file")
        else:
            continue
        # Inside a container the cgroup's own folder is usually mounted as the root: try it, then the root.
        for folder in (base / path.lstrip("/"), base):
            limit_file = folder / names[0]
            if not limit_file.is_file():
                continue
            try:
                text = limit_file.read_text().strip()
                if text == "max" or int(text) >= 1 << 60:
                    return None
                usage = int((folder / names[1]).read_text())
                stat = dict(l.split() for l in (folder / "memory.stat").read_text().splitlines() if " " in l)
                reclaimable = int(stat.get(names[2], 0))
                return max(0, int(text) - (usage - reclaimable))
            except (OSError, ValueError):
                return None
    return None


# ---------------------------------------------------------------- sizes

def itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def layer_nbytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One packed decoder layer (the ring slot, the arena block before page rounding)."""
    return LayerLayout.of(cfg, dtype).nbytes


@dataclass(frozen=True)
class TargetLayerSizes:
    """The bytes of one target layer where it lives (--target-quant changes the first and the last)."""
    resident: int     # a layer on the device for good: dense, in the compute dtype
    block: int        # a layer as stored, pinned, read and moved each pass (quantized or dense)
    slot: int         # a ring slot: the block, plus the dense layer it dequantizes into when quantized
    part: int = 0           # a split ring's slot: the largest part (layout.LAYER_PARTS) of the block
    part_scratch: int = 0   # quantized: the largest dense part, the split ring's parts dequantize into (dense: 0)
    moved: tuple[int, ...] = ()   # bytes a load of each layer copies, by index, where they differ from `block`
                                  # (a GGUF's matrices take their own type's bytes of their piece's reserve)

    def ring_min(self, min_slots: int, split_extra: Optional[int] = 0) -> int:
        """The least device memory a ring takes: min_slots whole slots; a quantized target's compact ring
        (min_slots blocks and the one shared scratch layer; Placement.compact); or a split ring (min_slots part
        slots, the part scratch and split_extra, the MLP's intermediates it keeps; Placement.split). split_extra
        None: whole slots only (a run with no layer budget, whose ring is never made smaller: _split_extra)."""
        whole = min_slots * self.slot
        if split_extra is None:
            return whole
        compact = min_slots * self.block + self.resident if self.block != self.slot else whole
        return min(whole, compact, self.split_min(min_slots, split_extra))

    def split_min(self, min_slots: int, split_extra: int) -> int:
        return min_slots * self.part + self.part_scratch + split_extra

    @staticmethod
    def of(cfg: ModelConfig, dtype: torch.dtype, quant: str) -> "TargetLayerSizes":
        layout = target_layout(cfg, dtype, quant)
        parts = layout.parts(split=True)
        moved = tuple(layout.moved_nbytes(i) for i in range(cfg.n_layers)) if per_layer_sizes(quant) else ()
        return TargetLayerSizes(layout.dense.nbytes, layout.nbytes, ring_slot_nbytes(layout) or layout.nbytes,
                                part=max(p.nbytes for p in parts),
                                part_scratch=max(p.dense.nbytes for p in parts) if quant != "none" else 0,
                                moved=moved)


def moved_by(moved: tuple[int, ...], block_nbytes: int, layers) -> int:
    """Bytes the loads of these layers copy: moved[i] each (TargetLayerSizes.moved), or the whole block each."""
    return sum(moved[i] for i in layers) if moved else len(layers) * block_nbytes


def split_activation_nbytes(cfg: ModelConfig, dtype: torch.dtype, rows: int) -> int:
    """What a split ring keeps between a layer's parts over a pass of `rows` rows (model.PassRows): the
    post-attention norm h (rows, D) and the MLP's intermediate (rows, F)."""
    return rows * (cfg.hidden_size + cfg.intermediate_size) * itemsize(dtype)


def embed_nbytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    return spec.cfg.vocab_size * spec.cfg.hidden_size * itemsize(dtype)


def globals_nbytes(spec: ModelSpec, dtype: torch.dtype) -> int:
    cfg = spec.cfg
    matrices = 2 if spec.lm_head_stored else 1
    return (matrices * cfg.vocab_size * cfg.hidden_size + cfg.hidden_size) * itemsize(dtype)


def int8_copy_nbytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """--draft-quant int8 (quant.Int8Weight): every matrix (N, K) of every layer and lm_head gets N*K int8 + N scales."""
    D, F_, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = [(q, D), (kv, D), (kv, D), (D, q), (F_, D), (F_, D), (D, F_)]
    s = itemsize(dtype)
    layer = sum(n * k + n * s for n, k in per_layer)
    return cfg.n_layers * layer + cfg.vocab_size * (cfg.hidden_size + s)


def draft_weights_nbytes(spec: ModelSpec, dtype: torch.dtype, draft_quant: str = "none") -> int:
    """The draft's weights on the device: dense, or (--draft-quant int8-held | nf4) its layers' matrices held
    quantized (quant.HeldWeight) beside dense norms, biases, embedding and lm_head."""
    cfg = spec.cfg
    if draft_quant not in HELD_DRAFT_QUANTS:
        return cfg.n_layers * layer_nbytes(cfg, dtype) + globals_nbytes(spec, dtype)
    quant = HELD_DRAFT_QUANTS[draft_quant]
    layer = sum(held_matrix_nbytes(quant, shape, dtype) if len(shape) == 2 else math.prod(shape) * itemsize(dtype)
                for shape in layer_shapes(cfg).values())
    return cfg.n_layers * layer + globals_nbytes(spec, dtype)


def largest_matrix_nbytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One layer's largest matrix, dense: what a held draft dequantizes into for a call (a temporary)."""
    return max(math.prod(shape) for shape in layer_shapes(cfg).values() if len(shape) == 2) * itemsize(dtype)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize(dtype)


def activation_nbytes(cfg: ModelConfig, dtype: torch.dtype, rows: int, chunk: int, context: int,
                      fused_attention: bool = False) -> int:
    """The largest forward of `rows` new tokens attending to `context` cache columns, each layer run over
    chunks of `chunk` rows: hidden states of every row, plus one chunk's intermediates, mask and attention
    scores. On a GPU the scores are counted as the math kernel materializes them (float32 scores +
    probabilities) for the query rows one attention call takes (config.attention_rows), an upper bound, since
    which kernel runs a masked grouped-query attention varies with the build; fused_attention (the CPU: its
    kernel works in blocks, measured to add ~0.1 GB for 12 heads x 1024 rows x 32768 columns) counts one float
    copy of the mask instead."""
    s = itemsize(dtype)
    c = max(1, min(rows, chunk))
    D, F_, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    H, H_kv = cfg.n_heads, cfg.n_kv_heads
    hidden = 2 * rows * D * s + 2 * rows * hd * (s + 4)                    # x + residual; RoPE cos/sin
    chunk_work = c * (3 * D + 2 * (H + 2 * H_kv) * hd + 3 * F_) * s        # norms, q/k/v (+roped), attn out, MLP
    mask = c * context                                                      # bool
    scores = c * context * 4 if fused_attention else H * min(c, attention_rows(H, context, s)) * context * (4 + s)
    return hidden + chunk_work + mask + scores


def logits_nbytes(target: ModelConfig, draft: Optional[ModelConfig], dtype: torch.dtype, tree_budget: int,
                  sampling: bool) -> int:
    """The largest of: the verification pass's tree logits ((N, V) in dtype, then float32), and a draft call
    over a whole level (logits + processed float32 distributions); plus, at T > 0, the draft distributions
    every expanded node keeps for verification ((V,) float32 each, at the target's width)."""
    s = itemsize(dtype)
    rows = tree_budget + 1
    verify = rows * target.vocab_size * (s + 4)
    drafting = rows * draft.vocab_size * (s + 8) if draft is not None else 0
    kept = rows * target.vocab_size * 4 if (sampling and draft is not None) else 0
    return max(verify, drafting) + kept


# ---------------------------------------------------------------- placement: the target's layers
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
    layers' dequantization on the copy stream dequant_s in all). The
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


def transfer_seconds(pinned: int, pageable: int, disk: int, link_gb_per_s: float, pageable_gb_per_s: float,
                     disk_gb_per_s: Optional[float], disk_read: Optional[int] = None, dequant_s: float = 0.0) -> float:
    """PREDICTION: a pass's transfer from its bytes by tier. Pinned and disk-staged bytes cross the link at its
    rate and pageable ones at pageable_gb_per_s, one after another on the copy stream, where each quantized
    layer's dequantization follows its copy (dequant_s in all); the drive reads disk_read bytes (default: disk;
    the store reads whole blocks where a copy may move less of them), the reads overlapping the copies:
    max(copies + dequant_s, disk_read / drive)."""
    copies = (pinned + disk) / link_gb_per_s + pageable / min(link_gb_per_s, pageable_gb_per_s)
    read = disk if disk_read is None else disk_read
    return max(copies / GB + dequant_s, read / disk_gb_per_s / GB if disk_gb_per_s else 0.0)


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
        if placement is None:
            layout = target_layout(cfg, dtype, quant)
            sizes = TargetLayerSizes.of(cfg, dtype, quant)
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
                         offload.drop_page_cache, offload.disk_io)


def ring_slot_nbytes(layout: Union[LayerLayout, QuantizedLayout]) -> Optional[int]:
    """Device bytes of one ring slot for this layout: None for a dense layer (the layer itself); a quantized
    layer's block plus the dense layer it is dequantized into."""
    return None if layout.quant == "none" else layout.nbytes + layout.dense.nbytes


# ---------------------------------------------------------------- the plan

@dataclass(frozen=True)
class PlanItem:
    where: str        # "device" | "host"
    what: str         # what the bytes are for
    nbytes: int
    note: str = ""    # how it was counted


@dataclass(frozen=True)
class MemoryPlan:
    machine: Machine
    context: int                  # tokens per sequence in both KV caches (capped at the models' context)
    tree_budget: int              # largest tree a pass may verify
    prefill_chunk: int            # rows per layer call
    concurrency: int              # requests in flight at once: KV-cache rows, trees per pass (auto resolved)
    layers: LayerPlan             # the target's layers: placement, store folder, pinned budget (loading obeys it)
    layer_budget: int             # device bytes that were available for the ring and resident layers
    host_pinned: bool             # the arena / staging will be pinned (CUDA only)
    items: tuple[PlanItem, ...]
    notes: tuple[str, ...] = ()   # decisions worth a line in the report (pageable fallback, auto mode, ...)
    streamed_bytes: int = 0       # weight bytes moved per target pass
    block_nbytes: int = 0         # one target layer as stored and moved (quantized or dense)
    concurrency_auto: bool = False  # concurrency was auto: `concurrency` is the most rows in flight, and the
                                    # measured costs may keep fewer (Engine.run_batch's adapt_rows)
    host_head_bytes: int = 0        # an lm_head kept in host memory: bytes crossing (pageable) every pass
    pinned_layers: int = 0          # of the host arena's layers, the first this many are pinned (the rest pageable)
    pinned_budget: int = 0          # host bytes that may be pinned (the arena's share of it, less any disk
                                    # staging, is layers.host_budget)
    layer_moved: tuple[int, ...] = ()   # TargetLayerSizes.moved: bytes each layer's load copies, where they differ

    def moved_by(self, layers) -> int:
        """Bytes the loads of these target layers copy (block_nbytes each, unless layer_moved says otherwise)."""
        return moved_by(self.layer_moved, self.block_nbytes, layers)

    @property
    def disk_read_bytes(self) -> int:
        """Bytes a pass reads from the disk store: its layers' whole blocks, each BLOCK_ALIGN-rounded."""
        return len(self.placement.disk_layers) * round_up(self.block_nbytes, BLOCK_ALIGN)

    @property
    def placement(self) -> Placement:
        """Resident layers and ring."""
        return self.layers.placement

    @property
    def mode(self) -> str:
        """The offload mode that runs ("auto" resolved)."""
        return self.placement.mode

    @property
    def target_quant(self) -> str:
        """"none" | "int8" | "nf4": how the target's layers are stored and moved."""
        return self.layers.quant

    def total(self, where: str) -> int:
        return sum(i.nbytes for i in self.items if i.where == where)

    def layers_line(self) -> str:
        p = self.placement
        quantized, quant = self.target_quant != "none", short_quant(self.target_quant)
        held = f" (held {quant}, each dequantized every pass)" if p.resident_held else ""
        if not p.streamed:
            return (f"all {p.n_layers} target layers resident on the device"
                    + (held or (f" (the {quant} target, dequantized)" if quantized else "")))
        n_host = len(p.host_layers)
        pinned = ("pinned" if self.pinned_layers == n_host and self.machine.kind == "cuda" else
                  f"{self.pinned_layers} pinned, {n_host - self.pinned_layers} pageable" if self.pinned_layers else
                  "pageable")
        ram = f"host RAM ({pinned})"
        source = {"cpu": ram, "disk": "the disk store",
                  "cpu+disk": f"{ram} ({len(p.host_layers)} layers) and the disk store ({len(p.disk_layers)} layers, "
                              f"spread through the pass)"}[self.mode]
        resident = f"layers {_ranges(p.resident)} resident{held}, " if p.resident else "no layer resident, "
        moved = (f"{fmt(self.streamed_bytes / len(p.streamed))} moved per layer on average, of "
                 f"{fmt(self.block_nbytes)} blocks" if self.layer_moved else f"{fmt(self.block_nbytes)} moved per layer")
        per_layer = (f"{quant}: {moved}, {fmt(p.layer_nbytes)} dequantized" if quantized else
                     f"{fmt(p.layer_nbytes)} per layer")
        slots = f"{p.n_slots} slots of a layer's parts" if p.split else f"{p.n_slots} slots"
        return f"{resident}layers {_ranges(p.streamed)} streamed from {source} through {slots} ({per_layer})"

    def describe(self) -> str:
        """The plan as a table: every item with its size, the totals against what the machine has."""
        m = self.machine
        shared = m.kind == "cpu"
        target = f", target {short_quant(self.target_quant)}" if self.target_quant != "none" else ""
        rows = ""
        if self.concurrency > 1 or self.concurrency_auto:
            rows = f", {self.concurrency} requests in flight" + (" (auto)" if self.concurrency_auto else "")
        lines = [f"memory plan: {m.name or m.kind}, offload {self.mode}{target}, context {self.context} tokens, tree budget "
                 f"≤ {self.tree_budget}, prefill chunk {self.prefill_chunk}{rows}"]
        for where in ("device", "host"):
            items = [i for i in self.items if i.where == where]
            if not items:
                continue
            label = "device (host RAM: the CPU is the device)" if (where == "device" and shared) else where
            lines.append(f"  {label}")
            for i in items:
                note = f"  ({i.note})" if i.note else ""
                lines.append(f"    {i.what:<38} {fmt(i.nbytes):>10}{note}")
        if shared:
            lines.append(f"  total {fmt(self.total('device') + self.total('host'))} of {fmt(m.host_bytes)} "
                         f"host memory ({m.host_source})")
        else:
            lines.append(f"  device total {fmt(self.total('device'))} of {fmt(m.device_bytes)}; host total "
                         f"{fmt(self.total('host'))} of {fmt(m.host_bytes)} ({m.host_source}), pinned budget "
                         f"{fmt(self.pinned_budget)}")
        lines.append(f"  {self.layers_line()}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"].pop("placement")                     # given below, with its derived fields
        d.update(mode=self.mode, target_quant=self.target_quant)
        d["placement"] = {"mode": self.placement.mode, "resident": list(self.placement.resident),
                          "streamed": list(self.placement.streamed), "n_slots": self.placement.n_slots,
                          "host": list(self.placement.host_layers), "disk": list(self.placement.disk_layers),
                          "layer_nbytes": self.placement.layer_nbytes,
                          "slot_nbytes": self.placement.ring_slot_nbytes,
                          "resident_held": self.placement.resident_held,
                          "resident_nbytes": self.placement.resident_nbytes,
                          "scratch_nbytes": self.placement.scratch_nbytes,
                          "compact": self.placement.compact, "split": self.placement.split}
        d["device_total"], d["host_total"] = self.total("device"), self.total("host")
        d["layers_line"] = self.layers_line()
        return d


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
        plan = _plan_concurrency(target, draft, offload, runtime, limits, machine, store_dir)
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
    shared = machine.kind == "cpu"
    min_slots = 2 if offload.overlap else 1
    ring = TargetLayerSizes.of(target.cfg, runtime.dtype, runtime.target_quant).ring_min(
        min_slots, _split_extra(target, runtime, limits, context, machine, offload))
    pool = machine.host_bytes if shared else machine.device_bytes
    notes: list[str] = []
    if draft is None or limits.tree_budget is not None:
        tree_budget = 0 if draft is None else limits.tree_budget   # no draft: plain decoding, no trees
        fixed = _fixed_device_items(target, draft, runtime, limits, machine, context, tree_budget, on_host)
    else:
        tree_budget = min(AUTO_MAX_TREE_BUDGET, context)
        while True:
            fixed = _fixed_device_items(target, draft, runtime, limits, machine, context, tree_budget, on_host)
            if pool - _device_bytes(fixed) >= ring or tree_budget <= MIN_AUTO_TREE_BUDGET:
                break
            tree_budget //= 2
        if tree_budget < min(AUTO_MAX_TREE_BUDGET, context):
            notes.append(f"auto tree budget capped at {tree_budget} nodes: larger trees' logits do not fit")
    plan = _place(target, offload, runtime, machine, context, tree_budget, limits, fixed, notes, store_dir)
    if not on_host:
        return plan
    matrix = embed_nbytes(target, runtime.dtype)
    head = "lm_head" in on_host
    note = (f"the target's embedding ({fmt(matrix)}) stays in host memory: the device holds layers instead"
            if not head else f"the target's embedding and lm_head ({fmt(2 * matrix)}) stay in host memory: the "
            f"lm_head crosses in {fmt(min(LM_HEAD_CHUNK_BYTES, matrix))} chunks every pass (the run fits only so)")
    return replace(plan, layers=replace(plan.layers, embed_on_host=True, lm_head_on_host=head),
                   notes=plan.notes + (note,), host_head_bytes=matrix if head else 0)


def _split_extra(target: ModelSpec, runtime: RuntimeConfig, limits: RunLimits, context: int, machine: Machine,
                 offload: OffloadConfig) -> Optional[int]:
    """What a split ring would keep between parts (split_activation_nbytes over the largest pass); None where no
    ring is made smaller than whole slots: a CPU run with no --gpu-budget streams everything through whole slots."""
    if machine.kind == "cpu" and offload.gpu_budget is None:
        return None
    return split_activation_nbytes(target.cfg, runtime.dtype, limits.concurrency * context)


def _fixed_device_items(target: ModelSpec, draft: Optional[ModelSpec], runtime: RuntimeConfig, limits: RunLimits,
                        machine: Machine, context: int, tree_budget: int, on_host: tuple[str, ...]) -> list[PlanItem]:
    """Every device item but the target's decoder layers (and the target's globals that stay on the host, as
    host items: on_host names them, "embed" and "lm_head")."""
    dtype = runtime.dtype
    fixed: list[PlanItem] = []
    if draft is not None:
        held = runtime.draft_quant in HELD_DRAFT_QUANTS
        fixed.append(PlanItem("device", "draft weights", draft_weights_nbytes(draft, dtype, runtime.draft_quant),
                              Path(draft.name).name + (f", layers held {runtime.draft_quant}" if held else "")))
        if runtime.draft_quant == "int8":
            fixed.append(PlanItem("device", "draft int8 copy", int8_copy_nbytes(draft.cfg, dtype),
                                  "--draft-quant int8"))
        if held:
            fixed.append(PlanItem("device", "draft dequantization temporary", largest_matrix_nbytes(draft.cfg, dtype),
                                  "one dense matrix a call"))
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
    act = max(activation_nbytes(m.cfg, dtype, B * context, limits.prefill_chunk, context, machine.kind == "cpu")
              for m in ([target] + ([draft] if draft else [])))
    fixed.append(PlanItem("device", "activations of the largest forward", act,
                          f"{B * context} rows in chunks of {min(B * context, limits.prefill_chunk)}"))
    if machine.kind == "cpu":
        fixed.append(PlanItem("device", "runtime (Python, torch, tokenizer)", RUNTIME_HOST_BYTES))
    else:
        reserve = max(CUDA_RESERVE_MIN, int(CUDA_RESERVE_FRACTION * machine.device_bytes))
        fixed.append(PlanItem("device", "reserve (allocator, workspaces)", reserve))
    return fixed


def _device_bytes(items: list[PlanItem]) -> int:
    return sum(i.nbytes for i in items if i.where == "device")


def _place(target: ModelSpec, offload: OffloadConfig, runtime: RuntimeConfig, machine: Machine, context: int,
           tree_budget: int, limits: RunLimits, fixed: list[PlanItem], notes: list[str],
           store_dir: Optional[str] = None) -> MemoryPlan:
    """Given the fixed device items, place the target's layers and the host side, or refuse."""
    shared = machine.kind == "cpu"
    fixed_bytes = _device_bytes(fixed)

    # ---- the target's layers
    sizes = TargetLayerSizes.of(target.cfg, runtime.dtype, runtime.target_quant)
    L, B, slot = sizes.resident, sizes.block, sizes.slot
    split_extra = _split_extra(target, runtime, limits, context, machine, offload)
    quant = runtime.target_quant
    n_layers = target.cfg.n_layers
    held = B if quant != "none" else None     # a resident layer held quantized: its block (+ one scratch layer)
    # Every layer resident, as small as --resident-quant allows: dense, or held quantized with one scratch layer.
    if held is None or runtime.resident_quant == "off":
        all_layers = n_layers * L
    elif runtime.resident_quant == "on":
        all_layers = n_layers * B + L
    else:
        all_layers = min(n_layers * L, n_layers * B + L)
    host_runtime = 0 if shared else RUNTIME_HOST_BYTES
    host_fixed = host_runtime + sum(i.nbytes for i in fixed if i.where == "host")   # (a target global kept there)
    loading = max(L, embed_nbytes(target, runtime.dtype))                 # one layer or the embedding, on the host
    arena = lambda streamed: streamed * arena_stride(B)                   # noqa: E731
    staging = N_STAGING * round_up(B, BLOCK_ALIGN)
    pool = machine.host_bytes if shared else machine.device_bytes
    left = pool - fixed_bytes - (loading if shared else 0)

    if offload.host_budget is not None and offload.host_budget > machine.host_bytes:
        raise BudgetError(f"--host-budget {fmt(offload.host_budget)} is more than the host memory this run may use "
                          f"({fmt(machine.host_bytes)}, {machine.host_source})")
    pinned_budget = offload.host_budget if offload.host_budget is not None else int(PINNED_FRACTION * machine.host_bytes)

    if left < 0:
        what = "host memory" if shared else f"the device's {fmt(machine.device_bytes)}"
        raise BudgetError(f"{what} cannot hold the run before any target layer: "
                          + ", ".join(f"{i.what} {fmt(i.nbytes)}" for i in fixed if i.where == "device")
                          + f" = {fmt(fixed_bytes)}; lower --context or --tree-budget, or use a smaller draft")

    mode = offload.mode
    if mode == "auto":
        mode = _auto_mode(shared, left, all_layers, arena(n_layers), loading + host_fixed, machine, offload,
                          pinned_budget - staging)
        notes.append(f"offload auto -> {mode}")

    if offload.gpu_budget is not None and offload.gpu_budget > left:
        raise BudgetError(f"--gpu-budget {fmt(offload.gpu_budget)} is more than the device leaves for target layers: "
                          f"{fmt(pool)} {'host memory' if shared else 'free'} − {fmt(fixed_bytes)} for the draft, "
                          f"globals, caches, logits, activations and reserve = {fmt(left)}; use --gpu-budget "
                          f"{_floor_gb(left)} or less")
    if mode == "none":
        budget = offload.gpu_budget if offload.gpu_budget is not None else left
        if all_layers > budget:
            raise BudgetError(f"the target's {n_layers} layers ({fmt(all_layers)}) do not fit in the {fmt(budget)} "
                              f"the {'machine' if shared else 'device'} leaves for them: use --offload "
                              f"{'disk' if shared else 'cpu or disk'}")
    else:
        min_slots = 2 if offload.overlap else 1
        ring = sizes.ring_min(min_slots, split_extra)
        if left < min(ring, all_layers):     # (held quantized, all layers may take less than a ring)
            split_min = None if split_extra is None else sizes.split_min(min_slots, split_extra)
            small = "split" if ring == split_min else "compact"
            compact = "" if ring == min_slots * slot else f" or a {small} ring of {fmt(ring)}"
            raise BudgetError(f"{fmt(left)} is all the {'machine' if shared else 'device'} leaves for target layers "
                              f"(of {fmt(pool)}: {fmt(fixed_bytes)} go to the draft, globals, caches, logits, "
                              f"activations and reserve), too little for {min_slots} streaming slots of {fmt(slot)}"
                              f"{compact}; lower --context or --tree-budget, or use a smaller draft")
        # On a CPU device, with no budget given, nothing stays resident: cpu/disk offload should really stream.
        budget = offload.gpu_budget if offload.gpu_budget is not None else (None if shared else left)
    placement = choose_placement(n_layers, L, replace(offload, mode=mode), budget,
                                 slot_bytes=slot if quant != "none" else None, held_bytes=held,
                                 resident_quant=runtime.resident_quant,
                                 split=None if split_extra is None else (sizes.part, sizes.part_scratch + split_extra))
    if placement.mode == "cpu+disk":
        # The host tier holds what fits beside everything else on the host (the disk staging included); on a
        # GPU its first layers are pinned, within the pinned budget, and the rest pageable, as many as make the
        # pass shortest (best_host_layers); the others are read from the disk store.
        room = machine.host_bytes - loading - host_fixed - staging
        room -= fixed_bytes + placement.device_bytes if shared else 0
        if shared and offload.host_budget is not None:        # (a CPU device pins nothing: a given budget caps it)
            room = min(room, offload.host_budget - staging)
        n_ram = max(room, 0) // arena_stride(B)
        if not shared:
            n_ram = best_host_layers(len(placement.streamed), min(n_ram, len(placement.streamed)), B,
                                     pinned_budget, staging, copy_stream_dequant_seconds(placement, quant))
        placement = split_tiers(placement, n_ram)
        mode = placement.mode
        notes.append(f"{len(placement.host_layers)} streamed layers in host RAM, {len(placement.disk_layers)} read "
                     f"from the disk store" if mode == "cpu+disk" else f"offload cpu+disk -> {mode}")

    items = list(fixed)
    if placement.n_slots:
        items.append(PlanItem("device", f"ring: {placement.n_slots} slots",
                              placement.n_slots * placement.ring_slot_nbytes, _ring_note(placement, quant, L, B)))
    if placement.split:
        items.append(PlanItem("device", "MLP intermediates between parts", split_extra,
                              f"{limits.concurrency * context} rows × (hidden + intermediate)"))
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
    n_host = len(placement.host_layers)
    arena_budget = pinned_budget - (staging if placement.disk_layers else 0)   # the staging buffers pin first
    pinned_layers = 0 if shared else pinned_arena_layers(n_host, B, arena_budget)
    host_pinned = not shared and pinned_layers == n_host and (bool(n_host) or bool(placement.disk_layers))
    if placement.host_layers:
        nbytes = arena(n_host)
        note = ("pinned" if pinned_layers == n_host else
                "pageable: the CPU is the device" if shared else
                f"{pinned_layers} layers pinned (the pinned budget {fmt(arena_budget)}), {n_host - pinned_layers} "
                f"pageable, copied about {LINK_GBPS / PAGEABLE_GB_PER_S:.0f}x slower")
        items.append(PlanItem("host", f"host arena ({n_host} layers)", nbytes, note))
        if not shared and pinned_layers < n_host:
            notes.append(f"the host arena ({fmt(nbytes)}) is over the pinned budget ({fmt(arena_budget)}): "
                         f"{n_host - pinned_layers} of its layers are pageable (--host-budget sets the budget)")
    if placement.disk_layers:
        items.append(PlanItem("host", "disk staging buffers", staging, f"{N_STAGING} × {fmt(B)}"))
    items.append(PlanItem("host", "loading (transient)", loading, "one layer or the embedding at a time"))
    if not shared:
        items.append(PlanItem("host", "runtime (Python, torch, tokenizer)", host_runtime))

    host_total = sum(i.nbytes for i in items if i.where == "host") + (fixed_bytes + placement.device_bytes
                                                                       if shared else 0)
    if host_total > machine.host_bytes:
        fix = ("use --offload auto (what fits in RAM, the rest read from disk) or disk" if mode == "cpu" else
               "lower --context or --tree-budget")
        raise BudgetError(f"the run needs {fmt(host_total)} of host memory but {fmt(machine.host_bytes)} is available "
                          f"({machine.host_source}): {fix}")
    layers = LayerPlan(placement, quant, offload.store_dir or store_dir, arena_budget, offload.overlap,
                       offload.drop_page_cache, offload.disk_io)
    if not layers.from_store:
        layers = replace(layers, store_dir=None)           # no store is read: name no folder
    return MemoryPlan(machine=machine, context=context, tree_budget=tree_budget,
                      prefill_chunk=limits.prefill_chunk, concurrency=limits.concurrency, layers=layers,
                      layer_budget=left if offload.gpu_budget is None else offload.gpu_budget,
                      host_pinned=host_pinned, items=tuple(items), notes=tuple(notes),
                      streamed_bytes=moved_by(sizes.moved, B, placement.streamed), block_nbytes=B, layer_moved=sizes.moved,
                      pinned_layers=pinned_layers,
                      pinned_budget=pinned_budget)


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


def _auto_mode(shared: bool, left: int, all_layers: int, full_arena: int, host_fixed: int, machine: Machine,
               offload: OffloadConfig, pinnable: int) -> str:
    """none if every layer fits on the device; else cpu if the whole arena fits in the pinned budget; else
    cpu+disk, whose host tier _place sizes for the shortest predicted pass (best_host_layers: pinned, then
    pageable RAM, then the disk store; all in RAM resolves to cpu, none to disk)."""
    if shared:
        return "none"
    budget = offload.gpu_budget if offload.gpu_budget is not None else left
    if all_layers <= budget:
        return "none"
    if full_arena + host_fixed <= machine.host_bytes and full_arena <= pinnable:
        return "cpu"
    return "cpu+disk"


def predicted_pass_seconds(plan: MemoryPlan, link_gb_per_s: float, disk_gb_per_s: Optional[float] = None,
                           pageable_gb_per_s: float = PAGEABLE_GB_PER_S) -> float:
    """PREDICTION: the copy stream's time in one target pass (copies overlap compute, so this is its floor when
    streaming dominates): transfer_seconds of its bytes by tier (on a GPU the arena's layers past its pinned ones
    are pageable: the driver stages them through a bounce buffer) and of the streamed layers' dequantization
    (streamed_dequant_seconds), plus an lm_head kept in host memory, whose pageable chunks cross after the layers
    (not overlapped)."""
    p = plan.placement
    pageable = plan.moved_by(p.host_layers[plan.pinned_layers:]) if plan.machine.kind == "cuda" else 0
    disk = plan.moved_by(p.disk_layers)
    return (transfer_seconds(plan.streamed_bytes - pageable - disk, pageable, disk, link_gb_per_s, pageable_gb_per_s,
                             disk_gb_per_s, plan.disk_read_bytes, streamed_dequant_seconds(plan))
            + plan.host_head_bytes / (min(link_gb_per_s, pageable_gb_per_s) * GB))


def streamed_dequant_seconds(plan: MemoryPlan) -> float:
    """PREDICTION: the dequantization of a pass's streamed layers on a GPU's copy stream, each right after its
    copy (costmodel.dequant_seconds, measured; 0 for a dense target, a CPU, or a compact ring, whose layers
    dequantize on the compute queue instead: Placement.dequantized_in_line)."""
    return copy_stream_dequant_seconds(plan.placement, plan.target_quant) if plan.machine.kind == "cuda" else 0.0


def copy_stream_dequant_seconds(placement: Placement, quant: str) -> float:
    """PREDICTION: a GPU's dequantization of `placement`'s streamed layers, stored in `quant`, on the copy stream
    (0 for a compact ring's, which dequantize on the compute queue)."""
    if placement.compact:
        return 0.0
    return len(placement.streamed) * dequant_seconds(short_quant(quant), placement.layer_nbytes)


# ---------------------------------------------------------------- formatting

def _floor_gb(n: int) -> str:
    return f"{math.floor(n / GB * 10) / 10:g}GB" if n >= GB else f"{max(n // 10**6, 0)}MB"


def _ranges(layers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5, 6) -> '0–2, 5–6'."""
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(f"{start}" if start == layer else f"{start}–{layer}")
            start = None
    return ", ".join(out)
