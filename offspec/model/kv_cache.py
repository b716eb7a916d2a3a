"""Preallocated K/V cache: a buffer of `batch` rows (one per sequence in flight) plus each row's committed length.

Tree tokens are written after a row's committed prefix; once a round is verified, the accepted path is
gathered into place right after the prefix (`compact`) and the length advances. Nothing is ever freed
or reallocated inside the generation loop: a finished sequence's row is simply taken by the next one.
"""
from __future__ import annotations

import torch


def uninitialized(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The caches are not zeroed: a forward writes every slot its masks cover before it reads any
    (model.py), so no slot is read before it is written. On a CPU the pages nothing writes are then never
    touched: a row's room for a 1,024-node tree costs no memory until a tree fills it (zeroing 0.8 GB of
    caches at 16 rows took 1.4 s)."""
    return torch.empty(shape, dtype=dtype, device=device)


class KVCache:
    def __init__(self, n_layers: int, batch: int, n_kv_heads: int, capacity: int, head_dim: int,
                 dtype: torch.dtype, device: torch.device):
        shape = (n_layers, batch, n_kv_heads, capacity, head_dim)   # (L, B, H_kv, S_max, hd)
        self.k = uninitialized(shape, dtype, device)
        self.v = uninitialized(shape, dtype, device)
        self.capacity = capacity
        self.lengths = [0] * batch   # committed tokens per row: slots [0, length) hold the accepted prefix

    @staticmethod
    def for_model(cfg, capacity: int, dtype: torch.dtype, device: torch.device, batch: int = 1) -> "KVCache":
        return KVCache(cfg.n_layers, batch, cfg.n_kv_heads, capacity, cfg.head_dim, dtype, device)

    @property
    def nbytes(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()

    @property
    def length(self) -> int:
        """The committed length of a one-row cache."""
        assert len(self.lengths) == 1, "a batched cache has a length per row: use lengths[row]"
        return self.lengths[0]

    def write(self, layer: int, row: int, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """slots (t,); k, v (H_kv, t, hd) -> cache[layer, row, :, slots]."""
        self.k[layer, row].index_copy_(1, slots, k)
        self.v[layer, row].index_copy_(1, slots, v)

    def compact(self, kept_slots: torch.Tensor, start: int, row: int = 0) -> None:
        """In `row`, move the K/V at kept_slots (n,) to slots [start, start + n) in every layer; its length =
        start + n.

        Example: prefix of 7, tree written at slots 7..12, accepted path = slots [7, 9, 12]
        -> compact(tensor([7, 9, 12]), 7) leaves them at 7, 8, 9 and length 10.
        """
        n = kept_slots.numel()
        dest = torch.arange(start, start + n, device=kept_slots.device)
        if n and not torch.equal(kept_slots, dest):
            # index_select makes a copy first, so overlapping source and destination are safe.
            self.k[:, row].index_copy_(2, dest, self.k[:, row].index_select(2, kept_slots))
            self.v[:, row].index_copy_(2, dest, self.v[:, row].index_select(2, kept_slots))
        self.lengths[row] = start + n

    def set_length(self, length: int, row: int = 0) -> None:
        self.lengths[row] = length
