"""The draft: a small model resident on the compute device, run by the same forward as the target."""
from __future__ import annotations

from dataclasses import replace
from typing import Optional

import torch

from .checkpoint import Checkpoint
from .model import Model, ResidentLayers
from .quant import QUANT_MODES, Int8Weight, with_quantized_matrices


def load_resident(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype, quant: str = "none",
                  embed_device: Optional[torch.device] = None, lm_head_device: Optional[torch.device] = None) -> Model:
    """Every weight on `device` for good (the draft; also the target with offload mode "none"), but the
    embedding and the lm_head where embed_device / lm_head_device say (the memory plan's embed_on_host,
    lm_head_on_host).

    quant (only for the draft: it changes p, never the output; see quant.py):
      "int8"       the layers' matrices and lm_head also get a per-row int8 copy that calls over a few rows
                   read instead (+50% memory for the draft; faster on a CPU)
      "int8-held"  the layers' matrices held only as per-row int8 (0.50x of bf16), lm_head dense
      "nf4"        the layers' matrices held only as bitsandbytes nf4 (0.28x of bf16), lm_head dense
    A held layer is quantized right after it is read, so loading needs one dense layer more, not a model."""
    if quant not in QUANT_MODES:
        raise ValueError(f"unknown quantization {quant!r}; expected one of {', '.join(QUANT_MODES)}")
    layers = []
    for i in range(ckpt.config.n_layers):
        w = ckpt.layer_weights(i, device, dtype)
        layers.append(w if quant == "none" else with_quantized_matrices(w, quant))
    globals_ = ckpt.global_weights(device, dtype, embed_device, lm_head_device)
    if quant == "int8":
        globals_ = replace(globals_, lm_head=Int8Weight.quantize(globals_.lm_head))   # embed stays as it is
    return Model(ckpt.config, globals_, ResidentLayers(layers))
