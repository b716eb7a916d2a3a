"""The Llama-family forward, written once as functions of explicit weights.

Llama 1/2/3 (incl. llama3 / linear rope scaling), Mistral, Qwen2 (qkv bias) and SmolLM share this code.
The resident draft and the streamed target both run `run_layer`; they differ only in where a layer's
weights come from (a list of resident layers, or a slot of the streaming ring, which may hold a layer in parts).

One forward computes the new tokens of several sequences at once, PACKED: their tokens are rows of one
(N, D) batch, each sequence a RowSpan [start, end) of it, so the matmuls run over exactly N rows (no
padding), while attention runs per sequence against its own KV-cache row, so a sequence's attention work
is its own and never that of its neighbours. A single sequence is the batch of one.

Three index tensors stay separate everywhere (never merged):
  slots      (t,)    per sequence: where each new token's K/V is written in its cache row
  positions  (N,)    the RoPE position of each new token (prefix length + tree depth)
  mask       (t, S)  per sequence, bool, True = may attend; S = columns 0 .. S-1 of its cache row; or a
                     MaskRows function giving rows [a, b) of it, so a long pass never builds the whole mask

A forward may run each layer over the packed rows in chunks (`chunk`), so a long prompt's intermediates
stay chunk-sized: first every chunk writes its keys and values to the cache, then every chunk attends and
runs the MLP. A row's mask spans columns that later chunks write (masked off, but read: attention takes the
whole (t, S) block), and the caches are not zeroed, so a column still holding whatever the memory held (NaN
stays NaN after a mask) must never be read; with every slot of the pass written first, none is. The layer's
weights serve every chunk before the next layer is asked for, so a streamed target still moves each layer
once per pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Protocol, Sequence, Union

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from offspec.config import LM_HEAD_CHUNK_BYTES, ModelConfig, attention_rows
from offspec.formats.layout import WHOLE, GlobalWeights, LayerWeights
from offspec.formats.quant import QuantizedResident, layer_weights
from offspec.formats.weights import RowKernels, linear
from offspec.model.kv_cache import KVCache

MaskRows = Callable[[int, int], torch.Tensor]   # (a, b) -> rows a..b-1 of a sequence's mask, (b - a, S) bool


@dataclass(frozen=True)
class RowSpan:
    """One sequence's share of a packed forward: its new tokens are rows [start, end) of the batch."""
    start: int                              # first packed row
    end: int                                # one past the last
    cache_row: int                          # the sequence's row in the KV cache
    slots: torch.Tensor                     # (end - start,) cache slots its new K/V go to
    mask: Union[torch.Tensor, MaskRows]     # (end - start, S) bool over its cache row, or its rows on demand

    def mask_rows(self, a: int, b: int) -> torch.Tensor:
        """Rows a..b-1 (the sequence's own numbering) of its mask: (b - a, S) bool."""
        return self.mask(a, b) if callable(self.mask) else self.mask[a:b]

    def clip(self, a: int, b: int) -> Optional["RowSpan"]:
        """The part of this span inside packed rows [a, b), with its slots cut to match and its mask rows
        given on demand (writing keys needs none); None if none."""
        lo, hi = max(a, self.start), min(b, self.end)
        if lo >= hi:
            return None
        first, last = lo - self.start, hi - self.start
        return RowSpan(lo, hi, self.cache_row, self.slots[first:last], lambda i, j: self.mask_rows(first + i, first + j))


class LayerSource(Protocol):
    """Gives the layers of one forward pass in order. A streamed source may reuse a slot once the
    consumer asks for the next layer, so the caller must not keep a yielded LayerWeights."""
    def pass_layers(self) -> Iterator[tuple[int, LayerWeights]]: ...


class ResidentLayers:
    """All layers live on the compute device for good: dense, or (a quantized target's, --resident-quant) as
    quantized blocks dequantized into one shared scratch layer as each one's turn comes (quant.QuantizedResident)."""

    def __init__(self, layers: list[Union[LayerWeights, QuantizedResident]]):
        self.layers = layers

    def pass_layers(self) -> Iterator[tuple[int, LayerWeights]]:
        for i, layer in enumerate(self.layers):
            yield i, layer_weights(layer)


# ---------------------------------------------------------------- RoPE

