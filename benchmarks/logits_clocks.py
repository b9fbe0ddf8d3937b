"""The SM clock and the board power while one logits kernel runs back to back (issue #17): whether the CUDA
kernel's time beside DeepGEMM's, and its spread between launches, follow the clock the GPU holds under each
kernel (ncu saw 1.61-1.73 GHz in single launches, run 112) rather than the kernel's cycles.

Per provider (the CUDA kernel's library build, or DeepGEMM where it imports) and point: a CUDA graph of 10
launches replayed for --seconds while `nvidia-smi --query-gpu=clocks.sm,power.draw -lms 100` samples; prints the
time a launch (median of the graph replays), the median SM clock and power of the samples taken while it ran,
and the launch's cycles at that clock (us x MHz).

    PYTHONPATH=src:benchmarks python3 benchmarks/logits_clocks.py --points 96x131072x2,32x524288x2,96x131072x4
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import threading
import time

import torch

import bench_mtp_logits as mtp
from harness import KeyPool
from spin_indexer.ops import deepgemm


def sample_clocks(t0: float, t1: float, lines: list[tuple[float, str]]) -> tuple[float, float]:
    """Median SM clock (MHz) and power (W) of the samples stamped inside [t0, t1]."""
    got = [line for t, line in lines if t0 <= t <= t1]
    mhz = [float(x.split(",")[0]) for x in got if x[:1].isdigit()]
    watts = [float(x.split(",")[1]) for x in got if x[:1].isdigit()]
    return (statistics.median(mhz) if mhz else float("nan"), statistics.median(watts) if watts else float("nan"))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default="96x131072x2,32x524288x2,96x131072x4")
    p.add_argument("--seconds", type=float, default=4.0, help="replay time per provider and point")
    args = p.parse_args(argv)
    proc = subprocess.Popen(["nvidia-smi", "--query-gpu=clocks.sm,power.draw", "--format=csv,noheader,nounits",
                             "-lms", "100"], stdout=subprocess.PIPE, text=True)
    lines: list[tuple[float, str]] = []

    def reader():
        for line in proc.stdout:
            lines.append((time.time(), line.strip()))

    threading.Thread(target=reader, daemon=True).start()
    print("point provider us_per_launch sm_mhz power_w kcycles_per_launch", flush=True)
    for spec in args.points.split(","):
        batch, ctx, n = map(int, spec.split("x"))
        pool = KeyPool(batch * -(-ctx // mtp.T), seed=batch + ctx)
        x = mtp.Inputs(pool, batch, ctx, n)
        providers = [("cuda", x.own_cuda(mtp.CudaLaunch()))]
        if deepgemm.available() and n <= 2:
            providers.append(("deepgemm", x.deepgemm()))
        for name, call in providers * 2:  # twice in turn: a drift in the clock shows as two different rows
            call()
            torch.cuda.synchronize()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                for _ in range(10):
                    call()
            times = []
            t0 = time.time()
            while time.time() - t0 < args.seconds:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record()
                g.replay()
                b.record()
                b.synchronize()
                times.append(a.elapsed_time(b) * 1e3 / 10)
            t1 = time.time()
            us = statistics.median(times)
            mhz, watts = sample_clocks(t0 + 0.5, t1, lines)
            print(f"{spec} {name} {us:.1f} {mhz:.0f} {watts:.0f} {us * mhz / 1e3:.1f}", flush=True)
            del g
        del x, pool
        torch.cuda.empty_cache()
    proc.terminate()
    return 0


if __name__ == "__main__":
    sys.exit(main())
