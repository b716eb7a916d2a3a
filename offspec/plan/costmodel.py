"""Predicted seconds per token on hardware that is not here (a GPU's link and compute), from a plan's bytes.

The running hardware's own costs are measured while generating and drive the tree budget (controller.py);
this module only predicts, and every figure it gives is labelled a PREDICTION where it is reported. Its GPU
inputs are measured ones (MeasuredGpu, labelled by device), except the link: a user's PCIe 4.0 x16 is assumed
(LINK_GB_PER_S), since the GPU measured sat on PCIe 5.0."""
from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Optional

LINK_GB_PER_S = 24.0    # a PREDICTION input: pinned host->device copies over PCIe 4.0 x16, a gaming PC's link
DISK_GBPS = 3.0                 # a PREDICTION input: a PCIe 4.0 NVMe drive's lower end, GB/s
PAGEABLE_GB_PER_S = 9.0  # pageable copies (the driver stages them), as measured on REFERENCE_GPU (docs/notes/2026-11-26-first-gpu-contact.md)


@dataclass(frozen=True)
class MeasuredGpu:
    """One GPU's pass components, measured by scripts/gpu_session.py (docs/notes/2026-11-26-first-gpu-contact.md).

    link_gb_per_s: pinned copies of 1.71 GB layers on the copy stream (the median of the pass's widths).
    layer_compute_s: (tokens in the pass, seconds) of ONE Llama-3.1-70B-shaped bf16 decoder layer (layer_params
    matrix parameters) after a 256-token prefix; other shapes scale by their parameters (a PREDICTION).
    draft_call_s: (tokens, seconds) of one call of a Llama-3.2-1B-shaped bf16 draft, the lower of two runs.
    dequant_s_per_gb: seconds to dequantize a layer into 1 GB of dense bf16, per target quantization (as
    published.short names it), measured where dequant_device says.
    tests/test_costmodel.py checks these against the committed results (docs/gpu_70b*.json, docs/gpu/)."""
    device: str
    link_gb_per_s: float
    layer_params: int
    layer_compute_s: tuple[tuple[int, float], ...]
    draft_call_s: tuple[tuple[int, float], ...]
    dequant_s_per_gb: tuple[tuple[str, float], ...]
    dequant_device: str


H100 = MeasuredGpu(
    device="NVIDIA H100 80GB HBM3 (PCIe 5.0 x16), 2026-11-26",
    link_gb_per_s=53.0, layer_params=855_638_016,
    layer_compute_s=((1, 0.85e-3), (64, 0.91e-3), (256, 1.08e-3), (1024, 3.34e-3)),
    draft_call_s=((1, 12.2e-3), (64, 11.4e-3), (256, 11.0e-3), (1024, 11.5e-3)),
    dequant_s_per_gb=(("int8", 4.75e-3 / 1.711), ("nf4", 1.06e-3 / 1.711),
                      ("awq-g128", 39.64e-3 / 1.711), ("gptq-b4-g128-v2", 26.60e-3 / 1.711),
                      ("ct-b4-g128-bf16", 18.27e-3 / 1.711), ("gguf-q4_k+q6_k", 55.28e-3 / 1.711)),
    # the published formats measured on an H200: docs/notes/2026-11-27-h200-session.md
    dequant_device="an H100 (int8, nf4) and an H200 (published formats)")
REFERENCE_GPU = H100     # the GPU whose measured components the predictions use


def _at(points: tuple[tuple[int, float], ...], x: float) -> float:
    """Piecewise-linear through measured (x, y) points, extended along the last segment beyond them and held at
    the first point below them."""
    xs = [p[0] for p in points]
    i = min(max(bisect.bisect_left(xs, x), 1), len(xs) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    return y0 if x <= x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def pass_compute_seconds(layer_params: int, n_layers: int, tokens: int, gpu: MeasuredGpu = REFERENCE_GPU) -> float:
    """PREDICTION: a target pass's compute over `tokens` tokens, from the measured 70B-shaped layer, scaled by
    the layers' matrix parameters."""
    return n_layers * _at(gpu.layer_compute_s, tokens) * layer_params / gpu.layer_params


def draft_call_seconds(tokens: int, gpu: MeasuredGpu = REFERENCE_GPU) -> float:
    """A 1B-shaped draft's call over `tokens` tokens, as measured (launch-bound: about the same at 1-1024)."""
    return _at(gpu.draft_call_s, tokens)


def dequant_seconds(quant: str, dense_bytes: int, gpu: MeasuredGpu = REFERENCE_GPU) -> float:
    """One layer's dequantization into `dense_bytes` of dense weights (0 for an unquantized target, and for a
    quantization not measured yet: dequant_measured)."""
    return dict(gpu.dequant_s_per_gb).get(quant, 0.0) * dense_bytes / 1e9


def dequant_measured(quant: str, gpu: MeasuredGpu = REFERENCE_GPU) -> bool:
    return quant in dict(gpu.dequant_s_per_gb)


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
    rate and pageable ones at pageable_gb_per_s, one after another on the copy stream, where each quantized
    layer's dequantization follows its copy (dequant_s in all); the drive reads disk_read bytes (default: disk;
    the store reads whole blocks where a copy may move less of them), the reads overlapping the copies:
    max(copies + dequant_s, disk_read / drive)."""
    copies = (pinned + disk) / link_gb_per_s + pageable / min(link_gb_per_s, pageable_gb_per_s)
    read = disk if disk_read is None else disk_read
    return max(copies / 1e9 + dequant_s, read / disk_gb_per_s / 1e9 if disk_gb_per_s else 0.0)
