"""The v1 threshold's warps (topk_triton.THRESHOLD_WARPS) at 16384 group maxima, timed inside the steps.

Run 30: alone, the top-k over 1M columns costs ~40 us (threshold ~25); inside DenseIndexer's step the same
kernels cost ~59 (dense step 99.4 = logits 40.4 + top-k 40.0 + 19 unexplained) and the eager profile shows the
threshold at 42-43 us there. One guess: its code (7976 SASS instructions at 8 warps, ~127 KB; 5184 at 16,
3544 at 32) is fetched from HBM after the logits kernel has streamed the key cache through L2, while alone
it stays in L2. Per warp count: run_all's grid point (dense step, SPIN step at s = 0.5) at each point.

    PYTHONPATH=src:benchmarks python benchmarks/threshold_in_step.py [--points 1x1048576x1,8x1048576x1]
"""
from __future__ import annotations

import argparse
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--points", default="1x1048576x1,8x1048576x1")
    ap.add_argument("--warps", default="8,16,32")
    ap.add_argument("--sparsity", type=float, default=0.5)
    a = ap.parse_args()
    from harness import DEVICE, environment
    from run_all import grid_point
    from threshold_warps import warps_at

    env = environment()
    env["copy_GBps"] = 4200.0
    for item in a.points.split(","):
        b, c, n = (int(x) for x in item.split("x"))
        for w in (int(x) for x in a.warps.split(",")):
            try:
                with warps_at(16384, w):
                    (row,) = grid_point(b, c, n, [a.sparsity], env, DEVICE == "cpu")
                print(f"B={b} L={c} n={n} threshold warps {w}: dense step {row['dense_step_us']:.1f} us "
                      f"(logits {row['dense_logits_us']:.1f} + top-k alone {row['own_topk_us']:.1f}), SPIN s={a.sparsity} "
                      f"step {row['step_us']:.1f} (logits {row['spin_logits_us']:.1f} + top-k alone "
                      f"{row['topk_us']:.1f}, own {row['spin_own_us']:.1f})", flush=True)
            except Exception as exc:  # one failed variant must not cost the run
                print(f"B={b} L={c} n={n} threshold warps {w}: FAILED {exc!r:.200}", flush=True)


if __name__ == "__main__":
    main()
