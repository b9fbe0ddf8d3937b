"""Experiment (#14, 96 x 512K s = 0.4): the pipelined EMA update pass alone, by configuration and block order.

The pass (history_triton._update_pass_kernel) moves 242 MB at 96 x 512K s = 0.4 in ~102 us (run 75: ~2.4 TB/s).
Each configuration BLOCKS:STAGES:WARPS:PER_SM (blocks a tile, pipeline stages, warps a program, programs an SM)
is timed alone on the step's compact logits of one layer, with the benchmark's random block table and with a
sorted one (each request's physical blocks in logical order: its V rows read and written in sequence), beside a
torch copy of the same byte count. If the sorted table runs near the copy and the random one does not, the V
rows' random 128-byte accesses are the pass's limit; if neither does, its issue or its loads in flight are.
`--once`: one launch of the production pass inside an NVTX range "measure" (Nsight Compute:
`ncu --nvtx --nvtx-include measure/ ...`). Not a production path: the configurations patch history_triton.

    PYTHONPATH=src:benchmarks python benchmarks/update_pass_configs.py [--configs 32:3:4:4,16:3:4:8] [--once]
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

CONFIGS = "32:3:4:4,32:3:4:2,32:4:4:4,16:3:4:8,16:4:4:6,64:3:4:2,32:3:8:2,32:2:4:7"


def config(spec: str):
    """history_triton's pass constants set from BLOCKS:STAGES:WARPS:PER_SM while the block runs."""
    from harness import patched

    from spin_indexer.ops import history_triton as ht
    blocks, stages, warps, per_sm = (int(x) for x in spec.split(":"))
    return patched(ht, BLOCKS_PER_PROGRAM=blocks, PIPELINED_STAGES=stages, NUM_WARPS=warps,
                   PASS_PROGRAMS_PER_SM=per_sm)


def pass_inputs(p, sparsity: float, table):
    """(update call, bytes it moves, the indexer it updates: kept alive with its state): layer 0's update of a
    steady indexer planned on `table`, from the compact logits of that plan (one row per request)."""
    from run_all import TOPK, steady_indexer

    from spin_indexer import ops
    from spin_indexer.predictor import SpinConfig

    saved, p.table = p.table, table
    try:
        idx, slots = steady_indexer(p, SpinConfig(sparsity=sparsity, topk=min(TOPK, p.ctx)))
        idx.plan(p.table, p.lens, slots, validate=False)
        plan, st = idx.plans(0), idx._current(0)
        logits = ops.paged_indexer_logits(p.q[0][0], p.caches[0], p.q[0][1], plan.compact_seq_lens,
                                          plan.compact_block_table, validate=False, fill_tail=False)
        hist = idx._history_args(0, st, plan)
        kept = int(plan.compact_seq_lens.sum())
        rows3 = logits.view(p.batch, 1, -1)

        def update():
            ops.update_history(hist, rows3, plan.compact_block_table, plan.compact_seq_lens)
        return update, kept * (4 + 2 + 2), idx
    finally:
        p.table = saved


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--point", default="96x524288", help="BxL")
    ap.add_argument("--sparsity", type=float, default=0.4)
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--once", action="store_true", help="one production launch in an NVTX range 'measure'")
    ap.add_argument("--sorted", action="store_true", help="with --once: the sorted table")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch
    from harness import time_graph
    from run_all import Point

    batch, ctx = (int(x) for x in a.point.split("x"))
    p = Point(batch, ctx, 1, dry=False)
    ordered = torch.arange(batch * p.width, device=p.table.device, dtype=torch.int32).view(batch, p.width)
    if a.once:
        update, _, _ = pass_inputs(p, a.sparsity, ordered if a.sorted else p.table)
        update()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push("measure")
        update()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        return 0
    lines = []
    tables = {"random": p.table, "sorted": ordered}
    inputs = {}
    for name, table in tables.items():
        update, nbytes, idx = pass_inputs(p, a.sparsity, table)
        inputs[name] = (update, nbytes, idx)
    nbytes = inputs["random"][1]
    src = torch.empty(nbytes // 8, dtype=torch.float32, device=p.table.device)  # half the bytes read, half written
    dst = torch.empty_like(src)
    copy_us = time_graph([lambda: dst.copy_(src)]).p50_us
    lines.append(f"B={batch} L={ctx} s={a.sparsity}: the pass moves {nbytes / 1e6:.0f} MB (logits 4 + V 2 + 2 B a "
                 f"kept token); a torch copy of as many bytes {copy_us:.1f} us ({nbytes / copy_us / 1e6:.2f} TB/s)")
    for spec in a.configs.split(","):
        cells = []
        for name in tables:
            update = inputs[name][0]
            with config(spec):
                us = time_graph([update]).p50_us
            cells.append(f"{name} {us:6.1f} us ({nbytes / us / 1e6:.2f} TB/s)")
        lines.append(f"  {spec:>10}  " + "   ".join(cells))
        print(lines[-1], flush=True)
    text = "\n".join(lines)
    print(text)
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "update_pass_configs.txt"), "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
