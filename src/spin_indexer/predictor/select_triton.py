"""Triton twin of block selection + compaction for one layer (the common path: one prediction row, random
or no exploration, fixed budget). One program per request replaces ~100 small torch kernels:

    forced   = valid & (newest | never scored | context <= K)
    stage 1  = forced + the r1 = max(0, m - e - forced) best other blocks (score desc, lower block on ties)
    stage 2  = min(e, m - max(forced, m - e)) more blocks by hash (ties impossible: hash, then lower block)
    compact  = kept blocks ascending -> kept_blocks, compact block table, compact row lengths
    seen     = last_seen[slot, kept] = step (when a row of the request updates the history)

Top-r selection without sorting: the r-th largest key is found by bisection over its bits (scores mapped
to order-preserving int32), each probe a chunked count over the W blocks; equal keys are then taken in
block order with a running prefix count. Work per request: ~80 passes over W block scores, no O(context).
Semantics equal `select.select_blocks` + `BlockPlan.from_keep_mask` + `update.mark_seen` (tested).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

_MASK31 = 0x7FFFFFFF


@triton.jit
def _mix(h):
    h = (h * 0x45D9F3B) & 0x7FFFFFFF
    h = h ^ (h >> 15)
    return ((h * 0x2C1B3C6D) & 0x7FFFFFFF) ^ (h >> 13)


@triton.jit
def _keys(scores_ptr, seen_ptr, hash_ptr, b, blk, width, n, first_new, keep_all, base_seen, layer_mix):
    """Per block: valid, forced, stage-1 key (order-preserving int64, or a floor for non-candidates),
    stage-2 key (unique int64)."""
    inb = blk < width
    valid = inb & (blk < n)
    last = tl.load(seen_ptr + base_seen + blk, mask=valid, other=0)
    forced = valid & ((blk >= first_new) | (last < 0) | (keep_all != 0))
    s = tl.load(scores_ptr + b * width + blk, mask=valid, other=float("-inf"))
    bits = s.to(tl.int32, bitcast=True).to(tl.int64)
    ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # monotone in s, negatives included
    cand1 = valid & (~forced) & (s > float("-inf"))
    key1 = tl.where(cand1, ordered, -(2 ** 40))
    h = tl.load(hash_ptr + b * width + blk, mask=inb, other=0)
    key2 = _mix(h ^ layer_mix) * (width + 1) + (width - blk)
    return valid, forced, cand1, key1, key2


@triton.jit
def _select_compact_kernel(scores_ptr, seen_ptr, seen_stride, slot_ptr, step_ptr, hash_ptr, layer_mix, n_ptr,
                           first_new_ptr, keep_all_ptr, budget_ptr, explore_ptr, table_ptr, lens_ptr, upd_ptr,
                           keep_ptr, kept_ptr, ctable_ptr, clen_ptr, nkept_ptr, width, next_n,
                           T: tl.constexpr, CHUNK: tl.constexpr, EXPLORE: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    n = tl.load(n_ptr + b)
    first_new = tl.load(first_new_ptr + b)
    keep_all = tl.load(keep_all_ptr + b).to(tl.int32)
    budget = tl.load(budget_ptr + b)
    explore = tl.load(explore_ptr + b)
    slot = tl.load(slot_ptr + b).to(tl.int64)
    base_seen = slot * seen_stride
    offs = tl.arange(0, CHUNK).to(tl.int64)

    # Pass A: forced count and stage-1 candidates.
    n_forced = tl.zeros((), tl.int64)
    n_cand = tl.zeros((), tl.int64)
    for start in range(0, width, CHUNK):
        blk = start + offs
        valid, forced, cand1, key1, key2 = _keys(scores_ptr, seen_ptr, hash_ptr, b, blk, width, n, first_new,
                                                 keep_all, base_seen, layer_mix)
        n_forced += tl.sum(forced.to(tl.int64))
        n_cand += tl.sum(cand1.to(tl.int64))
    r1 = tl.minimum(tl.maximum(budget - explore - n_forced, 0), n_cand)
    k1 = tl.maximum(n_forced, budget - explore)

    # Stage-1 threshold: the largest t with count(key1 >= t) >= r1 (bisection over 33 bits).
    t1 = tl.full((), -(2 ** 32), tl.int64)
    for bit in range(32, -1, -1):
        probe = t1 + (tl.full((), 1, tl.int64) << bit)
        count = tl.zeros((), tl.int64)
        for start in range(0, width, CHUNK):
            blk = start + offs
            valid, forced, cand1, key1, key2 = _keys(scores_ptr, seen_ptr, hash_ptr, b, blk, width, n, first_new,
                                                     keep_all, base_seen, layer_mix)
            count += tl.sum((cand1 & (key1 >= probe)).to(tl.int64))
        t1 = tl.where(count >= r1, probe, t1)
    above = tl.zeros((), tl.int64)
    for start in range(0, width, CHUNK):
        blk = start + offs
        valid, forced, cand1, key1, key2 = _keys(scores_ptr, seen_ptr, hash_ptr, b, blk, width, n, first_new,
                                                 keep_all, base_seen, layer_mix)
        above += tl.sum((cand1 & (key1 > t1)).to(tl.int64))
    need_eq = r1 - above

    # Pass B: stage-1 keep = forced | above | the first need_eq equal keys in block order.
    eq_before = tl.zeros((), tl.int64)
    n_keep1 = tl.zeros((), tl.int64)
    for start in range(0, width, CHUNK):
        blk = start + offs
        valid, forced, cand1, key1, key2 = _keys(scores_ptr, seen_ptr, hash_ptr, b, blk, width, n, first_new,
                                                 keep_all, base_seen, layer_mix)
        eq = cand1 & (key1 == t1) & (r1 > 0)
        eq_rank = eq_before + tl.cumsum(eq.to(tl.int64), 0)
        keep1 = forced | (cand1 & (key1 > t1) & (r1 > 0)) | (eq & (eq_rank <= need_eq))
        eq_before += tl.sum(eq.to(tl.int64))
        n_keep1 += tl.sum(keep1.to(tl.int64))
        tl.store(keep_ptr + b * width + blk, keep1.to(tl.int8), mask=blk < width)
    tl.debug_barrier()  # later passes read keep back, possibly through other threads

    # Stage 2: random exploration among the valid blocks not kept yet.
    if EXPLORE:
        extra = tl.maximum(tl.minimum(explore, budget - k1), 0)
        n_cand2 = tl.zeros((), tl.int64)
        for start in range(0, width, CHUNK):
            blk = start + offs
            kept1 = tl.load(keep_ptr + b * width + blk, mask=blk < width, other=0) != 0
            n_cand2 += tl.sum(((blk < width) & (blk < n) & ~kept1).to(tl.int64))
        extra = tl.minimum(extra, n_cand2)
        t2 = tl.zeros((), tl.int64)
        for bit in range(46, -1, -1):
            probe = t2 + (tl.full((), 1, tl.int64) << bit)
            count = tl.zeros((), tl.int64)
            for start in range(0, width, CHUNK):
                blk = start + offs
                valid, forced, cand1, key1, key2 = _keys(scores_ptr, seen_ptr, hash_ptr, b, blk, width, n,
                                                         first_new, keep_all, base_seen, layer_mix)
                kept1 = tl.load(keep_ptr + b * width + blk, mask=blk < width, other=0) != 0
                count += tl.sum((valid & ~kept1 & (key2 >= probe)).to(tl.int64))
            t2 = tl.where(count >= extra, probe, t2)
        for start in range(0, width, CHUNK):
            blk = start + offs
            valid, forced, cand1, key1, key2 = _keys(scores_ptr, seen_ptr, hash_ptr, b, blk, width, n, first_new,
                                                     keep_all, base_seen, layer_mix)
            kept1 = tl.load(keep_ptr + b * width + blk, mask=blk < width, other=0) != 0
            pick = valid & ~kept1 & (key2 >= t2) & (extra > 0)
            tl.store(keep_ptr + b * width + blk, (kept1 | pick).to(tl.int8), mask=blk < width)
        tl.debug_barrier()

    # Compaction (ascending), the compact block table, and last_seen of the kept blocks.
    step = tl.load(step_ptr + b)
    mark = tl.load(upd_ptr + b).to(tl.int32)
    done = tl.zeros((), tl.int64)
    for start in range(0, width, CHUNK):
        blk = start + offs
        inb = blk < width
        kept = (tl.load(keep_ptr + b * width + blk, mask=inb, other=0) != 0) & inb
        rank = done + tl.cumsum(kept.to(tl.int64), 0) - 1
        phys = tl.load(table_ptr + b * width + blk, mask=kept, other=0)
        tl.store(kept_ptr + b * width + rank, blk.to(tl.int32), mask=kept)
        tl.store(ctable_ptr + b * width + rank, phys, mask=kept)
        tl.store(seen_ptr + base_seen + blk, step, mask=kept & ((blk * 0 + mark) != 0))
        done += tl.sum(kept.to(tl.int64))
    for start in range(0, width, CHUNK):
        pos = start + offs
        pad = (pos >= done) & (pos < width)
        tl.store(kept_ptr + b * width + pos, tl.full((CHUNK,), -1, tl.int32), mask=pad)
        tl.store(ctable_ptr + b * width + pos, tl.zeros((CHUNK,), tl.int32), mask=pad)
    tl.store(nkept_ptr + b, done.to(tl.int32))
    # Every block from a row's last block to the newest is kept (forced), so the rank of row j's last
    # block is done - n + last_block.
    for j in range(0, next_n):
        length = tl.load(lens_ptr + b * next_n + j).to(tl.int64)
        last_block = (length - 1) // T
        clen = (done - n + last_block) * T + (length - 1) % T + 1
        tl.store(clen_ptr + b * next_n + j, tl.where(length > 0, clen, 0).to(tl.int32))


def select_compact_triton(scores: torch.Tensor, last_seen: torch.Tensor, slot_ids: torch.Tensor, step: torch.Tensor,
                          step_hash: torch.Tensor, layer: int, num_blocks: torch.Tensor, first_new: torch.Tensor,
                          keep_all: torch.Tensor, budget: torch.Tensor, explore: torch.Tensor,
                          block_table: torch.Tensor, seq_lens: torch.Tensor, update_any: torch.Tensor,
                          random_exploration: bool, tokens_per_block: int, chunk: int = 1024):
    """Fused select + compact + mark-seen for one layer.

    scores: float32 [B, W] block scores (one prediction row); last_seen: int32 [S, W' + 1] this layer's
    table (written: kept blocks get `step` where update_any); slot_ids: int64 [B]; step: int32 [B];
    step_hash: int64 [B, W] from select.step_hash (mixed with `layer` inside, as select.layer_hash);
    num_blocks, first_new, budget, explore: int64 [B]; keep_all, update_any: bool [B];
    block_table: int32 [B, W]; seq_lens: int32 [B, N].
    returns (keep bool [B, W], kept_blocks int32 [B, W], compact table int32 [B, W],
             compact seq_lens int32 [B, N], num_kept int32 [B]).
    """
    batch, width = scores.shape
    next_n = seq_lens.shape[1]
    dev = scores.device
    keep = torch.empty(batch, width, dtype=torch.int8, device=dev)
    kept = torch.empty(batch, width, dtype=torch.int32, device=dev)
    ctable = torch.empty(batch, width, dtype=torch.int32, device=dev)
    clen = torch.empty(batch, next_n, dtype=torch.int32, device=dev)
    nkept = torch.empty(batch, dtype=torch.int32, device=dev)
    if batch == 0 or width == 0:
        return keep.bool(), kept, ctable, clen.zero_(), nkept.zero_()
    chunk = min(chunk, triton.next_power_of_2(width))
    layer_mix = (layer * 0x9E3779B1 + 0x7F4A7C15) & _MASK31
    _select_compact_kernel[(batch,)](
        scores.contiguous(), last_seen, last_seen.stride(0), slot_ids.contiguous(), step.contiguous(),
        step_hash.contiguous(), layer_mix, num_blocks.contiguous(), first_new.contiguous(),
        keep_all.to(torch.int8), budget.contiguous(), explore.contiguous(), block_table.contiguous(),
        seq_lens.contiguous(), update_any.to(torch.int8), keep, kept, ctable, clen, nkept, width, next_n,
        T=tokens_per_block, CHUNK=chunk, EXPLORE=bool(random_exploration))
    return keep.view(torch.bool), kept, ctable, clen, nkept
