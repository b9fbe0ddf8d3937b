"""Suite topk: exact top-k over the logits of an indexer call, ours (Triton, pruned by the fused block max)
against torch.topk over the same rows (the baseline serving engines run after the dense indexer).

Bytes per call, ours with the block max: block max R * W * 4 + the candidate blocks (about k to 2k blocks
of 256 B per row) + k * 8 B of candidates + R * k * 4 written. Without it (C >= 256k columns): one pass
over the logits R * C * 4 more. torch.topk reads R * C * 4 at least once (several radix passes in practice).
"""
from __future__ import annotations

import functools
import os

import torch

from bench_indexer_logits import LogitsPoint

from spin_indexer.ops.topk_triton import topk_triton

TOPK = int(os.environ.get("SPIN_BENCH_TOPK", "2048"))  # dry runs use a small k


def bytes_moved(case: dict, k: int = TOPK, with_block_max: bool = True) -> int:
    rows, width = case["batch"] * case["next_n"], -(-case["ctx"] // 64)
    floor = rows * (width * 4 + min(width, 2 * k) * 256 + k * 12)
    return floor if with_block_max else floor + rows * width * 64 * 4


def _ours(point: LogitsPoint, k: int = TOPK, use_block_max: bool = True):
    return [functools.partial(topk_triton, out, point.row_lengths(i), k, validate=False,
                              block_max=point.bmax[i] if use_block_max else None)
            for i, out in enumerate(point.outs)]


def _torch(point: LogitsPoint, k: int = TOPK):
    ctx = point.ctx
    return [functools.partial(torch.topk, out[:, :ctx], k, dim=1) for out in point.outs]


PROVIDERS = {
    "triton": _ours,
    "triton-no-block-max": functools.partial(_ours, use_block_max=False),
    "torch": _torch,
}
