"""The verification pass's attention mask: causal rows for pending prompt tokens, then the tree's rows."""
from __future__ import annotations

from typing import Optional

import torch


def causal_rows(first_slot: int, n_rows: int, n_cols: int, device) -> torch.Tensor:
    """(n_rows, n_cols) bool: row i (the token at slot first_slot + i) sees every slot up to its own."""
    slots = torch.arange(first_slot, first_slot + n_rows, device=device)
    return torch.arange(n_cols, device=device)[None, :] <= slots[:, None]


class PassMask:
    """One forward's attention mask, built a block of rows at a time (model.MaskRows), so a long prompt
    never builds its whole (T, S) mask: `n_pending` causal rows for the not-yet-cached tokens at slots
    first_slot, first_slot + 1, ..., then (with a tree) the tree's N rows, which see every slot before the
    root and their own ancestors in the tree (tree_mask, (N, N)); the root sits at slot first_slot + n_pending.

    Example: 3 cached tokens, 2 pending (slots 3, 4), a root with one child (slots 5, 6); S = 7:
        slot 3  1111000        root  1111110
        slot 4  1111100        child 1111111
    """

    def __init__(self, first_slot: int, n_pending: int, tree_mask: Optional[torch.Tensor], device):
        self.first_slot, self.n_pending, self.device = first_slot, n_pending, device
        self.tree_mask = tree_mask.to(device) if tree_mask is not None else None        # (N, N)
        self.root_slot = first_slot + n_pending
        self.n_cols = self.root_slot + (tree_mask.shape[0] if tree_mask is not None else 0)   # S

    def __call__(self, a: int, b: int) -> torch.Tensor:
        """Rows a..b-1 -> (b - a, S) bool."""
        P = self.n_pending
        rows = torch.zeros(b - a, self.n_cols, dtype=torch.bool, device=self.device)
        if a < P:                                           # the pending prompt: causal
            rows[: min(b, P) - a] = causal_rows(self.first_slot + a, min(b, P) - a, self.n_cols, self.device)
        if b > P:                                           # tree rows: the whole committed prefix ...
            tree_rows = slice(max(a, P) - a, b - a)
            rows[tree_rows, : self.root_slot] = True
            rows[tree_rows, self.root_slot:] = self.tree_mask[max(a, P) - P: b - P]   # ... and their ancestors
        return rows
