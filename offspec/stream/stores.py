"""Where the target's streamed layers live on the host: the weight stores.

  HostArenaStore   the streamed layers packed into ONE host arena (pinned on CUDA, exactly sized, in pieces of
                   about layout.PIN_CHUNK_BYTES; docs/streaming.md §4), one contiguous block per layer.
  DiskStore        offspec's packed store on disk (disk.py), read into pinned staging buffers.
  TieredStore      the two in one ring: the arena's layers copied from it, the others read from the disk store.

A store hands the ring one layer's host bytes at a time (acquire), pinned or not (Staged).
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional, Sequence, Union

import torch
from tqdm import tqdm

from offspec.formats.layout import arena_piece_layers, arena_stride
from offspec.stream.disk import DiskStore
from offspec.stream.staged import BlockLayout, LayerTensorsFn, Staged, StoreInfo, pack_layer
from offspec.stream.transfer import TransferBackend

# ---------------------------------------------------------------- host arena

class HostArenaStore:
    """The streamed layers packed into one host arena; layer i is one contiguous block, so moving it is one
    copy. Pinned (exactly sized) on CUDA, with a reported pageable fallback (transfer.HostBuffer).

    Blocks sit at a page-aligned stride so the arena can be pinned in ~1 GiB pieces of whole layers
    (docs/streaming.md §4: one huge registration can fail; no copy may span two registrations)."""

    def __init__(self, layout: BlockLayout, layers: Sequence[int], backend: TransferBackend,
                 host_budget: Optional[int] = None):
        self.layout = layout
        self._block_of = {layer: i for i, layer in enumerate(layers)}   # layer index -> block index
        self._stride = arena_stride(layout.nbytes)                     # bytes from one block to the next
        nbytes = len(layers) * self._stride      # the memory plan has checked that the host can hold it
        self._arena = backend.host_buffer(nbytes, host_budget,
                                          chunk_bytes=arena_piece_layers(layout.nbytes) * self._stride)

    @classmethod
    def build(cls, layer_tensors_fn: LayerTensorsFn, layout: BlockLayout, layers: Sequence[int],
              backend: TransferBackend, host_budget: Optional[int] = None, progress: bool = True) -> "HostArenaStore":
        """The arena, each layer packed from its tensors."""
        return cls.filled(lambda layer, block: pack_layer(layer_tensors_fn, layer, layout, block), layout, layers,
                          backend, host_budget, progress)

    @classmethod
    def filled(cls, fill: Callable[[int, torch.Tensor], None], layout: BlockLayout, layers: Sequence[int],
               backend: TransferBackend, host_budget: Optional[int] = None, progress: bool = True) -> "HostArenaStore":
        """The arena, fill(layer, block) writing each layer's block ((layout.nbytes,) uint8)."""
        store = cls(layout, layers, backend, host_budget)
        with contextlib.ExitStack() as on_error:
            on_error.callback(store.close)
            for layer in tqdm(layers, desc="packing layers into host memory", unit="layer", disable=not progress):
                fill(layer, store.block(layer))
            on_error.pop_all()
        return store

    def holds(self, layer: int) -> bool:
        return layer in self._block_of

    def block(self, layer: int) -> torch.Tensor:
        """(layout.nbytes,) uint8 view of layer `layer`'s block in the arena."""
        start = self._block_of[layer] * self._stride
        return self._arena.tensor[start: start + self.layout.nbytes]

    def acquire(self, layer: int, next_layer: Optional[int] = None) -> Staged:
        # The arena is never rewritten, so its blocks need no reuse gate (and nothing is read ahead). A block is
        # pinned where it lies in the pinned prefix (a budget pins the first pieces; the rest copy pageable).
        pinned = self._arena.pinned_at(self._block_of[layer] * self._stride, self.layout.nbytes)
        return Staged(self.block(layer), pinned, gate=None, read_s=0.0)

    def info(self) -> StoreInfo:
        return StoreInfo("host arena", self._arena.nbytes, self._arena.pinned, self._arena.reason,
                         pinned_nbytes=self._arena.pinned_nbytes)

    def close(self) -> None:
        self._arena.close()


# ---------------------------------------------------------------- both tiers

class TieredStore:
    """Streamed layers from two tiers in one ring: those in the host arena are copied from it, the others read
    from the disk store. The disk's read-ahead skips the arena's layers: acquiring a disk layer starts the read of
    the next disk layer of the pass, so that read runs while the arena's layers in between are copied
    (plan.split_tiers spreads the disk layers through the pass for this)."""

    def __init__(self, host: HostArenaStore, disk: DiskStore, streamed: Sequence[int]):
        self.host, self.disk, self.layout = host, disk, host.layout
        on_disk = [layer for layer in streamed if not host.holds(layer)]
        self._next_disk = {layer: on_disk[(k + 1) % len(on_disk)] for k, layer in enumerate(on_disk)}

    def acquire(self, layer: int, next_layer: Optional[int] = None) -> Staged:
        if self.host.holds(layer):
            return self.host.acquire(layer)
        return self.disk.acquire(layer, next_layer=self._next_disk[layer])

    def info(self) -> StoreInfo:
        host, disk = self.host.info(), self.disk.info()
        pinned = host.pinned and disk.pinned
        return StoreInfo("host arena + disk store", host.nbytes + disk.nbytes, pinned,
                         "" if pinned else (host.reason or disk.reason), path=disk.path, io=disk.io,
                         pinned_nbytes=host.pinned_nbytes)

    def close(self) -> None:
        self.disk.close()
        self.host.close()


WeightStore = Union[HostArenaStore, DiskStore, TieredStore]
