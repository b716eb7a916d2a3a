"""The draft: a small model resident on the compute device, run by the same forward as the target."""
from __future__ import annotations

from dataclasses import replace

import torch

from .checkpoint import Checkpoint
from .model import Model, ResidentLayers
from .quant import QUANT_MODES, Int8Weight, with_int8_copies


def load_resident(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, quant: str = "none") -> Model:
    """Every weight on `device` for good (the draft; also the target with offload mode "none").

    quant "int8": the layers' matrices and lm_head also get a per-row int8 copy that calls over a few rows
    read instead (see quant.py; +50% memory for the draft). Only for the draft: it changes p, never the
    output."""
    if quant not in QUANT_MODES:
        raise ValueError(f"unknown quantization {quant!r}; expected one of {', '.join(QUANT_MODES)}")
    layers = []
    for i in range(ckpt.config.n_layers):
        w = ckpt.layer_weights(i, device, dtype)
        layers.append(with_int8_copies(w) if quant == "int8" else w)
    globals_ = ckpt.global_weights(device, dtype)
    if quant == "int8":
        globals_ = replace(globals_, lm_head=Int8Weight.quantize(globals_.lm_head))   # embed stays as it is
    return Model(ckpt.config, globals_, ResidentLayers(layers))
