"""The draft's --draft-quant: its choices, "auto" resolved for a device and dtype, and the one-line refusals of a
choice the run cannot use. The weights themselves: quant.py (Int8Weight, HeldWeight) and int4.py (Int4Weight)."""
from __future__ import annotations

import torch

from offspec.errors import InputError
from offspec.formats import int4
from offspec.formats.quant import check_target_quant
from offspec.formats.weights import HELD_DRAFT_QUANTS

QUANT_MODES = ("none", "int8", "int8-held", "nf4", "int4")   # dense | + int8 copies | held quantized
TWIN_QUANTS = ("int8", "int4", "nf4", "int8-held")   # how a twin (--draft self) may hold the target's layers


def auto_draft_quant(device_kind: str, dtype: torch.dtype) -> str:
    """--draft-quant auto on a device of this kind ("cpu" or "cuda") in this compute dtype: the int8 copy on a CPU
    in bfloat16, where a narrow draft call is bound by reading its weights and the fused kernel reads half the
    bytes; none elsewhere: on a GPU, and in float32 or float16 on a CPU, where the fused kernel has no fast path
    and loses to the dense matmul (docs/notes/2026-11-26-draft-int8-copy.md)."""
    return "int8" if device_kind == "cpu" and dtype == torch.bfloat16 else "none"


def auto_twin_quant(device_kind: str, dtype: torch.dtype = torch.bfloat16) -> str:
    """--draft-quant auto for a twin (--draft self). In bfloat16, int4 on a GPU and a CPU alike: 0.31x of bf16,
    read in 4 bits by PyTorch's int4 matmul, the fastest twin measured on a CPU at every call width
    (docs/notes/2026-11-28-int4-twin.md); on a GPU, where that kernel cannot run, nf4 (load.runtime_config).
    In other dtypes, where PyTorch has no fast int4 path: nf4 on a GPU; int8 on a CPU (int8 copies of the
    resident target's own matrices; int8-held, layers of its own, where the target's are not all resident and
    dense: search.make_plan)."""
    if dtype == torch.bfloat16:
        return "int4"
    return "nf4" if device_kind == "cuda" else "int8"


HEAD_WORDS = {"as is": "the target's lm_head shared", "int8": "lm_head beside an int8 copy",
              "int4": "lm_head held int4"}      # draft_lm_head's forms, in the plan's words (an int4 draft's)


def draft_lm_head(quant: str, device_kind: str, dtype: torch.dtype, twin: bool = False,
                  head_on_host: bool = False) -> str:
    """How a draft whose matrices `quant` holds keeps its lm_head, on a device of this kind ("cpu" or "cuda") in
    this compute dtype:
      "as is"  its own dense one (a draft of its own), or the target's, shared (a twin: no bytes of its own; a
               host one crosses in chunks each call, as the target's does)
      "int8"   beside a per-row int8 copy (weights.Int8Weight), which calls over a few rows read instead
      "int4"   in 4-bit groups on the compute device (int4.Int4Weight), wherever the dense one is
    A twin held int4 reads the target's lm_head where the plan keeps that on the device (head_on_host False) as a
    dense draft's would be read there (auto_draft_quant): shared on a GPU, beside an int8 copy on a CPU in
    bfloat16. It costs no device bytes, and the twin's top token is the target's more often than with an int4
    copy (docs/notes/2026-11-29-the-twins-lm-head.md). Where the target's stays in host memory, an int4 copy on
    the device, so a call reads 0.31x of it there instead of crossing all of it."""
    if quant == "int4" and twin and not head_on_host:
        return "int8" if auto_draft_quant(device_kind, dtype) == "int8" else "as is"
    if quant == "int4":
        return "int4"
    return "int8" if quant == "int8" and not head_on_host else "as is"


def resolve_draft_quant(draft_quant: str, device_kind: str, dtype: torch.dtype, twin: bool = False) -> str:
    """--draft-quant as asked -> as the run holds it: "auto" resolved (auto_draft_quant; for a twin, --draft self,
    auto_twin_quant); a twin's refused in one line where it would be dense (check_twin_quant)."""
    if draft_quant == "auto":
        return auto_twin_quant(device_kind, dtype) if twin else auto_draft_quant(device_kind, dtype)
    if twin:
        check_twin_quant(draft_quant)
    return draft_quant


def check_twin_quant(draft_quant: str) -> None:
    """A twin (--draft self) reads the target's layers quantized: a dense one would be the target again."""
    if draft_quant not in TWIN_QUANTS:
        raise InputError(f"--draft self reads the target's layers quantized: use --draft-quant "
                         f"{', '.join(TWIN_QUANTS)} or auto, not {draft_quant}")


def check_draft_quant(draft_quant: str, device: torch.device, dtype: torch.dtype) -> None:
    """Refuse, in one line, a --draft-quant that is unknown, or held quantized where this device and dtype
    cannot run it (the same probe as the target's)."""
    if draft_quant not in QUANT_MODES:
        raise InputError(f"unknown draft quantization {draft_quant!r}; choose one of {', '.join(QUANT_MODES)}")
    if draft_quant in HELD_DRAFT_QUANTS:
        check_target_quant(HELD_DRAFT_QUANTS[draft_quant], device, dtype, option=f"--draft-quant {draft_quant}")
    elif draft_quant == "int4":
        int4.check_device(device, dtype, "--draft-quant int4")
