"""What every kind of bytes a run holds costs: a model's layers, globals, caches, logits and activations, by shape."""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch

from offspec.config import ModelConfig, RuntimeConfig, attention_rows
from offspec.errors import InputError
from offspec.formats import cpu_bf16, int4
from offspec.formats.layout import LayerLayout, layer_shapes
from offspec.formats.published import describe as describe_quant
from offspec.formats.published import per_layer_sizes
from offspec.formats.quant import QuantizedLayout, target_layout
from offspec.formats.weights import HELD_DRAFT_QUANTS, held_matrix_nbytes


@dataclass(frozen=True)
class ModelSpec:
    """What the plan needs of one model (from config.json and the safetensors headers; no weight is read)."""
    cfg: ModelConfig
    lm_head_stored: bool   # lm_head is its own tensor (untied, or saved anyway); else it shares the embedding
    name: str              # for messages: the folder
    quant: str = "none"    # a published quantization its layers are stored in (published.py), else "none"
    twin: bool = False     # the draft is the target's own layers held quantized (--draft self), its globals shared

    @staticmethod
    def of(ckpt) -> "ModelSpec":
        """From a checkpoint.Checkpoint (headers only is enough)."""
        return ModelSpec(ckpt.config, ckpt.has_lm_head, str(ckpt.path), ckpt.quant)

    def as_twin(self) -> "ModelSpec":
        """This model (a target's spec) as its own draft: --draft self."""
        return replace(self, twin=True)


def published_runtime(target: ModelSpec, runtime: RuntimeConfig) -> RuntimeConfig:
    """The run's target quantization: a published checkpoint's own (no flag needed); --target-quant int8 | nf4
    quantizes a full-precision one only."""
    if target.quant == "none" or runtime.target_quant == target.quant:
        return runtime
    if runtime.target_quant != "none":
        raise InputError(f"{target.name} is already quantized ({describe_quant(target.quant)}): --target-quant "
                         f"{runtime.target_quant} applies to full-precision checkpoints; leave it out")
    return replace(runtime, target_quant=target.quant)


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
    """--draft-quant int8 (weights.Int8Weight): every matrix (N, K) of every layer and lm_head gets N*K int8 + N
    scales."""
    D, F_, q, kv = cfg.hidden_size, cfg.intermediate_size, cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
    per_layer = [(q, D), (kv, D), (kv, D), (D, q), (F_, D), (F_, D), (D, F_)]
    s = itemsize(dtype)
    layer = sum(n * k + n * s for n, k in per_layer)
    return cfg.n_layers * layer + cfg.vocab_size * (cfg.hidden_size + s)


def draft_weights_nbytes(spec: ModelSpec, dtype: torch.dtype, draft_quant: str, head: str) -> int:
    """The draft's weights on the device: dense, or its layers' matrices held quantized (--draft-quant int8-held |
    nf4: weights.HeldWeight; int4: int4.Int4Weight) beside dense norms, biases, embedding and lm_head, an int4 draft's
    lm_head as `head` says (draft_quant.draft_lm_head: "int4" in place of a dense one of its own, "int8" a copy
    beside it). A twin (--draft self) holds only its layers (and its lm_head's copy, if any): the embedding, final
    norm and lm_head are the target's, counted with the target; with --draft-quant int8 not even those (the
    target's resident layers, beside their int8 copies: int8_copy_nbytes)."""
    cfg = spec.cfg
    own_globals = 0 if spec.twin else globals_nbytes(spec, dtype)
    if draft_quant == "int4":
        int4.check_shapes([s for s in layer_shapes(cfg).values() if len(s) == 2], "--draft-quant int4")
        V, D = cfg.vocab_size, cfg.hidden_size
        dense_head = 0 if spec.twin or not spec.lm_head_stored else embed_nbytes(spec, dtype)
        head_nbytes = {"int4": int4.nbytes((V, D), dtype) - dense_head, "int8": V * (D + itemsize(dtype)),
                       "as is": 0}[head]
        held = functools.partial(int4.nbytes, source=int4.source_group(spec.quant))
        return cfg.n_layers * _held_layer_nbytes(cfg, dtype, held) + head_nbytes + own_globals
    if draft_quant not in HELD_DRAFT_QUANTS:
        if spec.twin:
            return 0      # the target's resident layers themselves (int8: its int8 copies, int8_copy_nbytes)
        return cfg.n_layers * layer_nbytes(cfg, dtype) + own_globals
    held = functools.partial(held_matrix_nbytes, HELD_DRAFT_QUANTS[draft_quant])
    return cfg.n_layers * _held_layer_nbytes(cfg, dtype, held) + own_globals


def _held_layer_nbytes(cfg: ModelConfig, dtype: torch.dtype, matrix_nbytes) -> int:
    """One layer with each matrix held as matrix_nbytes(shape, dtype) says, norms and biases dense."""
    return sum(matrix_nbytes(shape, dtype) if len(shape) == 2 else math.prod(shape) * itemsize(dtype)
               for shape in layer_shapes(cfg).values())


def largest_matrix_nbytes(cfg: ModelConfig, dtype: torch.dtype) -> int:
    """One layer's largest matrix, dense: what a held draft dequantizes into for a call (a temporary)."""
    return max(math.prod(shape) for shape in layer_shapes(cfg).values() if len(shape) == 2) * itemsize(dtype)


def kv_bytes_per_token(cfg: ModelConfig, dtype: torch.dtype) -> int:
    return 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * itemsize(dtype)


def activation_nbytes(cfg: ModelConfig, dtype: torch.dtype, rows: int, chunk: int, context: int,
                      fused_attention: bool = False, float32_rows: bool = False) -> int:
    """The largest forward of `rows` new tokens attending to `context` cache columns, each layer run over
    chunks of `chunk` rows: hidden states of every row, plus one chunk's intermediates, mask and attention
    scores. On a GPU the scores are counted as the math kernel materializes them (float32 scores +
    probabilities) for the query rows one attention call takes (config.attention_rows), an upper bound, since
    which kernel runs a masked grouped-query attention varies with the build; fused_attention (the CPU: its
    kernel works in blocks, measured to add ~0.1 GB for 12 heads x 1024 rows x 32768 columns) counts one float
    copy of the mask instead. float32_rows (bfloat16 on a CPU without it: cpu_bf16.wide_in_float32) adds a chunk's
    float32 copy of a matmul's input and output and the weight block being upcast."""
    s = itemsize(dtype)
    c = max(1, min(rows, chunk))
    D, F_, hd = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    H, H_kv = cfg.n_heads, cfg.n_kv_heads
    hidden = 2 * rows * D * s + 2 * rows * hd * (s + 4)                    # x + residual; RoPE cos/sin
    chunk_work = c * (3 * D + 2 * (H + 2 * H_kv) * hd + 3 * F_) * s        # norms, q/k/v (+roped), attn out, MLP
    mask = c * context                                                      # bool
    scores = c * context * 4 if fused_attention else H * min(c, attention_rows(H, context, s)) * context * (4 + s)
    upcast = c * (D + F_) * 4 + cpu_bf16.UPCAST_BYTES if float32_rows else 0
    return hidden + chunk_work + mask + scores + upcast


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


def ring_slot_nbytes(layout: Union[LayerLayout, QuantizedLayout]) -> Optional[int]:
    """Device bytes of one ring slot for this layout: None for a dense layer (the layer itself); a quantized
    layer's block plus the dense layer it is dequantized into."""
    return None if layout.quant == "none" else layout.nbytes + layout.dense.nbytes
