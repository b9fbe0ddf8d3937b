"""The top-k's two chains (ops/topk_triton.TOPK_CHAIN v1 / v2) at small batches, on random logits.

v1 (four launches) is the default since run 17 measured v2 13% slower in the dense V3.2 step at 96 rows; v2
(one select launch of P programs per row at <= SMALL_BATCH_ROWS rows, then the rank) was predicted 17-21 us
at B = 1 against v1's ~28 and never measured there. Per point (rows x columns, k = 2048, group maxima given
as the steps give them), CUDA graphs, median of replays; prints a line per point as it goes.

    PYTHONPATH=src:benchmarks python benchmarks/topk_small_batch.py [--points 1x131072,1x65536,8x65536]
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="1x65536,1x131072,1x262144,8x65536,8x131072,16x65536",
                    help="comma list of ROWSxCOLUMNS (SPIN's compact logits at s = 0.5 are half the context)")
    ap.add_argument("--k", type=int, default=2048)
    a = ap.parse_args()
    import torch
    from harness import random_topk_rows, time_graph

    from spin_indexer import ops
    from spin_indexer.ops import topk_triton as T

    for item in a.points.split(","):
        rows, cols = (int(x) for x in item.split("x"))
        logits, lens, bmax, gmax = random_topk_rows(rows, cols, a.k)
        group = ops.topk_group(cols, a.k)
        times, want, default = {}, None, T.TOPK_CHAIN
        for chain in ("v1", "v2"):
            T.TOPK_CHAIN = chain
            try:
                call = lambda: ops.topk_positions(logits, lens, a.k, block_max=bmax, group_max=gmax, validate=False)
                got = call()
                want = got if want is None else want
                same = bool(torch.equal(got, want))
                times[chain] = (time_graph([call], max_reps=20).p50_us, same)
            finally:
                T.TOPK_CHAIN = default
        print(f"rows={rows} cols={cols} G={group}: " + ", ".join(
            f"{c} {t:.1f} us{'' if same else ' (DIFFERENT RESULT)'}" for c, (t, same) in times.items()), flush=True)


if __name__ == "__main__":
    main()
