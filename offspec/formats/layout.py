"""How one model's weights are laid out: the per-layer weight record, its packed byte layout, the globals.

The bottom floor of the package: the forward (model.py), checkpoint reading, the weight stores and the
memory plan all speak these types, and this module imports none of them.
"""
from __future__ import annotations

import math
import mmap
from dataclasses import dataclass
from typing import Optional

import torch

from offspec.config import ModelConfig

PAGE_BYTES = mmap.PAGESIZE   # host page size: mappings start on it, pinned pieces must too
PIN_CHUNK_BYTES = 1 << 30     # a host arena is pinned in pieces of about this size (whole layers each)


def format_bytes(n: float) -> str:
    """Bytes for people, in decimal units as memory and GPUs are sold and as --gpu-budget 24GB reads them:
    1.5e9 -> '1.50 GB', 3e8 -> '300 MB'."""
    if abs(n) >= 1e9:
        return f"{n / 1e9:.2f} GB"
    if abs(n) >= 1e6:
        return f"{n / 1e6:.0f} MB"
    return f"{n / 1e3:.0f} kB"


@dataclass
class LayerWeights:
    """One decoder layer. Linear weights are (out, in) as in the checkpoint."""
    input_norm: torch.Tensor                 # (D,)
    q_proj: torch.Tensor                     # (H*hd, D)
    k_proj: torch.Tensor                     # (H_kv*hd, D)
    v_proj: torch.Tensor                     # (H_kv*hd, D)
    o_proj: torch.Tensor                     # (D, H*hd)
    post_norm: torch.Tensor                  # (D,)
    gate_proj: torch.Tensor                  # (F, D)
    up_proj: torch.Tensor                    # (F, D)
    down_proj: torch.Tensor                  # (D, F)
    q_bias: Optional[torch.Tensor] = None    # (H*hd,)   Qwen2 only
    k_bias: Optional[torch.Tensor] = None    # (H_kv*hd,)
    v_bias: Optional[torch.Tensor] = None    # (H_kv*hd,)
    q_norm: Optional[torch.Tensor] = None    # (hd,)     Qwen3 only
    k_norm: Optional[torch.Tensor] = None    # (hd,)
    part: str = "layer"                      # WHOLE: every tensor above; or a key of LAYER_PARTS: only that
                                             # part's tensors, the others None (a split ring's slot, PartLayout)


