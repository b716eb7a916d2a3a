"""Frozen configuration records. Every knob has a comment; the CLI maps its options one to one onto these."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

AUTO_MAX_TREE_BUDGET = 1024     # the largest tree the auto budget planner may grow
FIXED_BUDGET_DEPTH = 32         # the depth bound of a fixed-budget tree where --max-depth is auto
DEFAULT_PREFILL_CHUNK = 1024    # rows each layer processes at a time in one forward
ATTENTION_SCORE_BYTES = 256 << 20   # the most one attention call's scores may take: its query rows are cut to fit
LM_HEAD_CHUNK_BYTES = 256 << 20     # an lm_head kept in host memory crosses to the device this many bytes at a time


def attention_rows(n_heads: int, columns: int, itemsize: int) -> int:
    """Query rows one attention call takes over `columns` cache columns, so that its scores (n_heads, rows,
    columns), float32 scores plus probabilities in the compute dtype, stay within ATTENTION_SCORE_BYTES: a long
    context costs KV cache, not an activation peak."""
    return max(1, ATTENTION_SCORE_BYTES // (n_heads * columns * (4 + itemsize)))


@dataclass(frozen=True)
class RopeScaling:
    kind: str                                   # "llama3" | "linear"
    factor: float                               # context extension factor
    low_freq_factor: float = 1.0                # llama3: wavelengths above original/low_freq_factor are scaled fully
    high_freq_factor: float = 4.0               # llama3: wavelengths below original/high_freq_factor are kept
    original_max_position_embeddings: int = 8192  # llama3: the context the base frequencies were trained for


@dataclass(frozen=True)
class ModelConfig:
    arch: str                                   # "llama" | "mistral" | "qwen2" | "qwen3" (SmolLM is llama)
    vocab_size: int                             # rows of the embedding and of lm_head
    hidden_size: int                            # D, the residual width
    intermediate_size: int                      # F, the SwiGLU inner width
    n_layers: int                               # decoder layers
    n_heads: int                                # H, query heads
    n_kv_heads: int                             # H_kv, key/value heads (grouped-query attention when < H)
    head_dim: int                               # hd, per-head width (usually D / H)
    rms_norm_eps: float = 1e-6                  # epsilon inside every RMSNorm
    rope_theta: float = 10000.0                 # RoPE base
    rope_scaling: Optional[RopeScaling] = None  # long-context frequency rescaling, None for plain RoPE
    max_position_embeddings: int = 4096         # the context the model supports
    tie_word_embeddings: bool = False           # lm_head shares the embedding matrix
    attention_bias: bool = False                # q/k/v projections carry a bias (Qwen2)
    qk_norm: bool = False                       # each head's query and key RMS-normalized before RoPE (Qwen3)


@dataclass(frozen=True)
class OffloadConfig:
    mode: str = "none"                          # "none": all resident | "cpu": layers in (pinned) host RAM | "disk": packed store on disk | "cpu+disk": what fits in host RAM, the rest on disk
    gpu_budget: Optional[int] = None            # bytes the target may use on the compute device for weights; None = as many layers resident as fit (all on CPU)
    n_slots: int = 2                            # ring size in layers: device slots that streamed layers rotate through (>= 2); a split ring takes n_slots layers' parts
    store_dir: Optional[str] = None             # where the disk-mode packed store lives; None = next to the checkpoint cache
    host_budget: Optional[int] = None           # bytes of host RAM the pinned arena may take; over it -> pageable fallback
    overlap: bool = True                        # prefetch the next layers while computing; False = copy then compute (debug)
    drop_page_cache: bool = True                # disk mode: posix_fadvise(DONTNEED) after each read, keeping host memory bounded
    disk_io: str = "direct"                     # disk mode: "direct" = O_DIRECT where the filesystem allows it | "buffered"


@dataclass(frozen=True)
class TreeConfig:
    policy: str = "auto"                        # "auto" (by the draft: sequoia.chosen_policy) | "dyspec" | "heap" | "chain" | "static" | "sequoia" (Sequoia's DP shape) | "none" (plain autoregressive)
    budget: Optional[int] = None                # max tree nodes per round; None = "auto": chosen from measured draft and target costs
    threshold: Optional[float] = None           # DySpec C; None = adaptive (C set so the tree fills the budget)
    max_depth: Optional[int] = None             # deepest level a round's tree may reach; None = "auto" (depth_bound)
    branching: int = 8                          # candidate children examined per frontier node each depth
    static_widths: tuple = (4, 2, 2, 1, 1, 1)   # "static": children per node at each depth
    prune: bool = True                          # dyspec: run the draft only on nodes at least as likely as last round's C
    # Both off by default: no measured grid shows them winning yet (docs/notes/2026-11-25-tree-levers.md).
    calibrate: bool = False                     # node values from acceptance rates observed this run (calibrate.py), not raw draft probabilities
    ngram: bool = False                         # graft continuations the sequence already contains onto each tree, no draft call (ngram.py)

    def depth_bound(self) -> int:
        """The deepest level a round's tree may reach: max_depth, or where it is auto, with an auto budget no
        bound of its own (a tree of N nodes is at most N deep, and the budget planner prices every level as a
        draft call: engine/controller.py), with a fixed budget FIXED_BUDGET_DEPTH (nothing prices the levels)."""
        if self.max_depth is not None:
            return self.max_depth
        return AUTO_MAX_TREE_BUDGET if self.budget is None else FIXED_BUDGET_DEPTH


@dataclass(frozen=True)
class SamplingConfig:
    temperature: float = 0.0                    # 0 = greedy
    top_p: float = 1.0                          # nucleus mass kept (1 = off)
    top_k: int = 0                              # keep the k most likely tokens (0 = off)
    seed: int = 0                               # seeds the per-round generators

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0


@dataclass(frozen=True)
class RunLimits:
    """The largest things one run will do, which the memory plan sizes everything by."""
    context: Optional[int] = None      # tokens one sequence may reach (prompt + generated + one tree); None = the models' context
    tree_budget: Optional[int] = None  # largest tree a pass may verify; None = auto: the most that fits, up to AUTO_MAX_TREE_BUDGET
    prefill_chunk: int = DEFAULT_PREFILL_CHUNK  # rows each layer processes at a time: bounds a long prompt's activations
    sampling: bool = True              # T > 0 may run: trees keep the draft distributions their nodes were drawn from
    concurrency: Optional[int] = 1     # requests in flight at once (offspec batch): KV cache rows, trees per pass; None = auto: the most that fits, up to plan.AUTO_CONCURRENCY and concurrency_cap
    concurrency_cap: Optional[int] = None  # auto concurrency plans no more rows than this (the job's prompts; a Ray worker: the driver's plan); None = no cap but AUTO_CONCURRENCY


@dataclass(frozen=True)
class RuntimeConfig:
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))  # compute device for both models
    dtype: torch.dtype = torch.float32         # compute and weight dtype
    draft_quant: str = "none"                  # "none" | "int8": the draft's matrices get a per-row int8 copy for narrow calls (changes p only)
    target_quant: str = "none"                 # "none" | "int8" | "nf4": the target's layers stored, moved and dequantized so (changes the target); a published checkpoint's own ("awq-g128", plan.published_runtime)
    resident_quant: str = "auto"               # a quantized target's resident layers: "on" held quantized (dequantized every pass into one scratch layer) | "off" dense | "auto" held where that keeps more resident
