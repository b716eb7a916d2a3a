"""Free n-gram branches: continuations the sequence already contains, proposed without a draft call.

Prompt lookup (as in Lookahead decoding's n-gram pool and llama.cpp's n-gram draft): if the last n tokens of
the sequence (prompt + generated, ending with the round's root) occurred earlier, the tokens that followed
that earlier occurrence are a likely continuation now. Chat answers quote the question, code repeats names,
both repeat their own phrases.

    lookup(seq, max_chains, max_len, max_match) -> [NgramChain]

Growth grafts each chain onto the round's tree from the root (candidates.py, `Candidates.graft_ngrams`): where the
tree already has the chain's token it follows that node (at T > 0 only once the budget's cut is made, so that
no drawn node's presence depends on its own draw), elsewhere it adds the token as a new node (an
"n-gram node": never run through the draft, no draft distribution, a value from its own calibration table).
A chain is a deterministic function of the committed sequence, so verification treats its nodes as
deterministic candidates (accept.py).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

MAX_CHAINS = 3      # distinct continuations grafted per round (the most recent occurrences of the longest match)
MAX_LEN = 16        # tokens per chain: deeper n-gram nodes are rarely reached, and the budget decides anyway
MAX_MATCH = 6       # the longest suffix looked for: longer matches predict no better than 6 tokens do


@dataclass(frozen=True)
class NgramChain:
    tokens: tuple[int, ...]    # the continuation, first token = the proposed child of the root
    match: int                 # n: how many tokens before it matched the end of the sequence (its evidence)


def lookup(seq: Sequence[int], max_chains: int = MAX_CHAINS, max_len: int = MAX_LEN,
           max_match: int = MAX_MATCH) -> list[NgramChain]:
    """The continuations of the longest suffixes of `seq` that occurred before, at most `max_chains` with
    distinct first tokens: longest match first, and for one length the most recent occurrence first.

    Example: seq = [5, 6, 7, 1, 5, 6, 9, 2, 5, 6] ends with (5, 6), which occurred at 0 and 4:
        lookup(seq, max_len=3) -> [NgramChain((9, 2, 5), 2), NgramChain((7, 1, 5), 2)]
    """
    L = len(seq)
    if L < 2 or max_chains < 1 or max_len < 1:
        return []
    t = torch.tensor(seq, dtype=torch.long)                                            # (L,)
    chains: list[NgramChain] = []
    firsts: set[int] = set()
    for n in range(min(max_match, L - 1), 0, -1):
        windows = t[: L - 1].unfold(0, n, 1)                                           # (L - n, n): ends before seq[-1]
        starts = torch.nonzero((windows == t[L - n:]).all(dim=1)).flatten().tolist()   # occurrences of the suffix
        for start in reversed(starts):                                                 # the most recent first
            follow = seq[start + n: start + n + max_len]
            if follow and follow[0] not in firsts:
                firsts.add(follow[0])
                chains.append(NgramChain(tuple(int(x) for x in follow), n))
                if len(chains) == max_chains:
                    return chains
    return chains
