"""The draft: a small model resident on the compute device, run by the same forward as the target."""
from __future__ import annotations

import torch

from .checkpoint import Checkpoint
from .model import Model, ResidentLayers


def load_resident(ckpt: Checkpoint, device: torch.device, dtype: torch.dtype) -> Model:
    """Every weight on `device` for good (the draft; also the target with offload mode "none")."""
    layers = [ckpt.layer_weights(i, device, dtype) for i in range(ckpt.config.n_layers)]
    return Model(ckpt.config, ckpt.global_weights(device, dtype), ResidentLayers(layers))
