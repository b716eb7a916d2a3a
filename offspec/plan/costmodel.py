"""Predicted seconds per token on hardware that is not here (a GPU's link and compute), from a plan's bytes.

The running hardware's own costs are measured while generating and drive the tree budget (controller.py);
this module only predicts, and every figure it gives is labelled a PREDICTION where it is reported. Its GPU
inputs are measured ones, each record naming the card that measured it (MeasuredGpu, MeasuredDequant); a card
that measured nothing (a user's RTX 4090) is predicted from them by its published figures (GpuSpec): compute
that reads the weights once scales by memory bandwidth, the rest by the bf16 matrix rate, and the
dequantization kernels, which are memory-bound, by memory bandwidth. The link is the card's desktop slot's
(PCIe 4.0 x16: LINK_GB_PER_S, assumed), or what `offspec doctor` measured."""
from __future__ import annotations

import bisect
import re
from dataclasses import dataclass
from typing import Optional

from offspec.formats.published import short as short_quant

LINK_GB_PER_S = 24.0    # a PREDICTION input: pinned host->device copies over PCIe 4.0 x16, a gaming PC's link
PCIE5_GB_PER_S = 50.0   # a PREDICTION input: PCIe 5.0 x16 (an H100 and an H200 measured 53-55 pinned)
DISK_GBPS = 2.0         # a PREDICTION input where doctor has measured no drive: the NVMe drives measured so far
                        # read 1.9-2.3 GB/s (docs/notes/2026-11-23-layers-bin-read-rate.md)
PAGEABLE_GB_PER_S = 9.0  # pageable copies (the driver stages them), as measured on the H100 (docs/notes/2026-11-26-first-gpu-contact.md)


@dataclass(frozen=True)
class GpuSpec:
    """A card's published figures (the vendor's datasheets): memory, memory bandwidth, and dense bf16 tensor
    throughput with float32 accumulation (what PyTorch's bf16 matmuls run; half the float16-accumulate figure on
    GeForce cards), and the pinned host link its desktop slot gives (a PREDICTION input)."""
    name: str                   # as torch.cuda.get_device_name() says it
    memory_gb: float
    bandwidth_gb_per_s: float
    bf16_tflops: float
    link_gb_per_s: float = LINK_GB_PER_S

    @property
    def key(self) -> str:
        """The short name `models info --gpu` takes: 'rtx4090', 'h100'."""
        return _normalized(self.name)


GPUS = (
    GpuSpec("NVIDIA GeForce RTX 3090", 24, 936, 35.6),
    GpuSpec("NVIDIA GeForce RTX 4060 Ti", 16, 288, 44.1),
    GpuSpec("NVIDIA GeForce RTX 4070 Ti", 12, 504, 80.2),
    GpuSpec("NVIDIA GeForce RTX 4080", 16, 717, 97.5),
    GpuSpec("NVIDIA GeForce RTX 4090", 24, 1008, 165.2),
    GpuSpec("NVIDIA GeForce RTX 5090", 32, 1792, 209.5, PCIE5_GB_PER_S),
    GpuSpec("NVIDIA H100", 80, 3352, 989.4, PCIE5_GB_PER_S),     # SXM5, HBM3: the card offspec measured
    GpuSpec("NVIDIA H200", 141, 4800, 989.4, PCIE5_GB_PER_S),
)


def _normalized(name: str) -> str:
    """'NVIDIA GeForce RTX 4090' -> 'rtx4090'; 'NVIDIA H100 80GB HBM3' -> 'h100' (memory and form factor dropped)."""
    name = re.sub(r"\b(nvidia|geforce|\d+\s*gb|hbm\w*|sxm\w*)\b", "", name.lower())
    return re.sub(r"[^a-z0-9]", "", name)


def find_gpu(name: str) -> Optional[GpuSpec]:
    """The table's card of this name ('RTX 4090', '4090', 'NVIDIA GeForce RTX 4090', 'H100 80GB HBM3'), or None."""
    key = _normalized(name)
    return next((g for g in GPUS if key in (g.key, g.key.removeprefix("rtx"))), None)


def gpu_keys() -> str:
    return ", ".join(g.key for g in GPUS)


