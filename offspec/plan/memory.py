"""The memory plan's record: every item with its bytes and where they live, and how the plan reads as a table."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from offspec.formats.layout import BLOCK_ALIGN, round_up
from offspec.formats.layout import format_bytes as fmt
from offspec.formats.published import short as short_quant
from offspec.plan.machine import Machine
from offspec.plan.placement import LayerPlan, Placement
from offspec.plan.sizes import moved_by


@dataclass(frozen=True)
class PlanItem:
    where: str        # "device" | "host"
    what: str         # what the bytes are for
    nbytes: int
    note: str = ""    # how it was counted


@dataclass(frozen=True)
class MemoryPlan:
    machine: Machine
    context: int                  # tokens per sequence in both KV caches (capped at the models' context)
    tree_budget: int              # largest tree a pass may verify
    prefill_chunk: int            # rows per layer call
    concurrency: int              # requests in flight at once: KV-cache rows, trees per pass (auto resolved)
    layers: LayerPlan             # the target's layers: placement, store folder, pinned budget (loading obeys it)
    layer_budget: int             # device bytes that were available for the ring and resident layers
    host_pinned: bool             # the arena / staging will be pinned (CUDA only)
    items: tuple[PlanItem, ...]
    notes: tuple[str, ...] = ()   # decisions worth a line in the report (pageable fallback, auto mode, ...)
    streamed_bytes: int = 0       # weight bytes moved per target pass
    block_nbytes: int = 0         # one target layer as stored and moved (quantized or dense)
    concurrency_auto: bool = False  # concurrency was auto: `concurrency` is the most rows in flight, and the
                                    # measured costs may keep fewer (Engine.run_batch's adapt_rows)
    host_head_bytes: int = 0        # an lm_head kept in host memory: bytes crossing (pageable) every pass
    pinned_layers: int = 0          # of the host arena's layers, the first this many are pinned (the rest pageable)
    pinned_budget: int = 0          # host bytes that may be pinned (the arena's share of it, less any disk
                                    # staging, is layers.host_budget)
    layer_moved: tuple[int, ...] = ()   # TargetLayerSizes.moved: bytes each layer's load copies, where they differ
    draft_quant: str = "none"       # how the draft's matrices are held (RuntimeConfig.draft_quant; a twin's may
                                    # differ from the one asked: search.make_plan)
    draft_head: str = "as is"       # how the draft keeps its lm_head (draft_quant.draft_lm_head)

    def moved_by(self, layers) -> int:
        """Bytes the loads of these target layers copy (block_nbytes each, unless layer_moved says otherwise)."""
        return moved_by(self.layer_moved, self.block_nbytes, layers)

    @property
    def disk_read_bytes(self) -> int:
        """Bytes a pass reads from the disk store: its layers' whole blocks, each BLOCK_ALIGN-rounded."""
        return len(self.placement.disk_layers) * round_up(self.block_nbytes, BLOCK_ALIGN)

    @property
    def placement(self) -> Placement:
        """Resident layers and ring."""
        return self.layers.placement

    @property
    def mode(self) -> str:
        """The offload mode that runs ("auto" resolved)."""
        return self.placement.mode

    @property
    def target_quant(self) -> str:
        """"none" | "int8" | "nf4": how the target's layers are stored and moved."""
        return self.layers.quant

    def total(self, where: str) -> int:
        return sum(i.nbytes for i in self.items if i.where == where)

    def layers_line(self) -> str:
        p = self.placement
        quantized, quant = self.target_quant != "none", short_quant(self.target_quant)
        held = f" (held {quant}, each dequantized every pass)" if p.resident_held else ""
        if not p.streamed:
            return (f"all {p.n_layers} target layers resident on the device"
                    + (held or (f" (the {quant} target, dequantized)" if quantized else "")))
        n_host = len(p.host_layers)
        pinned = ("pinned" if self.pinned_layers == n_host and self.machine.kind == "cuda" else
                  f"{self.pinned_layers} pinned, {n_host - self.pinned_layers} pageable" if self.pinned_layers else
                  "pageable")
        ram = f"host RAM ({pinned})"
        source = {"cpu": ram, "disk": "the disk store",
                  "cpu+disk": f"{ram} ({len(p.host_layers)} layers) and the disk store ({len(p.disk_layers)} layers, "
                              f"spread through the pass)"}[self.mode]
        resident = f"layers {_ranges(p.resident)} resident{held}, " if p.resident else "no layer resident, "
        moved = (f"{fmt(self.streamed_bytes / len(p.streamed))} moved per layer on average, of "
                 f"{fmt(self.block_nbytes)} blocks" if self.layer_moved else
                 f"{fmt(self.block_nbytes)} moved per layer")
        per_layer = (f"{quant}: {moved}, {fmt(p.layer_nbytes)} dequantized" if quantized else
                     f"{fmt(p.layer_nbytes)} per layer")
        slots = f"{p.n_slots} slots of a layer's parts" if p.split else f"{p.n_slots} slots"
        return f"{resident}layers {_ranges(p.streamed)} streamed from {source} through {slots} ({per_layer})"

    def describe(self) -> str:
        """The plan as a table: every item with its size, the totals against what the machine has."""
        m = self.machine
        shared = m.kind == "cpu"
        target = f", target {short_quant(self.target_quant)}" if self.target_quant != "none" else ""
        rows = ""
        if self.concurrency > 1 or self.concurrency_auto:
            rows = f", {self.concurrency} requests in flight" + (" (auto)" if self.concurrency_auto else "")
        lines = [f"memory plan: {m.name or m.kind}, offload {self.mode}{target}, context {self.context} tokens, "
                 f"tree budget ≤ {self.tree_budget}, prefill chunk {self.prefill_chunk}{rows}"]
        for where in ("device", "host"):
            items = [i for i in self.items if i.where == where]
            if not items:
                continue
            label = "device (host RAM: the CPU is the device)" if (where == "device" and shared) else where
            lines.append(f"  {label}")
            for i in items:
                note = f"  ({i.note})" if i.note else ""
                lines.append(f"    {i.what:<38} {fmt(i.nbytes):>10}{note}")
        if shared:
            lines.append(f"  total {fmt(self.total('device') + self.total('host'))} of {fmt(m.host_bytes)} "
                         f"host memory ({m.host_source})")
        else:
            lines.append(f"  device total {fmt(self.total('device'))} of {fmt(m.device_bytes)}; host total "
                         f"{fmt(self.total('host'))} of {fmt(m.host_bytes)} ({m.host_source}), pinned budget "
                         f"{fmt(self.pinned_budget)}")
        lines.append(f"  {self.layers_line()}")
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["layers"].pop("placement")                     # given below, with its derived fields
        d.update(mode=self.mode, target_quant=self.target_quant)
        d["placement"] = {"mode": self.placement.mode, "resident": list(self.placement.resident),
                          "streamed": list(self.placement.streamed), "n_slots": self.placement.n_slots,
                          "host": list(self.placement.host_layers), "disk": list(self.placement.disk_layers),
                          "layer_nbytes": self.placement.layer_nbytes,
                          "slot_nbytes": self.placement.ring_slot_nbytes,
                          "resident_held": self.placement.resident_held,
                          "resident_nbytes": self.placement.resident_nbytes,
                          "scratch_nbytes": self.placement.scratch_nbytes,
                          "compact": self.placement.compact, "split": self.placement.split}
        d["device_total"], d["host_total"] = self.total("device"), self.total("host")
        d["layers_line"] = self.layers_line()
        return d


def device_bytes(items: list[PlanItem]) -> int:
    return sum(i.nbytes for i in items if i.where == "device")


def _ranges(layers: tuple[int, ...]) -> str:
    """(0, 1, 2, 5, 6) -> '0–2, 5–6'."""
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(f"{start}" if start == layer else f"{start}–{layer}")
            start = None
    return ", ".join(out)
