"""The per-step speed guard (SpinConfig.dense_batch_below): when a step's cached tokens (sum over requests
of the longest row) are below the threshold, every request is guarded (every block kept, no history), on
the device; at or above it, nothing changes. The fused plan kernel agrees with the torch path bit for bit."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from spin_indexer.indexer import SpinIndexer
from spin_indexer.predictor import SpinConfig
from test_plan_triton import BASE, T, _run

LENS = (37 * T + 5, 20 * T, 100, 0)  # a step of 3473 cached tokens (keep_all and padding requests included)


def _guarded(cfg, lens):
    width = max(-(-x // T) for x in lens) + 1
    idx = SpinIndexer(cfg, num_layers=2, max_batch=len(lens), max_blocks=width,
                      num_cache_blocks=len(lens) * width)
    slots = torch.tensor([idx.state.allocate() for _ in lens])
    table = torch.arange(len(lens) * width, dtype=torch.int32).view(len(lens), width)
    idx.plan(table, torch.tensor(lens, dtype=torch.int32)[:, None], slots)
    return idx.plans(0).guarded.tolist(), idx.workspace.update_rows[:len(lens), 0].tolist()


def test_small_step_guards_every_request_and_a_large_one_none():
    total = sum(LENS)
    below = SpinConfig(sparsity=0.5, topk=128, dense_batch_below=total + 1)
    guarded, updates = _guarded(below, LENS)
    assert guarded == [True, True, False, False]  # keep_all (<= K) and padding requests are not "guarded"
    assert updates[:3] == [False, False, True]  # a guarded request keeps no history
    at = dataclasses.replace(below, dense_batch_below=total)
    guarded, updates = _guarded(at, LENS)
    assert guarded == [False, False, False, False] and updates[:3] == [True, True, True]
    assert dataclasses.replace(below, dense_batch_below="auto").guard_batch_tokens > 0


@pytest.mark.parametrize("threshold", [0, sum(LENS), sum(LENS) + 1, 10**9])
def test_fused_plan_matches_torch_with_the_step_guard(threshold, gen, triton_device):
    cfg = dataclasses.replace(BASE, dense_below=0, dense_batch_below=threshold)
    _run(cfg, LENS, 1, gen, triton_device, steps=2)
