"""Is the EMA update pass bound by its scattered V rows? The same pass, the same kept blocks, two block tables.

The update reads and writes one 128-byte V row per kept block, at the block's physical id. run_all's tables are
a random permutation of the cache (as in a server: requests grow a block at a time, interleaved), so those rows
are scattered; at 96 x 128K the pass moves ~51 MB in ~30 us (~1.7 TB/s), its logits (25 MB, just written by the
logits kernel) mostly from L2. If the scattered V rows are what costs, the same pass over a table whose blocks
are contiguous per request (request b owns blocks b*W .. b*W+W-1) should run near the copy bandwidth, and a
pass that walks V in physical order (an inverse map from physical block to compact column) would get that for
any table. Per point: the update pass alone (history + the maxima, as on the DeepGEMM path: two launches) and
the whole SPIN step, both tables, CUDA graphs, median of replays.

    PYTHONPATH=src:benchmarks python benchmarks/update_block_order.py [--points 96x131072x1] [--sparsity 0.5]
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="96x131072x1,32x131072x1,96x524288x1")
    ap.add_argument("--sparsity", type=float, default=0.5)
    a = ap.parse_args()
    import torch
    from harness import DEVICE, time_graph
    from run_all import PLAN_LAYERS, TOPK, Point, steady_indexer

    from spin_indexer import ops
    from spin_indexer.predictor import SpinConfig

    for item in a.points.split(","):
        b, c, n = (int(x) for x in item.split("x"))
        p = Point(b, c, n, dry=DEVICE == "cpu")
        k = min(TOPK, c)
        tables = {"random": p.table.clone(),
                  "contiguous": torch.arange(b * p.width, dtype=torch.int32, device=p.table.device).view(b, p.width)}
        line = []
        for name, table in tables.items():
            p.table = table
            idx, slots = steady_indexer(p, SpinConfig(sparsity=a.sparsity, topk=k))

            def step():
                idx.plan(p.table, p.lens, slots, validate=False)
                for i in range(p.layers):
                    idx.run(i, p.q[i][0], p.caches[i], p.q[i][1])

            t_plan = time_graph([lambda: idx.plan(p.table, p.lens, slots, validate=False)], max_reps=10).p50_us
            t_step = time_graph([step], max_reps=10).p50_us
            per_layer = t_plan / PLAN_LAYERS + (t_step - t_plan) / p.layers
            step()
            plan = idx.plans(0)
            rows = b * n
            logits = torch.randn(rows, p.width * 64, device=p.table.device)
            bmax = torch.empty(rows, p.width, device=p.table.device)
            hist = idx._history_args(0, idx._step, plan)
            view = logits.view(b, n, logits.shape[1])
            t_upd = time_graph([lambda: ops.update_history(hist, view, plan.compact_block_table,
                                                           plan.compact_seq_lens)], max_reps=10).p50_us
            t_max = time_graph([lambda: ops.update_history(None, view, plan.compact_block_table,
                                                           plan.compact_seq_lens, block_max_out=bmax)],
                               max_reps=10).p50_us
            kept = float((1 - plan.sparsity().mean()) * b * c)
            mb = kept * (4 + 2 + 2) / 1e6
            line.append(f"{name}: step {per_layer:.1f} us/layer, update pass {t_upd:.1f} us ({mb:.0f} MB: "
                        f"{mb / max(t_upd, 1e-9):.2f} TB/s), maxima pass {t_max:.1f} us")
            del idx
            torch.cuda.empty_cache() if DEVICE != "cpu" else None
        print(f"B={b} L={c} n={n} s={a.sparsity}: " + "; ".join(line), flush=True)


if __name__ == "__main__":
    main()
