"""ShadowStats: what SPIN would cost on live traffic, measured while vLLM's dense indexer still decides.

In shadow mode (setting `shadow` / SPIN_SHADOW) every decode step runs vLLM's own indexer (its top-k goes to
attention, unchanged) and SPIN's step beside it (plan, score the kept blocks, update SPIN's history as if it
decided). Per layer, on the device, with fixed shapes (it records inside a captured CUDA graph too):

    miss      of an eligible row (length > top-k): the fraction of the dense top-k positions that fall in
              blocks SPIN skipped; mean and p99 (from a 1000-bin histogram, so p99 is exact to 0.001)
    realized  block sparsity: skipped / total blocks over SPIN's requests

Worked example (T = 64, top-k 4): dense top-k [5, 70, 130, 200], SPIN kept logical blocks [0, 2] of 4 ->
positions 70 (block 1) and 200 (block 3) are misses: miss 0.5; realized sparsity 2/4.
snapshot() copies the counters to the host (one sync: call it between steps, never inside one);
shadow_export.py publishes them from a side thread for vLLM's stat logging (vllm_stats.py).
"""
from __future__ import annotations

import math

import torch

from ..predictor.miss import topk_in_blocks

BINS = 1000


class ShadowStats:
    """Counters for `num_layers` layers on `device`."""

    def __init__(self, num_layers: int, device: torch.device | str):
        dev = torch.device(device)
        self.num_layers = num_layers
        self.rows = torch.zeros(num_layers, dtype=torch.int64, device=dev)
        self.miss_sum = torch.zeros(num_layers, dtype=torch.float64, device=dev)
        self.hist = torch.zeros(num_layers, BINS + 2, dtype=torch.int64, device=dev)  # last column: trash
        self.blocks_total = torch.zeros(num_layers, dtype=torch.int64, device=dev)
        self.blocks_skipped = torch.zeros(num_layers, dtype=torch.int64, device=dev)

    def record(self, layer: int, dense_topk: torch.Tensor, keep_mask: torch.Tensor, num_kept: torch.Tensor,
               num_blocks: torch.Tensor, seq_lens: torch.Tensor, topk: int, tokens_per_block: int) -> None:
        """dense_topk: int32 [B*N, K] logical positions (-1 padded) that decided; keep_mask: bool [B, W]
        SPIN's kept logical blocks (BlockPlan.keep_mask); num_kept, num_blocks: [B]; seq_lens: int32 [B, N]."""
        next_n = seq_lens.shape[1]
        inside, valid = topk_in_blocks(keep_mask, dense_topk[:, :topk], next_n, tokens_per_block)
        missed = valid & ~inside
        n_valid = valid.sum(1)
        miss = missed.sum(1).double() / n_valid.clamp_min(1).double()
        eligible = (seq_lens.reshape(-1).long() > topk) & (n_valid > 0)
        self.rows[layer] += eligible.sum()
        self.miss_sum[layer] += torch.where(eligible, miss, 0.0).sum()
        bins = torch.where(eligible, (miss * BINS).long().clamp(0, BINS), BINS + 1)
        self.hist[layer].scatter_add_(0, bins, torch.ones_like(bins))
        self.blocks_total[layer] += num_blocks.long().sum()
        self.blocks_skipped[layer] += (num_blocks.long() - num_kept.long()).sum()

    def counters(self) -> dict:
        """The raw device counters by name (what summarize() reads)."""
        return {"rows": self.rows, "miss_sum": self.miss_sum, "hist": self.hist, "blocks_total": self.blocks_total,
                "blocks_skipped": self.blocks_skipped}

    def snapshot(self) -> list[dict]:
        """Per layer: rows (eligible), miss_mean, miss_p99, realized_sparsity (None where nothing counted)."""
        return summarize({k: v.cpu() for k, v in self.counters().items()})


def summarize(counters: dict) -> list[dict]:
    """ShadowStats.snapshot() from host copies of counters(): per layer rows, miss_sum, blocks_total,
    blocks_skipped (the raw sums, so that several processes' snapshots add up exactly) and miss_mean,
    miss_p99, realized_sparsity (None where nothing counted)."""
    rows, miss, hist = counters["rows"].tolist(), counters["miss_sum"].tolist(), counters["hist"][:, :BINS + 1]
    total, skipped = counters["blocks_total"].tolist(), counters["blocks_skipped"].tolist()
    out = []
    for layer in range(len(rows)):
        n = rows[layer]
        p99 = None
        if n:
            cum = hist[layer].cumsum(0)
            rank = math.ceil(0.99 * n)  # p99: the miss of the row at this rank, ascending (99% of rows are <= it)
            p99 = int(torch.searchsorted(cum, torch.tensor(rank, dtype=cum.dtype))) / BINS
        out.append({"layer": layer, "rows": n, "miss_sum": miss[layer], "blocks_total": total[layer],
                    "blocks_skipped": skipped[layer], "miss_mean": miss[layer] / n if n else None, "miss_p99": p99,
                    "realized_sparsity": skipped[layer] / total[layer] if total[layer] else None})
    return out