def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """(hd/2,) float32 inverse frequencies, with llama3 or linear scaling applied."""
    hd = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, hd, 2, dtype=torch.int64).float() / hd))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    if scaling.kind == "linear":
        return inv_freq / scaling.factor
    if scaling.kind == "llama3":
        # Long wavelengths are slowed by `factor`, short ones kept, the band between blended smoothly.
        old_ctx = scaling.original_max_position_embeddings
        low_wavelen = old_ctx / scaling.low_freq_factor
        high_wavelen = old_ctx / scaling.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        scaled = torch.where(wavelen > low_wavelen, inv_freq / scaling.factor, inv_freq)
        smooth = (old_ctx / wavelen - scaling.low_freq_factor) / (scaling.high_freq_factor - scaling.low_freq_factor)
        smoothed = (1 - smooth) * scaled / scaling.factor + smooth * scaled
        medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
        return torch.where(medium, smoothed, scaled)
    raise ValueError(f"unsupported rope_scaling type {scaling.kind!r}")


def rope_cos_sin(inv_freq: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype):
    """positions (N,) -> cos, sin (N, hd), computed in float32 then cast (as transformers does)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # (N, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                        # (N, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (heads, N, hd); cos, sin (N, hd)."""
    return x * cos + _rotate_half(x) * sin


