"""One tokenizer, two embedding tables: which token ids the draft may propose, and how its p meets the target's q.

Draft and target must speak the same tokenizer, but their embedding (and lm_head) rows may differ: checkpoints
pad the vocabulary to a round number for fast matmuls, so Qwen2.5-0.5B has 151936 rows and Qwen2.5-7B 152064,
for one tokenizer of 151665 ids. Rows past the tokenizer's ids are padding: no text encodes to them and they
were never trained, but the target's forward still gives them logits, and the target's own output may (rarely)
be one of them.

Shared ids: 0 .. n_shared - 1, the ids both tokenizers know (n_shared = the smaller tokenizer's id count; the
tokenizers agree on every one of them, and each model's rows cover its own tokenizer: load checks both). The
draft proposes only these, never a padding row: a padding row costs a tree slot, and the draft's own padding
rows are untrained noise. Keeping losslessness is then a matter of where p meets q:
  p (draft)   restricted to the shared ids BEFORE temperature / top-k / top-p (its logits elsewhere count as
              -inf; slicing them off is the same thing, cheaper), so the truncation acts on tokens the draft
              can propose; then widened with zeros to the TARGET's width, so that p and q index the same
              tokens wherever they meet: acceptance min(1, q(x) / p(x)) and the residual max(q - p, 0).
  q (target)  never restricted. p is 0 on the target's extra rows, so the residual keeps q's mass there whole
              and a rejection hands it on: the emitted tokens have exactly q's distribution, padding rows
              included. At T = 0 the argmax over all the target's rows decides, so greedy output is the
              target's own even when a padding row wins (no draft candidate matches it; it comes as the bonus).
Any p is lossless as long as verification uses the p the children were drawn from; restricting p only changes
how often proposals are accepted. Cutting q to the shared ids instead would silently drop the target's extra
rows (tests/test_vocab.py shows a chi-square test catching exactly that).
  draft input A token the target emitted that the draft has no row for (one of the target's extra rows) is fed
              to the draft as PLACEHOLDER_ID: the draft's guesses after it get worse, the output does not (the
              target verifies every token), and both caches keep one entry per position as before.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from offspec.config import SamplingConfig
from offspec.errors import CheckpointError
from offspec.spec.sampling import process_logits

PLACEHOLDER_ID = 0   # what the draft reads in place of a token id past its embedding rows (see above)
PAD_SLACK = 0.01     # row counts this close (a fraction of the larger) may be one tokenizer padded two ways


def token_id_count(tokenizer) -> int:
    """How many ids the tokenizer uses: 1 + its largest id, added tokens included (not len(), which a tokenizer
    with a hole in its ids would undercount)."""
    return max(tokenizer.get_vocab().values()) + 1


def check_same_tokenizer(target_tok, draft_tok) -> int:
    """Speculation compares token ids, so both tokenizers must map every token to the same id; returns n_shared.

    Compared: the vocabularies as dicts (token -> id, added tokens included), over the ids both tokenizers have.
    A tokenizer may extend the other past its last id (GGUF conversions append '[PAD151665]' ... entries up to
    the padded row count; fine-tunes append new special tokens): the draft never proposes those ids. Not compared:
    embedding rows (see the module docstring) and special-token ROLES (a base draft's EOS is <|endoftext|>, an
    instruct target's <|im_end|>, same ids): the draft never stops or decodes; the target's tokenizer does both.
    """
    tv = target_tok.get_vocab()
    if draft_tok is target_tok:                      # one tokenizer read for both (same_tokenizer_files)
        return max(tv.values()) + 1
    dv = draft_tok.get_vocab()
    n_shared = min(max(tv.values()) + 1, max(dv.values()) + 1)
    t_shared = {k: i for k, i in tv.items() if i < n_shared}
    d_shared = {k: i for k, i in dv.items() if i < n_shared}
    if t_shared != d_shared:
        differing = sorted({k for k in t_shared.keys() | d_shared.keys() if t_shared.get(k) != d_shared.get(k)},
                           key=lambda k: t_shared.get(k, d_shared.get(k, 0)))
        k = differing[0]
        raise CheckpointError(f"draft and target tokenizers differ ({len(tv)} vs {len(dv)} tokens, {len(differing)} "
                              f"with different ids; e.g. {k!r} is {tv.get(k)} in the target, {dv.get(k)} in the draft)")
    return n_shared


def rows_mismatch(target_rows: int, draft_rows: int) -> Optional[str]:
    """Why two embedding tables cannot belong to one tokenizer, judged from their row counts alone (for plans
    made from headers, with no tokenizer files to compare), else None. Checkpoints pad one tokenizer's ids up
    to a round row count (see the module docstring), so counts within PAD_SLACK of the larger may be one
    tokenizer padded two ways; counts farther apart are two tokenizers."""
    if abs(target_rows - draft_rows) <= PAD_SLACK * max(target_rows, draft_rows):
        return None
    return (f"the draft has {draft_rows} embedding rows and the target {target_rows}: they do not share a "
            "tokenizer, which speculation needs (a run refuses them)")


def check_rows_cover_tokenizer(rows: int, n_ids: int, who: str) -> None:
    """A model must embed every id its tokenizer can produce; `who` names it ('target /path/to/model')."""
    if rows < n_ids:
        raise CheckpointError(f"{who}: {rows} embedding rows, but its tokenizer has {n_ids} token ids "
                              f"(ids {rows}..{n_ids - 1} could not be embedded)")


@dataclass(frozen=True)
class SharedVocab:
    """The draft's view of the target's vocabulary (module docstring): what it proposes, what it reads."""
    n_shared: int      # ids 0 .. n_shared - 1: known to both tokenizers, embedded by both models; proposable
    draft_rows: int    # the draft's embedding / lm_head rows (width of its logits)
    target_rows: int   # the target's (width of q, and of every p handed to growth and verification)

    def __post_init__(self):
        if not 0 < self.n_shared <= min(self.draft_rows, self.target_rows):
            raise ValueError(f"n_shared={self.n_shared} must be in 1..min(draft_rows={self.draft_rows}, "
                             f"target_rows={self.target_rows})")

    def draft_distribution(self, logits: torch.Tensor, sampling: SamplingConfig) -> torch.Tensor:
        """The draft's logits (..., draft_rows) -> p (..., target_rows): processed over the shared ids only,
        zero elsewhere. Every draft distribution goes through here, so growth, the tree's stored dists and
        verification all see p at q's width."""
        p = process_logits(logits[..., : self.n_shared], sampling)                       # (..., n_shared)
        if self.n_shared == self.target_rows:
            return p
        return F.pad(p, (0, self.target_rows - self.n_shared))                           # (..., target_rows)

    def draft_input(self, tokens: torch.Tensor) -> torch.Tensor:
        """Token ids (any shape) -> ids the draft can embed: the target's extra rows become PLACEHOLDER_ID."""
        if self.target_rows <= self.draft_rows:
            return tokens
        return torch.where(tokens < self.draft_rows, tokens, torch.full_like(tokens, PLACEHOLDER_ID))
