"""PREDICTION of a target pass's seconds: its transfer by tier (pinned, pageable, disk) and its dequantization."""
from __future__ import annotations

from typing import Optional

from offspec.plan.costmodel import PAGEABLE_GB_PER_S, GpuSpec, dequant_seconds, transfer_seconds
from offspec.plan.machine import GB
from offspec.plan.memory import MemoryPlan
from offspec.plan.placement import Placement


def predicted_pass_seconds(plan: MemoryPlan, link_gb_per_s: float, disk_gb_per_s: Optional[float] = None,
                           pageable_gb_per_s: float = PAGEABLE_GB_PER_S, card: Optional[GpuSpec] = None) -> float:
    """PREDICTION: the copy stream's time in one target pass (copies overlap compute, so this is its floor when
    streaming dominates): transfer_seconds of its bytes by tier (on a GPU the arena's layers past its pinned ones
    are pageable: the driver stages them through a bounce buffer) and of the streamed layers' dequantization,
    which runs beside the copies (streamed_dequant_seconds, on `card` when given), plus an lm_head kept in host
    memory, whose pageable chunks cross after the layers (not overlapped)."""
    p = plan.placement
    pageable = plan.moved_by(p.host_layers[plan.pinned_layers:]) if plan.machine.kind == "cuda" else 0
    disk = plan.moved_by(p.disk_layers)
    return (transfer_seconds(plan.streamed_bytes - pageable - disk, pageable, disk, link_gb_per_s, pageable_gb_per_s,
                             disk_gb_per_s, plan.disk_read_bytes, streamed_dequant_seconds(plan, card))
            + plan.host_head_bytes / (min(link_gb_per_s, pageable_gb_per_s) * GB))


def streamed_dequant_seconds(plan: MemoryPlan, card: Optional[GpuSpec] = None) -> float:
    """PREDICTION: the dequantization of a pass's streamed layers on a GPU's dequantization queue
    (costmodel.dequant_seconds, measured, scaled to `card`; 0 for a dense target, a CPU, or a compact ring,
    whose layers dequantize on the compute queue instead: Placement.dequantized_in_line)."""
    return pipelined_dequant_seconds(plan.placement, plan.target_quant, card) if plan.machine.kind == "cuda" else 0.0


def pipelined_dequant_seconds(placement: Placement, quant: str, card: Optional[GpuSpec] = None) -> float:
    """PREDICTION: a GPU's dequantization of `placement`'s streamed layers, stored in `quant`, on the
    dequantization queue beside the copies (0 for a compact ring's, which dequantize on the compute queue)."""
    if placement.compact:
        return 0.0
    return len(placement.streamed) * dequant_seconds(quant, placement.layer_nbytes, card)
