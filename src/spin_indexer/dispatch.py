"""Backend choice shared by ops and predictor: CUDA tensors use the Triton twin, everything else the torch
reference. SPIN_INDEXER_FORCE_REF=1 forces the reference everywhere (for debugging a kernel)."""
from __future__ import annotations

import importlib
import os

import torch


def triton_twin(module: str, name: str, t):
    """`name` from the absolute `module`, or None when t is not a CUDA tensor or Triton is unavailable."""
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or os.environ.get("SPIN_INDEXER_FORCE_REF") == "1":
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except ImportError:  # no triton on this CUDA machine: the reference still works
        return None