# ---------------------------------------------------------------- layers

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in float32, scale in the input dtype (bit-compatible with transformers' LlamaRMSNorm)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def head_norm(x: torch.Tensor, weight: Optional[torch.Tensor], cfg: ModelConfig) -> torch.Tensor:
    """(N, heads, hd) queries or keys, each head RMS-normalized where the model has per-head norms (Qwen3)."""
    return x if weight is None else rms_norm(x, weight, cfg.rms_norm_eps)


@dataclass
class PassRows:
    """One forward's rows as every layer runs over them: its chunks, and what they share across layers."""
    cfg: ModelConfig
    cache: KVCache
    pieces: list[tuple[int, int, list[RowSpan]]]   # (a, b, the spans cut to packed rows [a, b), renumbered from 0)
    cos: torch.Tensor                               # (N, hd)
    sin: torch.Tensor                               # (N, hd)
    kernels: RowKernels                             # which kernel each row reads (weights.linear)
    h: Optional[torch.Tensor] = None                # (N, D) a split layer's post-attention norm, between its parts
    act: Optional[torch.Tensor] = None              # (N, F) silu(gate(h)), then times up(h), between its parts

    def cut(self, a: int, b: int) -> RowKernels:
        return self.kernels.cut(a, b)


def run_layer(x: torch.Tensor, w: LayerWeights, layer: int, p: PassRows) -> None:
    """Layer `layer` over x (N, D), in place, chunk by chunk: everything w carries, a whole layer or one of its
    LAYER_PARTS (given in order). Every chunk's keys are written before any chunk attends: a row's mask reaches
    (masked off) slots that later chunks write. A split layer computes exactly what the whole one does, the
    MLP's intermediates kept in p between its parts."""
    cfg, cache = p.cfg, p.cache
    if w.part in (WHOLE, "attention"):
        for a, b, spans in p.pieces:
            write_keys(x[a:b], w, cfg, cache, layer, spans, p.cos[a:b], p.sin[a:b], p.cut(a, b))
        for a, b, spans in p.pieces:
            y = attend(x[a:b], w, cfg, cache, layer, spans, p.cos[a:b], p.sin[a:b], p.cut(a, b))
            x[a:b] = mlp(y, w, cfg, p.cut(a, b)) if w.part == WHOLE else y
        return
    if p.act is None:
        p.h, p.act = x.new_empty(x.shape), x.new_empty(x.shape[0], cfg.intermediate_size)   # (N, D), (N, F)
    for a, b, _ in p.pieces:
        if w.part == "gate":
            p.h[a:b], p.act[a:b] = mlp_gate(x[a:b], w, cfg, p.cut(a, b))
        elif w.part == "up":
            p.act[a:b] = mlp_up(p.h[a:b], p.act[a:b], w, p.cut(a, b))
        else:
            x[a:b] = mlp_down(x[a:b], p.act[a:b], w, p.cut(a, b))


def write_keys(x: torch.Tensor, w: LayerWeights, cfg: ModelConfig, cache: KVCache, layer: int,
               rows: Sequence[RowSpan], cos: torch.Tensor, sin: torch.Tensor,
               kernels: RowKernels = RowKernels()) -> None:
    """A layer's first step (run_layer): x's keys and values, written to each sequence's cache slots."""
    N, H_kv, hd = x.shape[0], cfg.n_kv_heads, cfg.head_dim
    h = rms_norm(x, w.input_norm, cfg.rms_norm_eps)
    k = linear(h, w.k_proj, w.k_bias, kernels).view(N, H_kv, hd)
    k = head_norm(k, w.k_norm, cfg).transpose(0, 1)                               # (H_kv, N, hd)
    v = linear(h, w.v_proj, w.v_bias, kernels).view(N, H_kv, hd).transpose(0, 1)         # (H_kv, N, hd)
    k = apply_rope(k, cos, sin)
    for r in rows:
        cache.write(layer, r.cache_row, r.slots, k[:, r.start:r.end], v[:, r.start:r.end])


def attend(x: torch.Tensor, w: LayerWeights, cfg: ModelConfig, cache: KVCache, layer: int,
           rows: Sequence[RowSpan], cos: torch.Tensor, sin: torch.Tensor,
           kernels: RowKernels = RowKernels()) -> torch.Tensor:
    """Attention, after write_keys: x's queries attend to each sequence's cache row (every slot its mask
    covers already written). -> x + o_proj(attention) (N, D)."""
    N, H, H_kv, hd = x.shape[0], cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    h = rms_norm(x, w.input_norm, cfg.rms_norm_eps)      # again: cheaper to recompute than to keep for a pass
    q = head_norm(linear(h, w.q_proj, w.q_bias, kernels).view(N, H, hd), w.q_norm, cfg).transpose(0, 1)     # (H, N, hd)
    q = apply_rope(q, cos, sin)
    attn = torch.empty_like(q)                                                    # (H, N, hd)
    with sdpa_kernel(SDPA_BACKENDS):
        _attend_rows(q, attn, cache, layer, rows, H, H_kv)
    return x + linear(attn.transpose(0, 1).reshape(N, H * hd), w.o_proj, kernels=kernels)         # (N, D)


# Every backend but cuDNN's: it plans each new query and key length anew, and a tree pass brings new lengths on
# nearly every call (docs/streaming.md §9).
SDPA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def _attend_rows(q: torch.Tensor, attn: torch.Tensor, cache: KVCache, layer: int, rows: Sequence[RowSpan],
                 H: int, H_kv: int) -> None:
    """attn[:, span] = attention of each row's queries q[:, span] (H, t, hd) to its cache row's keys and values
    under its mask, a bounded number of query rows a call. attn, q: (H, N, hd)."""
    for r in rows:
        mask = r.mask_rows(0, r.end - r.start)                                    # (t, S)
        S = mask.shape[-1]
        keys, values = cache.k[layer, r.cache_row, :, :S], cache.v[layer, r.cache_row, :, :S]   # (H_kv, S, hd)
        step = attention_rows(H, S, q.element_size())          # query rows a call: the scores stay bounded
        for a in range(0, r.end - r.start, step):
            span = slice(r.start + a, min(r.end, r.start + a + step))
            attn[:, span] = F.scaled_dot_product_attention(q[None, :, span], keys[None], values[None],
                                                           attn_mask=mask[None, None, a:a + step],
                                                           enable_gqa=H != H_kv)[0]


# The MLP in the three steps a split ring's parts take (gate, up, down), composed by mlp for a whole layer:
#   x + down(silu(gate(h)) * up(h)),  h = rms_norm(x)
def mlp_gate(x: torch.Tensor, w: LayerWeights, cfg: ModelConfig,
             kernels: RowKernels = RowKernels()) -> tuple[torch.Tensor, torch.Tensor]:
    """x (N, D) -> h (N, D) its post-attention norm, silu(gate(h)) (N, F)."""
    h = rms_norm(x, w.post_norm, cfg.rms_norm_eps)
    return h, F.silu(linear(h, w.gate_proj, kernels=kernels))


def mlp_up(h: torch.Tensor, act: torch.Tensor, w: LayerWeights, kernels: RowKernels = RowKernels()) -> torch.Tensor:
    """h (N, D), act = silu(gate(h)) (N, F) -> act * up(h) (N, F)."""
    return act * linear(h, w.up_proj, kernels=kernels)


def mlp_down(x: torch.Tensor, act: torch.Tensor, w: LayerWeights,
             kernels: RowKernels = RowKernels()) -> torch.Tensor:
    """x (N, D), act (N, F) -> x + down(act) (N, D)."""
    return x + linear(act, w.down_proj, kernels=kernels)


def mlp(x: torch.Tensor, w: LayerWeights, cfg: ModelConfig, kernels: RowKernels = RowKernels()) -> torch.Tensor:
    """The MLP block with its residual: (N, D) -> (N, D)."""
    h, act = mlp_gate(x, w, cfg, kernels)
    return mlp_down(x, mlp_up(h, act, w, kernels), w, kernels)


def chunked_logits(x: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """x (R, D) on the compute device, head (V, D) in host memory -> logits (R, V) float32 on x's device: the
    head crosses LM_HEAD_CHUNK_BYTES at a time (a whole lm_head never sits on the device), and each chunk's
    columns are computed as they come."""
    rows = max(1, LM_HEAD_CHUNK_BYTES // (head.shape[1] * head.element_size()))
    out = torch.empty(x.shape[0], head.shape[0], dtype=torch.float32, device=x.device)   # (R, V)
    for a in range(0, head.shape[0], rows):
        out[:, a:a + rows] = F.linear(x, head[a:a + rows].to(x.device)).float()
    return out


class Model:
    """A Llama-family model: resident globals plus a LayerSource (resident list or streaming ring)."""

    def __init__(self, cfg: ModelConfig, globals_: GlobalWeights, layers: LayerSource):
        self.cfg = cfg
        self.globals = globals_
        self.layers = layers
        self.dtype = globals_.final_norm.dtype
        self.device = globals_.final_norm.device     # the compute device (the embedding may stay on the host)
        self.inv_freq = rope_inv_freq(cfg).to(self.device)

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        """(N,) ids -> (N, D) on the compute device; an embedding kept in host memory is looked up there and
        only the N rows cross (the ids come back first: a synchronization, once a pass)."""
        table = self.globals.embed
        if table.device == self.device:
            return F.embedding(tokens, table)
        return F.embedding(tokens.to(table.device), table).to(self.device)

    def forward(
        self,
        tokens: torch.Tensor,       # (N,) new token ids of every sequence, packed
        positions: torch.Tensor,    # (N,) their RoPE positions
        rows: Sequence[RowSpan],    # the sequences: spans of the N rows, each with its cache row, slots and mask
        cache: KVCache,
        logit_rows: Optional[torch.Tensor] = None,  # (R,) packed rows whose logits are needed; None = all
        chunk: Optional[int] = None,                # packed rows per layer call; None = all N at once
    ) -> torch.Tensor:
        """-> logits (R, V) float32."""
        N = tokens.shape[0]
        step = N if chunk is None else max(1, chunk)
        # Per chunk, the spans cut to it and renumbered from 0. One chunk: its masks are built once for every
        # layer. Several: each chunk's rows are built as its turn comes in each layer (a comparison, cheap next
        # to the layer) rather than holding the whole (T, S) mask of a long prompt.
        bounds = [(a, min(N, a + step)) for a in range(0, N, step)]
        if len(bounds) == 1:
            pieces = [(0, N, [RowSpan(r.start, r.end, r.cache_row, r.slots, r.mask_rows(0, r.end - r.start))
                              for r in rows])]
        else:
            pieces = [(a, b, [RowSpan(c.start - a, c.end - a, c.cache_row, c.slots, c.mask)
                              for r in rows if (c := r.clip(a, b)) is not None]) for a, b in bounds]
        x = self.embed(tokens)                                                       # (N, D)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)                # (N, hd) each
        kernels = RowKernels.of([r.end - r.start for r in rows], self.device, self.dtype)
        pass_rows = PassRows(self.cfg, cache, pieces, cos, sin, kernels)
        for i, w in self.layers.pass_layers():
            run_layer(x, w, i, pass_rows)
        if logit_rows is not None:
            x = x[logit_rows]
            kernels = kernels.take(logit_rows)
        x = rms_norm(x, self.globals.final_norm, self.cfg.rms_norm_eps)
        head = self.globals.lm_head
        if isinstance(head, torch.Tensor) and head.device != self.device:
            return chunked_logits(x, head)                                          # (R, V)
        return linear(x, head, kernels=kernels).float()                             # (R, V)