@dataclass(frozen=True)
class MeasuredGpu:
    """One GPU's pass components, measured by scripts/gpu_session.py on the card `spec` names.

    link_gb_per_s: pinned copies of 1.71 GB layers on the copy stream (the median of the pass's widths).
    layer_compute_s: (tokens in the pass, seconds) of ONE Llama-3.1-70B-shaped bf16 decoder layer (layer_params
    matrix parameters) after a 256-token prefix; other shapes scale by their parameters (a PREDICTION).
    draft_call_s: (tokens, seconds) of one call of a Llama-3.2-1B-shaped bf16 draft, the lower of two runs.
    tests/test_costmodel.py checks these against the committed results (docs/gpu_70b*.json)."""
    device: str                 # the card, its link and the date, as measured
    spec: GpuSpec
    link_gb_per_s: float
    layer_params: int
    layer_compute_s: tuple[tuple[int, float], ...]
    draft_call_s: tuple[tuple[int, float], ...]


@dataclass(frozen=True)
class MeasuredDequant:
    """Seconds to dequantize a 70B-shaped layer into 1 GB of dense bf16, per target quantization (as
    published.short names it), by the kernels offspec runs on the card `spec` names: the Triton kernels, and
    bitsandbytes' for nf4 (scripts/gpu_session.py's dequant part; tests/test_costmodel.py checks them against
    the committed results)."""
    device: str
    spec: GpuSpec
    s_per_gb: tuple[tuple[str, float], ...]


_H100, _H200 = find_gpu("H100"), find_gpu("H200")
H100 = MeasuredGpu(
    device="an NVIDIA H100 80GB HBM3 (PCIe 5.0 x16), 2026-11-26", spec=_H100,
    link_gb_per_s=53.0, layer_params=855_638_016,
    layer_compute_s=((1, 0.85e-3), (64, 0.91e-3), (256, 1.08e-3), (1024, 3.34e-3)),
    draft_call_s=((1, 12.2e-3), (64, 11.4e-3), (256, 11.0e-3), (1024, 11.5e-3)))
# docs/gpu/2026-11-28-h200/gpu_70b.json, each format's row in offspec's tile (formats.kernels.TILES)
DEQUANT = MeasuredDequant(
    device="an NVIDIA H200, 2026-11-28", spec=_H200,
    s_per_gb=(("int8", 0.721e-3 / 1.711), ("nf4", 0.983e-3 / 1.711), ("awq-g128", 1.176e-3 / 1.711),
              ("gptq-b4-g128-v2", 0.977e-3 / 1.711), ("gptq-b4-g128", 1.020e-3 / 1.711),
              ("ct-b4-g128-bf16", 1.485e-3 / 1.711), ("ct-b8-g0-asym-f16", 1.644e-3 / 1.711),
              ("gguf-q4_k+q6_k", 0.923e-3 / 1.711)))
REFERENCE_GPU = H100     # the GPU whose measured compute, link and draft the predictions use


def _at(points: tuple[tuple[int, float], ...], x: float) -> float:
    """Piecewise-linear through measured (x, y) points, extended along the last segment beyond them and held at
    the first point below them."""
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 if x <= x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def pass_compute_seconds(layer_params: int, n_layers: int, tokens: int, card: Optional[GpuSpec] = None,
                         gpu: MeasuredGpu = REFERENCE_GPU) -> float:
    """PREDICTION: a target pass's compute over `tokens` tokens, from the measured 70B-shaped layer, scaled by
    the layers' matrix parameters; on another card (card), the one-token layer (reading the weights once) by
    memory bandwidth and what more tokens add by the bf16 rate."""
    one, more = _at(gpu.layer_compute_s, 1), _at(gpu.layer_compute_s, tokens) - _at(gpu.layer_compute_s, 1)
    if card is not None:
        one *= gpu.spec.bandwidth_gb_per_s / card.bandwidth_gb_per_s
        more *= gpu.spec.bf16_tflops / card.bf16_tflops
    return n_layers * (one + more) * layer_params / gpu.layer_params


def draft_call_seconds(tokens: int, gpu: MeasuredGpu = REFERENCE_GPU) -> float:
    """A 1B-shaped draft's call over `tokens` tokens, as measured (launch-bound: about the same at 1-1024)."""
    return _at(gpu.draft_call_s, tokens)


