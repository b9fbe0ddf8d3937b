"""Suite indexer_logits: the paged FP8 indexer, dense (full block table) and SPIN (compacted table at block
sparsity s), Triton twin with the fused block max.

Bytes per call (the floor): keys B * L_kept * 132 read + logits R * W * T * 4 written (the -inf tail of a
compacted table included) + block max R * W * 4; q, weights and tables are < 0.1%.
"""
from __future__ import annotations

import functools
import math

import torch

from harness import DEVICE, KeyPool, decode_lens, random_queries, rotations_for

from spin_indexer.ops.indexer_logits_triton import paged_indexer_logits_triton

T = 64
BYTES_PER_TOKEN = 132
BATCHES = (1, 8, 32, 96)
CONTEXTS = (65536, 131072, 262144, 524288, 1048576)
NEXT_NS = (1, 2)
SPARSITIES = (0.0, 0.2, 0.3, 0.4, 0.5)
CASES = [dict(batch=b, ctx=c, next_n=n) for b in BATCHES for c in CONTEXTS for n in NEXT_NS]


def kept_blocks(ctx: int, sparsity: float) -> int:
    """Blocks scored per request at block sparsity s: ceil((1 - s) * n)."""
    n = -(-ctx // T)
    return n - math.floor(n * sparsity + 1e-9)


def bytes_moved(case: dict, sparsity: float = 0.0) -> int:
    b, ctx, n = case["batch"], case["ctx"], case["next_n"]
    width = -(-ctx // T)
    keys = b * kept_blocks(ctx, sparsity) * T * BYTES_PER_TOKEN
    return keys + b * n * width * (T + 1) * 4


def compact(table: torch.Tensor, lens: torch.Tensor, sparsity: float, seed: int):
    """SPIN's compacted call with a random kept set: (table int32 [B, W], lens int32 [B, N]).

    Request b keeps m_b = ceil((1 - s) * n_b) of its n_b used blocks, always including the newest block of
    every row, listed ascending, 0 past m_b. A row's length becomes (rank of its newest block among the
    kept ones) * T + its tokens in that block. Example, T = 64, row length 130, kept [0, 2]: 64 + 2 = 66."""
    batch, width = table.shape
    lens64 = lens.long()
    used = (lens64.amax(dim=1) + T - 1) // T  # [B]
    m = used - torch.floor(used.double() * sparsity + 1e-9).long()
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    key = torch.rand(batch, width, device=DEVICE, generator=gen)
    last = ((lens64 - 1).clamp_min(0) // T)  # [B, N] newest block of each row
    key.scatter_(1, last, 2.0)
    blocks = torch.arange(width, device=DEVICE)
    key = torch.where(blocks[None, :] < used[:, None], key, -1.0)
    rank = torch.empty_like(blocks[None, :].expand(batch, -1))
    rank.scatter_(1, key.argsort(dim=1, descending=True), blocks[None, :].expand(batch, -1).contiguous())
    keep = rank < m[:, None]
    kept = torch.where(keep, blocks, width + blocks).sort(dim=1).values  # kept first, ascending
    out = torch.where(kept < width, torch.gather(table, 1, kept.clamp_max(width - 1)), 0).to(torch.int32)
    before = keep.long().cumsum(dim=1) - 1  # compact index of each kept block
    new_lens = torch.gather(before, 1, last) * T + (lens64 - 1) % T + 1
    return out, torch.where(lens64 > 0, new_lens, 0).to(torch.int32)


class LogitsPoint:
    """Inputs and output buffers of one grid point, rotated `rotations` times over disjoint blocks."""

    def __init__(self, pool: KeyPool, batch: int, ctx: int, next_n: int, sparsity: float = 0.0, seed: int = 0,
                 rotations: int | None = None):
        self.pool, self.batch, self.ctx, self.next_n, self.sparsity = pool, batch, ctx, next_n, sparsity
        width = -(-ctx // T)
        case = dict(batch=batch, ctx=ctx, next_n=next_n)
        rot = rotations or rotations_for(bytes_moved(case, sparsity))
        self.q, self.w = random_queries(batch, next_n, seed=seed)
        full_lens = decode_lens(batch, next_n, ctx)
        self.tables, self.lens = [], []
        for i, table in enumerate(pool.tables(batch, width, rot)):
            if sparsity > 0:
                table, lens = compact(table, full_lens, sparsity, seed + i)
            else:
                lens = full_lens
            self.tables.append(table)
            self.lens.append(lens)
        rows = batch * next_n
        self.outs = [torch.empty(rows, width * T, device=DEVICE) for _ in self.tables]
        self.bmax = [torch.empty(rows, width, device=DEVICE) for _ in self.tables]

    def calls(self, **knobs):
        return [functools.partial(paged_indexer_logits_triton, self.q, self.pool.cache, self.w, lens, table,
                                  validate=False, out=out, block_max_out=bm, **knobs)
                for lens, table, out, bm in zip(self.lens, self.tables, self.outs, self.bmax)]

    def row_lengths(self, i: int = 0) -> torch.Tensor:
        return self.lens[i].reshape(-1).contiguous()


PROVIDERS = {
    "triton": lambda point: point.calls(),
    "triton-pointer-loads": lambda point: point.calls(use_tma=False),
    "triton-no-prefetch": lambda point: point.calls(prefetch=0),
    "triton-prefetch-all": lambda point: point.calls(prefetch=1),
    "triton-split-rows": lambda point: point.calls(split=True),
}
