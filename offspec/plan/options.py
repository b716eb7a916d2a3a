"""The options worth considering for a target on a machine, each one planned and its pass time predicted: what
`offspec models info` and `offspec doctor` print, marking the one `auto` would use and the fastest.

    compare(target, draft, offload, runtime, limits, machine, rates) -> Comparison
    Comparison.table() -> str

An option is a target quantization (bf16 as given, int8, nf4: a quantized target is another model, whose output
offspec reproduces exactly) and an offload mode (none, cpu, cpu+disk, disk). Each is planned by plan.make_plan
with the run's other settings; one that cannot fit is listed by name. Pass times are PREDICTIONS: the streamed
bytes over the link, the streamed layers' dequantization beside the copies and the disk layers' bytes over the
drive (plan.predicted_pass_seconds), plus the held resident layers' dequantization (costmodel.dequant_seconds,
measured on a GPU); a plan that streams nothing is compute-bound (0 here).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from offspec.config import OffloadConfig, RunLimits, RuntimeConfig
from offspec.errors import BudgetError
from offspec.formats.layout import arena_stride
from offspec.formats.layout import format_bytes as fmt
from offspec.formats.published import short as short_quant
from offspec.plan.costmodel import GpuSpec, dequant_seconds
from offspec.plan.machine import PINNED_FRACTION, Machine
from offspec.plan.memory import MemoryPlan
from offspec.plan.passtime import predicted_pass_seconds
from offspec.plan.search import make_plan
from offspec.plan.sizes import ModelSpec, published_runtime

QUANTS = ("none", "int8", "nf4")
MODES = ("none", "cpu", "cpu+disk", "disk")
DRAFT_CHOICES = ("none", "int8-held", "nf4", "int4")   # ways to hold the draft on a GPU: dense, or held quantized


@dataclass(frozen=True)
class Option:
    """One option planned: its plan and PREDICTED pass time."""
    target_quant: str
    mode: str                        # the offload mode asked for (the plan may resolve cpu+disk to cpu or disk)
    plan: MemoryPlan
    pass_seconds: float              # PREDICTED; 0 when nothing streams
    plan_draft_quant: str = "none"   # how the plan holds the draft (--draft-quant)

    @property
    def key(self) -> tuple:
        """Two options whose plans place the layers alike are one row (a forced cpu or disk mode whose plan keeps
        every layer resident is the "none" row again)."""
        p = self.plan.placement
        if not p.streamed:
            return self.target_quant, "resident"
        return self.target_quant, p.mode, p.resident, p.host_layers, p.n_slots


@dataclass(frozen=True)
class Comparison:
    options: tuple[Option, ...]      # the ones that fit, fastest first
    refused: tuple[str, ...]         # "nf4 none", ...: the ones that do not fit
    auto: Optional[Option]           # what the run's own settings plan (None: they do not fit)
    keep_in_ram: Optional[int]       # host bytes the run's target would need to stream from pinned RAM alone
    drafts: tuple[Option, ...] = ()  # the fastest row again with each way of holding the draft (DRAFT_CHOICES)

    def to_dict(self) -> dict:
        rows = [{"target_quant": o.target_quant, "mode": o.plan.mode, "resident": len(o.plan.placement.resident),
                 "in_ram": len(o.plan.placement.host_layers), "from_disk": len(o.plan.placement.disk_layers),
                 "device_bytes": o.plan.total("device"), "host_bytes": o.plan.total("host"),
                 "predicted_pass_seconds": o.pass_seconds, "auto": self.auto is not None and o.key == self.auto.key,
                 "fastest": o.key == self.options[0].key} for o in self.options]
        drafts = [{"draft_quant": o.plan_draft_quant, "predicted_pass_seconds": o.pass_seconds,
                   "resident": len(o.plan.placement.resident)} for o in self.drafts]
        return {"options": rows, "refused": list(self.refused), "keep_in_ram_host_bytes": self.keep_in_ram,
                "drafts": drafts}

    def table(self) -> str:
        """The options as aligned text, the auto one and the fastest marked."""
        if not self.options:
            return "options: nothing fits this machine, in any target quantization or offload mode"
        rows = [("target", "offload", "resident", "in RAM", "from disk", "device", "host", "pass (PREDICTED)", "")]
        fastest = self.options[0]
        for o in self.options:
            p = o.plan.placement
            mark = ", ".join(m for m, on in (("auto", self.auto is not None and o.key == self.auto.key),
                                             ("fastest", o.key == fastest.key)) if on)
            rows.append((_quant_name(o), p.mode, str(len(p.resident)), str(len(p.host_layers)),
                         str(len(p.disk_layers)), fmt(o.plan.total("device")), fmt(o.plan.total("host")),
                         f"{o.pass_seconds:.2f} s" if p.streamed else "nothing streams", mark))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
        published = fastest.target_quant not in QUANTS          # a published checkpoint: its own quantization only
        lines = ["options (the target as published: its output exactly):" if published else
                 "options (int8 / nf4 change the target: the output is that quantized model's):"]
        lines += ["  " + "  ".join(cell.ljust(w) for cell, w in zip(r, widths)).rstrip() for r in rows]
        if self.refused:
            lines.append("  does not fit: " + ", ".join(self.refused))
        if len(self.drafts) > 1:
            lines.append(f"  the draft, for the fastest row ({_quant_name(fastest)} {fastest.plan.mode}): " + ", ".join(
                f"{'as stored' if o.plan_draft_quant == 'none' else o.plan_draft_quant} {o.pass_seconds:.2f} s "
                f"({len(o.plan.placement.resident)} resident)" for o in self.drafts)
                + " (a held draft changes how often its tokens are accepted, never the output)")
        if self.keep_in_ram is not None:
            lines.append(f"  every streamed layer in pinned RAM would take about {fmt(self.keep_in_ram)} of usable host "
                         f"memory (this machine: {fmt(self.auto.plan.machine.host_bytes)})")
        return "\n".join(lines)


def _quant_name(o: Option) -> str:
    return "as stored" if o.target_quant == "none" else short_quant(o.target_quant)   # published: e.g. awq-g128


def compare(target: ModelSpec, draft: Optional[ModelSpec], offload: OffloadConfig, runtime: RuntimeConfig,
            limits: RunLimits, machine: Machine, link_gbps: float, disk_gbps: float,
            card: Optional[GpuSpec] = None) -> Comparison:
    """Plan every target quantization and offload mode on `machine` with the run's other settings (a published
    checkpoint: its own quantization only); pass times PREDICTED for `card` (costmodel.GpuSpec) when given."""
    runtime = published_runtime(target, runtime)
    def option(quant: str, mode: str, draft_quant: str = runtime.draft_quant) -> Option:
        plan = make_plan(target, draft, replace(offload, mode=mode),
                         replace(runtime, target_quant=quant, draft_quant=draft_quant), limits, machine)
        return Option(quant, mode, plan, _pass_seconds(plan, link_gbps, disk_gbps, card), draft_quant)

    found, refused = {}, []
    for quant in (QUANTS if target.quant == "none" else (target.quant,)):   # a published checkpoint: as it is
        for mode in MODES:
            try:
                o = option(quant, mode)
            except BudgetError:
                refused.append(f"{'as stored' if quant == 'none' else short_quant(quant)} {mode}")
                continue
            found.setdefault(o.key, o)
    try:
        auto = option(runtime.target_quant, offload.mode)
        found.setdefault(auto.key, auto)
    except BudgetError:
        auto = None
    options = tuple(sorted(found.values(), key=lambda o: (o.pass_seconds, o.target_quant != "none")))
    keep = _pinned_host_for_all(target, draft, offload, runtime, limits, auto.plan) \
        if auto is not None and auto.plan.placement.disk_layers else None
    return Comparison(options, tuple(refused), auto, keep, _drafts(options[0], draft, option) if options else ())


def _drafts(fastest: Option, draft: Optional[ModelSpec], option) -> tuple[Option, ...]:
    """The fastest option with the draft held each way that fits (none when there is no draft; a twin is never
    dense)."""
    if draft is None:
        return ()
    found = []
    for draft_quant in DRAFT_CHOICES[1:] if draft.twin else DRAFT_CHOICES:
        try:
            found.append(option(fastest.target_quant, fastest.mode, draft_quant))
        except BudgetError:
            continue
    return tuple(found)


def _pass_seconds(plan: MemoryPlan, link_gbps: float, disk_gbps: float, card: Optional[GpuSpec] = None) -> float:
    in_line = plan.placement.dequantized_in_line * dequant_seconds(plan.target_quant, plan.placement.layer_nbytes, card)
    return predicted_pass_seconds(plan, link_gbps, disk_gbps, card=card) + in_line


def _pinned_host_for_all(target: ModelSpec, draft: Optional[ModelSpec], offload: OffloadConfig,
                         runtime: RuntimeConfig, limits: RunLimits, base: MemoryPlan) -> Optional[int]:
    """The usable host memory at which the run's plan (`base`, on its machine) streams every layer from pinned
    RAM (mode cpu, pinned): from the arena over the pinned fraction, raised in steps of a layer until it does."""
    machine = base.machine
    stride = arena_stride(base.block_nbytes)
    host = int(len(base.placement.streamed) * stride / PINNED_FRACTION)
    for _ in range(64):
        plan = make_plan(target, draft, offload, runtime, limits, replace(machine, host_bytes=host))
        if plan.mode == "cpu" and plan.host_pinned:
            return host
        host += stride
    return None