def dequant_figure(quant: str) -> Optional[tuple[str, float]]:
    """(the measured format standing for `quant` (a target quantization, or as published.short names it), its
    seconds per dense GB on DEQUANT's card), or None: the
    format itself where measured, else the measured one of its kernel (AWQ, GPTQ, compressed-tensors of its
    bits, GGUF), whose work per weight is the same."""
    quant, figures = short_quant(quant), dict(DEQUANT.s_per_gb)
    if quant in figures:
        return quant, figures[quant]
    family = ("awq-" if quant.startswith("awq-") else "gptq-" if quant.startswith("gptq-") else
              quant[:6] if quant.startswith("ct-b") else "gguf-" if quant.startswith("gguf-") else None)
    near = next((q for q in figures if family and q.startswith(family)), None)
    return (near, figures[near]) if near else None


def dequant_seconds(quant: str, dense_bytes: int, card: Optional[GpuSpec] = None) -> float:
    """One layer's dequantization into `dense_bytes` of dense weights, on DEQUANT's card or scaled to `card` by
    memory bandwidth (0 for an unquantized target and a format with no kernel measured: dequant_figure)."""
    figure = dequant_figure(quant)
    scale = DEQUANT.spec.bandwidth_gb_per_s / card.bandwidth_gb_per_s if card is not None else 1.0
    return figure[1] * dense_bytes / 1e9 * scale if figure else 0.0


@dataclass(frozen=True)
class GpuSetup:
    """A hypothetical machine for `predict_seconds_per_token`."""
    link_gb_per_s: float = LINK_GB_PER_S  # host->device bandwidth, pinned
    resident_bytes: int = 0           # target weight bytes kept on the GPU for good (not moved per pass)
    dequant_s_per_layer: float = 0.0  # a held quantized resident layer's dequantization (--resident-quant):
                                      # dequant_seconds(quant, dense layer bytes)


def predict_seconds_per_token(streamed_bytes: int, setup: GpuSetup, tokens_per_pass: float,
                              draft_seconds_per_round: float, compute_seconds_per_pass: float = 0.0,
                              held_layers: int = 0) -> dict:
    """PREDICTION for a streamed target on a GPU:
        t_pass  = max(streamed_bytes / link, compute) + held_layers * dequant   (copies overlap compute; the held
                  resident layers' dequantization runs on the compute queue, in line with it)
        s/token = (t_pass + t_draft) / tokens_per_pass
    (the draft is not overlapped with the pass here, a conservative assumption)."""
    transfer = max(streamed_bytes - setup.resident_bytes, 0) / (setup.link_gb_per_s * 1e9)
    t_pass = max(transfer, compute_seconds_per_pass) + held_layers * setup.dequant_s_per_layer
    return {
        "transfer_seconds_per_pass": transfer,
        "pass_seconds": t_pass,
        "seconds_per_token": (t_pass + draft_seconds_per_round) / max(tokens_per_pass, 1e-9),
        "formula": "(max(bytes/link, compute) + held layers x dequant + draft) / tokens_per_pass",
    }


def transfer_seconds(pinned: int, pageable: int, disk: int, link_gb_per_s: float, pageable_gb_per_s: float,
                     disk_gb_per_s: Optional[float], disk_read: Optional[int] = None, dequant_s: float = 0.0) -> float:
    """PREDICTION: a pass's transfer from its bytes by tier. Pinned and disk-staged bytes cross the link at its
    rate and pageable ones at pageable_gb_per_s, one after another on the copy stream; the quantized layers'
    dequantization (dequant_s in all) runs on its own queue, each layer's while the next one is copied; the drive
    reads disk_read bytes (default: disk; the store reads whole blocks where a copy may move less of them), the
    reads overlapping the copies: max(copies, dequant_s, disk_read / drive)."""
    copies = (pinned + disk) / link_gb_per_s + pageable / min(link_gb_per_s, pageable_gb_per_s)
    read = disk if disk_read is None else disk_read
    return max(copies / 1e9, dequant_s, read / disk_gb_per_s / 1e9 if disk_gb_per_s else 0.0)
