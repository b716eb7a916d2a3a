"""The Llama-family forward, written once as functions of explicit weights.

Llama 1/2/3 (incl. llama3 / linear rope scaling), Mistral, Qwen2 (qkv bias) and SmolLM share this code.
The resident draft and the streamed target both run `layer_forward`; they differ only in where a layer's
weights come from (a list of resident layers, or a slot of the streaming ring).

Three index tensors stay separate everywhere (never merged):
  slots      (T,)    where each new token's K/V is written in the cache
  positions  (B, T)  the RoPE position of each new token (prefix length + tree depth)
  mask       (B, T, S) bool, True = may attend; S = cache columns attended (0 .. S-1); or a MaskRows
                     function giving rows [a, b) of it, so a long pass never builds the whole (T, S) mask

A forward may run each layer over its rows in chunks (`chunk`): every row of chunk k attends only to
slots of earlier rows or its own (causal prompt rows, tree rows and their ancestors), all written to the
cache before chunk k runs, so the result is the same while a long prompt's intermediates stay chunk-sized.
The layer's weights are used by every chunk before the next layer is asked for, so a streamed target
still moves each layer once per pass.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, Optional, Protocol, Union

import torch
import torch.nn.functional as F

from .config import ModelConfig
from .kv_cache import KVCache
from .layout import GlobalWeights, LayerWeights
from .quant import linear


MaskRows = Callable[[int, int], torch.Tensor]   # (a, b) -> rows a..b-1 of the mask, (B, b - a, S) bool


class LayerSource(Protocol):
    """Gives the layers of one forward pass in order. A streamed source may reuse a slot once the
    consumer asks for the next layer, so the caller must not keep a yielded LayerWeights."""
    def pass_layers(self) -> Iterator[tuple[int, LayerWeights]]: ...


class ResidentLayers:
    """All layers live on the compute device for good."""

    def __init__(self, layers: list[LayerWeights]):
        self.layers = layers

    def pass_layers(self) -> Iterator[tuple[int, LayerWeights]]:
        yield from enumerate(self.layers)


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
    """positions (B, T) -> cos, sin (B, 1, T, hd), computed in float32 then cast (as transformers does)."""
    freqs = positions.to(torch.float32)[..., None] * inv_freq.to(positions.device)  # (B, T, hd/2)
    emb = torch.cat((freqs, freqs), dim=-1)                                        # (B, T, hd)
    return emb.cos().to(dtype)[:, None], emb.sin().to(dtype)[:, None]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hd)."""
    return x * cos + _rotate_half(x) * sin


# ---------------------------------------------------------------- layers

def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Normalize in float32, scale in the input dtype (bit-compatible with transformers' LlamaRMSNorm)."""
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def layer_forward(
    x: torch.Tensor,            # (B, T, D) hidden states of the new tokens
    w: LayerWeights,
    cfg: ModelConfig,
    cache: KVCache,
    layer: int,                 # index of this layer in `cache`
    slots: torch.Tensor,        # (T,) cache slots the new K/V go to
    cos: torch.Tensor,          # (B, 1, T, hd)
    sin: torch.Tensor,          # (B, 1, T, hd)
    mask: torch.Tensor,         # (B, T, S) bool, True = attend; S cache columns
) -> torch.Tensor:
    B, T, _ = x.shape
    H, H_kv, hd = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim

    h = rms_norm(x, w.input_norm, cfg.rms_norm_eps)
    q = linear(h, w.q_proj, w.q_bias).view(B, T, H, hd).transpose(1, 2)          # (B, H, T, hd)
    k = linear(h, w.k_proj, w.k_bias).view(B, T, H_kv, hd).transpose(1, 2)       # (B, H_kv, T, hd)
    v = linear(h, w.v_proj, w.v_bias).view(B, T, H_kv, hd).transpose(1, 2)       # (B, H_kv, T, hd)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    cache.write(layer, slots, k, v)
    S = mask.shape[-1]
    keys, values = cache.k[layer, :B, :, :S], cache.v[layer, :B, :, :S]            # (B, H_kv, S, hd)
    attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask[:, None], enable_gqa=H != H_kv)
    x = x + linear(attn.transpose(1, 2).reshape(B, T, H * hd), w.o_proj)          # (B, T, D)

    h = rms_norm(x, w.post_norm, cfg.rms_norm_eps)
    return x + linear(F.silu(linear(h, w.gate_proj)) * linear(h, w.up_proj), w.down_proj)


class Model:
    """A Llama-family model: resident globals plus a LayerSource (resident list or streaming ring)."""

    def __init__(self, cfg: ModelConfig, globals_: GlobalWeights, layers: LayerSource):
        self.cfg = cfg
        self.globals = globals_
        self.layers = layers
        self.inv_freq = rope_inv_freq(cfg).to(globals_.embed.device)
        self.dtype = globals_.embed.dtype
        self.device = globals_.embed.device

    def forward(
        self,
        tokens: torch.Tensor,       # (B, T) new token ids
        positions: torch.Tensor,    # (B, T) RoPE positions
        slots: torch.Tensor,        # (T,) cache slots
        mask: Union[torch.Tensor, MaskRows],   # (B, T, S) bool, or its rows on demand
        cache: KVCache,
        logit_rows: Optional[torch.Tensor] = None,  # (R,) rows of T whose logits are needed; None = all
        chunk: Optional[int] = None,                # rows per layer call; None = all T at once
    ) -> torch.Tensor:
        """-> logits (B, R, V) float32."""
        T = tokens.shape[1]
        rows_of = mask if callable(mask) else (lambda a, b: mask[:, a:b])
        step = T if chunk is None else max(1, chunk)
        spans = [(a, min(T, a + step)) for a in range(0, T, step)]
        # One chunk: build its mask once for every layer. Several: rebuild each (a comparison, cheap next to
        # the layer) rather than hold the whole (T, S) mask of a long prompt.
        only_mask = rows_of(0, T) if len(spans) == 1 else None
        x = F.embedding(tokens, self.globals.embed)                                  # (B, T, D)
        cos, sin = rope_cos_sin(self.inv_freq, positions, self.dtype)                # (B, 1, T, hd) each
        for i, w in self.layers.pass_layers():
            if only_mask is not None:
                x = layer_forward(x, w, self.cfg, cache, i, slots, cos, sin, only_mask)
                continue
            for a, b in spans:
                x[:, a:b] = layer_forward(x[:, a:b], w, self.cfg, cache, i, slots[a:b], cos[:, :, a:b],
                                          sin[:, :, a:b], rows_of(a, b))
        if logit_rows is not None:
            x = x[:, logit_rows]
        x = rms_norm(x, self.globals.final_norm, self.cfg.rms_norm_eps)
        return linear(x, self.globals.lm_head).float()                              # (B, R, V)
