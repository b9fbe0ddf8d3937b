"""Public ops. Each dispatches on the tensor's device: CUDA (with Triton installed) goes to the Triton
twin, everything else to the torch reference, behind one signature. SPIN_INDEXER_FORCE_REF=1 forces the
reference everywhere (for debugging a kernel).
"""
from __future__ import annotations

import importlib
import os

import torch

from .indexer_logits import block_max_ref, check_paged_indexer_args, paged_indexer_logits_ref
from .kv_cache import dequantize_blocks, quantize_and_write, quantize_keys, read_kv_cache, write_kv_cache
from .topk import topk_ref


def _triton_twin(module: str, name: str, t: torch.Tensor):
    """The Triton twin `name` from `.module`, or None when t is not on CUDA or Triton is unavailable."""
    # Not a tensor: let the reference's validation name the argument rather than fail here.
    if not isinstance(t, torch.Tensor) or t.device.type != "cuda" or os.environ.get("SPIN_INDEXER_FORCE_REF") == "1":
        return None
    try:
        return getattr(importlib.import_module(f"{__name__}.{module}"), name)
    except (ImportError, AttributeError):
        return None


def paged_indexer_logits(q_fp8, kv_cache, weights, seq_lens, block_table, validate: bool = True,
                         out=None, block_max_out=None):
    """Paged indexer logits float32 [B*next_n, W*T]; see `paged_indexer_logits_ref` for shapes.

    out: optional float32 [B*next_n, W*T] written in place; block_max_out: optional float32 [B*next_n, W]
    receiving the per-block max (fused into the kernel on CUDA: pass it on to `topk(..., block_max=)`).
    """
    twin = _triton_twin("indexer_logits_triton", "paged_indexer_logits_triton", q_fp8)
    if twin is not None:
        return twin(q_fp8, kv_cache, weights, seq_lens, block_table, validate=validate, out=out,
                    block_max_out=block_max_out)
    logits = paged_indexer_logits_ref(q_fp8, kv_cache, weights, seq_lens, block_table, validate=validate)
    if out is not None:
        out.copy_(logits)
        logits = out
    if block_max_out is not None:
        block_max_out.copy_(block_max_ref(logits, kv_cache.shape[1]))
    return logits


def topk(logits, lengths, k: int, validate: bool = True, block_max=None):
    """Top-k positions int32 [R, k], -1 padded; see `topk_ref`. block_max: optional float32 [R, ceil(C/64)]
    exact per-block max of the valid logits (as `paged_indexer_logits(..., block_max_out=)` writes it):
    lets the Triton top-k read only the blocks that can hold a winner; the reference ignores it."""
    twin = _triton_twin("topk_triton", "topk_triton", logits)
    if twin is not None:
        return twin(logits, lengths, k, validate=validate, block_max=block_max)
    return topk_ref(logits, lengths, k, validate=validate)


def block_max(logits, tokens_per_block: int = 64):
    """Per-block max float32 [R, ceil(C / T)]; see `block_max_ref`."""
    return block_max_ref(logits, tokens_per_block)


__all__ = [
    "paged_indexer_logits", "paged_indexer_logits_ref", "check_paged_indexer_args", "topk", "topk_ref",
    "block_max", "block_max_ref", "quantize_keys", "write_kv_cache", "quantize_and_write", "read_kv_cache",
    "dequantize_blocks",
]
