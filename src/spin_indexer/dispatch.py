"""Backend choice shared by ops and predictor: CUDA tensors use the Triton twin, everything else the torch
reference. SPIN_INDEXER_FORCE_REF=1 forces the reference everywhere (for debugging a kernel);
SPIN_INDEXER_LOGITS names the paged-logits backend to force (`forced_logits_backend`, read by each backend's rule:
ops/deepgemm.py, ops/indexer_logits_cuda.py)."""
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


LOGITS_BACKENDS = ("deepgemm", "cuda", "triton", "reference")


def forced_logits_backend() -> str | None:
    """The paged-logits backend SPIN_INDEXER_LOGITS names (one of LOGITS_BACKENDS), or None: no backend forced
    (unset, or a value naming none)."""
    choice = os.environ.get("SPIN_INDEXER_LOGITS", "")
    return choice if choice in LOGITS_BACKENDS else None