WHOLE = "layer"
# A layer split into parts that stream through slots smaller than it, in the order the forward uses them
# (model.run_layer): each part's LayerWeights fields. A 70B layer's largest part (gate, up or down) is 470 MB of
# its 1.71 GB.
LAYER_PARTS = {
    "attention": ("input_norm", "q_proj", "k_proj", "v_proj", "o_proj", "q_bias", "k_bias", "v_bias", "q_norm",
                  "k_norm"),
    "gate": ("post_norm", "gate_proj"),
    "up": ("up_proj",),
    "down": ("down_proj",),
}


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The shape of every tensor of one layer, in packing order."""
    D, F_, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.n_heads * hd, cfg.n_kv_heads * hd
    shapes = {
        "input_norm": (D,), "q_proj": (q, D), "k_proj": (kv, D), "v_proj": (kv, D), "o_proj": (D, q),
        "post_norm": (D,), "gate_proj": (F_, D), "up_proj": (F_, D), "down_proj": (D, F_),
    }
    if cfg.attention_bias:
        shapes.update(q_bias=(q,), k_bias=(kv,), v_bias=(kv,))
    if cfg.qk_norm:
        shapes.update(q_norm=(hd,), k_norm=(hd,))
    return shapes


def matrix_params(cfg: ModelConfig) -> int:
    """Weights in one layer's matrices (what a pass's compute scales with)."""
    return sum(a * b for a, b in (shape for shape in layer_shapes(cfg).values() if len(shape) == 2))


TENSOR_ALIGN = 256  # bytes; every tensor inside a packed layer starts on this boundary (CUDA likes ≥256)
BLOCK_ALIGN = 4096  # bytes; a layer block in the disk store starts and ends on this boundary (page cache, O_DIRECT)
N_STAGING = 2       # pinned staging buffers a disk store reads into: one being read while the other is copied out


@dataclass(frozen=True)
class LayerLayout:
    """Where each tensor of a layer sits inside one flat uint8 block, so that moving a layer is one copy."""
    dtype: torch.dtype
    entries: tuple[tuple[str, tuple[int, ...], int], ...]   # (name, shape, byte offset)
    nbytes: int                                             # block size, a multiple of TENSOR_ALIGN

    quant = "none"   # a dense block; quant.QuantizedLayout is the quantized one, with the same interface

    @property
    def dense(self) -> "LayerLayout":
        """The layout the forward reads: this one (a quantized layout dequantizes into its `dense`)."""
        return self

    def describe(self) -> list:
        """The layout as JSON values (the disk store's manifest records it)."""
        return [[name, list(shape), offset] for name, shape, offset in self.entries]

    @staticmethod
    def of(cfg: ModelConfig, dtype: torch.dtype) -> "LayerLayout":
        itemsize = torch.empty((), dtype=dtype).element_size()
        entries, offset = [], 0
        for name, shape in layer_shapes(cfg).items():
            entries.append((name, shape, offset))
            offset += round_up(math.prod(shape) * itemsize, TENSOR_ALIGN)
        return LayerLayout(dtype=dtype, entries=tuple(entries), nbytes=offset)

    def views(self, block: torch.Tensor) -> LayerWeights:
        """LayerWeights whose tensors are views into `block` (uint8, (nbytes,)); nothing is copied."""
        return LayerWeights(**_views(block, self.dtype, self.entries, self.nbytes))

    def parts(self, split: bool) -> tuple["PartLayout", ...]:
        """How a ring slot holds this layer: whole (one part, the block as it is), or split into LAYER_PARTS,
        each its tensors' byte runs of the block packed one after another from the slot's start."""
        if not split:
            return (PartLayout(WHOLE, self.dtype, ((0, 0, self.nbytes),), self.entries, self.nbytes),)
        return tuple(PartLayout(part, self.dtype, runs, entries, nbytes)
                     for part, (runs, entries, nbytes) in split_entries(self.entries, self.nbytes).items())

    def pack(self, weights: dict[str, torch.Tensor], block: torch.Tensor) -> None:
        """Copy named tensors (any dtype, cast here) into their places in `block`; padding is zeroed."""
        block.zero_()
        views = self.views(block)
        for name, shape, _ in self.entries:
            src = weights[name]
            if tuple(src.shape) != shape:
                raise ValueError(f"{name}: expected shape {shape}, got {tuple(src.shape)}")
            getattr(views, name).copy_(src)


def split_entries(entries: tuple, nbytes: int) -> dict[str, tuple[tuple, tuple, int]]:
    """A block's entries ((name, shape, byte offset, ...), in block order; a name's field is what comes before
    any "."), grouped by LAYER_PARTS -> {part: (runs, entries, nbytes)}: the byte runs to copy into a slot
    ((block offset, slot offset, nbytes), adjacent entries merged into one), the part's entries with their slot
    offsets, and the slot bytes they take."""
    ends = [entry[2] for entry in entries[1:]] + [nbytes]          # each entry runs up to the next one
    parts = {}
    for part, names in LAYER_PARTS.items():
        runs: list[list[int]] = []
        moved, at = [], 0
        for entry, end in zip(entries, ends):
            if entry[0].split(".")[0] not in names:
                continue
            start = entry[2]
            if runs and runs[-1][0] + runs[-1][2] == start:
                runs[-1][2] += end - start
            else:
                runs.append([start, at, end - start])
            moved.append((entry[0], entry[1], at, *entry[3:]))
            at += end - start
        parts[part] = (tuple(map(tuple, runs)), tuple(moved), at)
    return parts


def _views(block: torch.Tensor, dtype: torch.dtype, entries, nbytes: int) -> dict[str, torch.Tensor]:
    """{name: view of `block` ((nbytes,) uint8) as that entry's shape and dtype} for (name, shape, offset) entries."""
    assert block.dtype == torch.uint8 and block.numel() >= nbytes
    typed = block[:nbytes].view(dtype)
    itemsize = typed.element_size()
    return {name: typed[offset // itemsize: offset // itemsize + math.prod(shape)].view(shape)
            for name, shape, offset in entries}


@dataclass(frozen=True)
class PartLayout:
    """One part of a layer as a ring slot holds it (LayerLayout.parts): some of the block's tensors, copied run
    by run into the slot, whose views give a LayerWeights carrying that part only."""
    part: str                                        # WHOLE, or a key of LAYER_PARTS
    dtype: torch.dtype
    runs: tuple[tuple[int, int, int], ...]           # (block offset, slot offset, nbytes): one copy each
    entries: tuple[tuple[str, tuple[int, ...], int], ...]   # (name, shape, byte offset in the slot)
    nbytes: int                                      # bytes of the slot it fills

    @property
    def dense(self) -> "PartLayout":
        """What the consumer reads: this part itself (a quantized part dequantizes into its `dense`)."""
        return self

    def runs_for(self, layer: Optional[int]) -> tuple[tuple[int, int, int], ...]:
        """The runs a load of `layer` copies: all of them (a GGUF quantized part may copy less)."""
        return self.runs

    def views(self, slot: torch.Tensor) -> LayerWeights:
        """The part's tensors as views into `slot` ((≥ nbytes,) uint8); the layer's other tensors None."""
        tensors = _views(slot, self.dtype, self.entries, self.nbytes)
        absent = {name: None for name in layer_fields() if name not in tensors}
        return LayerWeights(**tensors, **absent, part=self.part)


def layer_fields() -> tuple[str, ...]:
    """The tensor fields of LayerWeights."""
    return tuple(name for names in LAYER_PARTS.values() for name in names)


def round_up(n: int, multiple: int) -> int:
    return (n + multiple - 1) // multiple * multiple


def arena_stride(block_nbytes: int) -> int:
    """Bytes from one layer's block to the next in a host arena: page-aligned, so the arena can be pinned in
    pieces of whole layers (docs/streaming.md §4)."""
    return round_up(block_nbytes, PAGE_BYTES)


def arena_piece_layers(block_nbytes: int) -> int:
    """Layers in one pinned piece of a host arena: as many whole layers as PIN_CHUNK_BYTES holds, at least one."""
    return max(1, PIN_CHUNK_BYTES // arena_stride(block_nbytes))


def pinned_arena_layers(n_layers: int, block_nbytes: int, budget: Optional[int]) -> int:
    """How many of an arena's n_layers (its first) are pinned within `budget` bytes: whole pieces only, as the
    transfer backend registers them (None: no budget, all of them)."""
    if budget is None:
        return n_layers
    piece = arena_piece_layers(block_nbytes)
    pinned = 0
    while pinned < n_layers and min(pinned + piece, n_layers) * arena_stride(block_nbytes) <= budget:
        pinned = min(pinned + piece, n_layers)
    return pinned


@dataclass
class GlobalWeights:
    """Always resident: embedding, final norm, lm_head (the same tensor as embed when tied)."""
    embed: torch.Tensor       # (V, D)
    final_norm: torch.Tensor  # (D,)
    lm_head: torch.Tensor     # (V, D); in host memory where the plan keeps it there (Model.logits)
