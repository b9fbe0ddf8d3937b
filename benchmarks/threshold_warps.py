"""The v1 top-k's threshold program (ops/topk_triton._threshold_kernel, one program per row) by its warps.

Run 29's profile: at 1 x 1M the threshold took 42 us (1M columns: 16384 group maxima in one tile, 8 warps,
254 registers, 7976 SASS instructions) against 13-14 us at 8192 (127 registers). The program is latency-bound
(16 dependent counts, each a compare and a CTA sum over 64 keys a thread at 16384 / 8 warps), so more warps
should shorten each count. Per point (rows x columns, k = 2048, the maxima the steps give it), CUDA graphs,
median of replays: the threshold stage alone and the whole v1 chain, for each warp count; the chain's result
must equal the production setting's.

    PYTHONPATH=src:benchmarks python benchmarks/threshold_warps.py [--points 1x1048576,96x131072]
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="1x1048576,1x524288,1x131072,8x1048576,96x131072,96x1048576")
    ap.add_argument("--warps", default="4,8,16,32")
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
        sb = T.threshold_tile(-(-cols // group))

        def call(stages=5):
            return T.topk_triton(logits, lens, a.k, validate=False, block_max=bmax, group_max=gmax, _stages=stages)

        want = call()
        line = []
        for w in (int(x) for x in a.warps.split(",")):
            try:
                with warps_at(sb, w):
                    same = bool(torch.equal(call(), want))
                    thr = time_graph([lambda: call(2)], max_reps=20).p50_us
                    chain = time_graph([call], max_reps=20).p50_us
                line.append(f"{w}w threshold {thr:.1f} chain {chain:.1f}{'' if same else ' DIFFERENT'}")
            except Exception as exc:  # a warp count that does not compile must not cost the run
                line.append(f"{w}w failed {exc!r:.80}")
        print(f"rows={rows} cols={cols} G={group} SB={sb}: " + "; ".join(line), flush=True)


@contextlib.contextmanager
def warps_at(tile: int, warps: int):
    """The threshold program at `warps` for tile SB = `tile` inside the block (topk_triton.THRESHOLD_WARPS,
    read at each launch), the production table restored after."""
    from spin_indexer.ops import topk_triton as T

    default = dict(T.THRESHOLD_WARPS)
    T.THRESHOLD_WARPS[tile] = warps
    try:
        yield
    finally:
        T.THRESHOLD_WARPS.clear()
        T.THRESHOLD_WARPS.update(default)


if __name__ == "__main__":
    main()
