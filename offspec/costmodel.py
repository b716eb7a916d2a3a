"""Predicted seconds per token on hardware that is not here (a GPU's link and compute), from a plan's bytes.

The running hardware's own costs are measured while generating and drive the tree budget (controller.py);
this module only predicts, and every figure it gives is labelled a PREDICTION where it is reported."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GpuSetup:
    """A hypothetical machine for `predict_seconds_per_token`."""
    link_gb_per_s: float = 24.0       # host->device bandwidth, pinned (PCIe 4.0 x16 ≈ 24 GB/s)
    resident_bytes: int = 0           # target weight bytes kept on the GPU for good (not moved per pass)
    dequant_s_per_layer: float = 1e-3  # a held quantized resident layer's dequantization (--resident-quant): ~1 ms
                                       # a layer on a GPU (the streamer's figure; not measured on a GPU here)


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
