"""Experiment: why the EMA update pass runs at ~0.8 TB/s (profile_step, 2026-12-01) when its bytes say 4 TB/s.

One stripped copy of the update kernel (ops/history_triton.py) with each memory stream switchable, timed on
the SPIN step's own compact table at B = 96 x 512K: logits read only, + V read, + V write, + the per-block
max (VB, 2-byte scattered stores), + the diagonal window, and the same with the compact table sorted
(sequential physical blocks) to tell random-row latency from the rest. Not a production kernel.

    PYTHONPATH=src:benchmarks python benchmarks/update_variants.py
"""
from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import triton  # noqa: E402
import triton.language as tl  # noqa: E402


@triton.jit
def _variant_kernel(x_ptr, x_stride, table_ptr, table_stride, clen_ptr, v_ptr, vb_ptr, vb_stride, d_ptr, q_ptr,
                    kept_ptr, trash, alpha, num_blocks, T: tl.constexpr, BLOCKS: tl.constexpr,
                    V_LOAD: tl.constexpr, V_STORE: tl.constexpr, VB: tl.constexpr, DIAG: tl.constexpr):
    b = tl.program_id(0)
    m = tl.program_id(1) * BLOCKS + tl.arange(0, BLOCKS)
    b64 = b.to(tl.int64)
    clen = tl.load(clen_ptr + b)
    used = (clen + T - 1) // T
    in_table = (m < num_blocks) & (m < used)
    cols = m[:, None] * T + tl.arange(0, T)[None, :]
    live = (cols < clen) & in_table[:, None]
    phys = tl.load(table_ptr + b64 * table_stride + m, mask=in_table, other=-1)
    pv = tl.where((phys >= 0) & (phys < trash), phys, trash).to(tl.int64)
    x = tl.load(x_ptr + b64 * x_stride + cols, mask=live, other=float("-inf"))
    if V_LOAD:
        old = tl.load(v_ptr + pv[:, None] * T + tl.arange(0, T)[None, :]).to(tl.float32)
        v = tl.where(live, alpha * x + (1.0 - alpha) * old, old)
    else:
        v = x
    if V_STORE:
        tl.store(v_ptr + pv[:, None] * T + tl.arange(0, T)[None, :], v.to(tl.float16), mask=live)
    if VB:
        tl.store(vb_ptr + pv * vb_stride, tl.max(v, axis=1).to(tl.float16), mask=in_table)
    else:  # keep the result alive without the scattered store: one coalesced row of block maxima
        tl.store(q_ptr + b64 * num_blocks + m, tl.max(v, axis=1), mask=in_table)
    if DIAG:
        q = tl.load(clen_ptr + b).to(tl.int64) - 1
        kb = tl.load(kept_ptr + b64 * table_stride + m, mask=in_table, other=-1).to(tl.int64)
        off = q - (kb[:, None] * T + tl.arange(0, T)[None, :])
        inw = live & (off >= 0) & (off < 8192)
        cell = d_ptr + b64 * 8193 + tl.where(inw, off, 0)
        od = tl.load(cell, mask=inw, other=0.0).to(tl.float32)
        tl.store(cell, (alpha * x + (1.0 - alpha) * od).to(tl.float16), mask=inw)


def main():
    import torch
    from harness import time_graph
    from run_all import TOPK, Point, steady_indexer


    from spin_indexer.predictor import SpinConfig

    batch, ctx = 96, 524288
    p = Point(batch, ctx, 1, dry=False)
    idx, slots = steady_indexer(p, SpinConfig(sparsity=0.5, topk=TOPK))
    idx.plan(p.table, p.lens, slots, validate=False)
    plan = idx.plans(0)
    logits = torch.randn(batch, p.width * 64, device=p.table.device)
    table = plan.compact_block_table
    sorted_table = torch.where(table >= 0, table, 2**30).sort(dim=1).values
    sorted_table = torch.where(sorted_table == 2**30, -1, sorted_table).to(torch.int32).contiguous()
    clens = plan.compact_seq_lens[:, 0].contiguous()
    vert = idx.state.vertical[0]
    vb = idx.state.block_max[:, 0]
    diag = torch.zeros(batch, 8193, dtype=torch.float16, device=p.table.device)
    qbuf = torch.empty(batch, p.width, device=p.table.device)
    trash = idx.state.num_cache_blocks
    kept_bytes = float(clens.sum()) * (4 + 4)
    print(f"B={batch} L={ctx}: kept tokens {float(clens.sum()) / 1e6:.1f} M; full bytes (logits 4 + V 2+2) "
          f"{kept_bytes / 1e6:.0f} MB; copy-speed floor ~{kept_bytes / 4.2e6:.0f} us", flush=True)
    variants = [("logits only", 0, 0, 0, 0), ("+V load", 1, 0, 0, 0), ("+V store", 1, 1, 0, 0),
                ("+VB", 1, 1, 1, 0), ("+diag (full)", 1, 1, 1, 1), ("no VB, diag", 1, 1, 0, 1)]
    for tname, tab in (("random", table), ("sorted", sorted_table)):
        for name, vl, vs, vbf, dg in variants:
            for blocks, warps in ((32, 4), (8, 2)):
                grid = (batch, triton.cdiv(p.width, blocks))

                def call():
                    _variant_kernel[grid](logits, logits.stride(0), tab, tab.stride(0), clens, vert, vb, vb.stride(0),
                                          diag, qbuf, plan.kept_blocks, trash, 0.5, p.width, T=64, BLOCKS=blocks,
                                          V_LOAD=vl, V_STORE=vs, VB=vbf, DIAG=dg, num_warps=warps)
                t = time_graph([call], max_reps=10).p50_us
                print(f"{tname:7s} {name:14s} {blocks}x{warps}: {t:8.1f} us", flush=True)



if __name__ == "__main__":
    main()
