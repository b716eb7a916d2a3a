"""What every weight store hands the ring and reports: a layer's host bytes (Staged), where the layers live
(StoreInfo), and a layer packed into its block from its tensors."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from offspec.errors import CheckpointError
from offspec.formats.layout import LayerLayout
from offspec.formats.quant import QuantizedLayout
from offspec.stream.transfer import TransferEvent

LayerTensorsFn = Callable[[int], dict[str, torch.Tensor]]   # layer index -> tensors keyed by LayerWeights fields
BlockLayout = Union[LayerLayout, QuantizedLayout]          # how a stored / moved layer block is laid out


def pack_layer(layer_tensors_fn: LayerTensorsFn, layer: int, layout: BlockLayout, block: torch.Tensor) -> None:
    """Layer `layer`'s tensors -> their places in `block` ((layout.nbytes,) uint8), cast to layout.dtype
    (or quantized, for a QuantizedLayout)."""
    tensors = layer_tensors_fn(layer)
    missing = [name for name, _, _ in layout.dense.entries          # (a published matrix comes as its pieces)
               if name not in tensors and not any(key.startswith(f"{name}.") for key in tensors)]
    if missing:
        raise CheckpointError(f"layer {layer}: missing tensors {', '.join(missing)}")
    try:
        layout.pack(tensors, block)
    except ValueError as err:   # a shape that does not match the config
        raise CheckpointError(f"layer {layer}: {err}") from err


@dataclass(frozen=True)
class StoreInfo:
    """Where the streamed layers live on the host, for reports."""
    kind: str          # "host arena" | "disk store"
    nbytes: int        # arena size, or layers.bin size
    pinned: bool       # copies start from pinned memory (arena, or the disk staging buffers)
    reason: str        # why not pinned ("" when pinned)
    path: str = ""     # disk store directory
    io: str = ""       # disk store: how layers.bin is read, e.g. "O_DIRECT, 4 reads in flight (≤ 22.3 MiB each)"
    pinned_nbytes: int = 0   # an arena pinned in part (its first pieces, within the pinned budget): those bytes


@dataclass
class Staged:
    """One layer's bytes on the host, ready to be copied into a slot."""
    block: torch.Tensor                # (layout.nbytes,) uint8 host memory
    pinned: bool                       # block is pinned: the copy may be asynchronous
    gate: Optional[TransferEvent]      # record on the copy queue after the copy (a staging buffer's reuse gate)
    read_s: float                      # seconds its read from disk took (0 for the arena)
