"""Where one end-to-end decode step of the proxy model goes (bench_e2e's step: 30 layers of DSA-style sparse
decoding), per kernel: torch.profiler over a few eager steps after warm-up, kernels grouped by name, for
the configs bench_e2e names (dense, SPIN, all-keep). Complements bench_e2e.py, whose columns are whole-step times.
Under dense and all-keep it also prints the indexer logits' share of the kernels and the bound that puts on SPIN's
e2e gain (`logits_bound`).

    PYTHONPATH=src:benchmarks python3 benchmarks/profile_e2e.py --random-weights --points 32x32768 --out DIR
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

import bench_e2e
from harness import environment
from profile_step import kernel_table

from spin_indexer.model.decode import decode_one_step


# The indexer logits kernels by name: the Triton kernel, the project's CUDA kernel, DeepGEMM's
LOGITS_KERNELS = ("_paged_indexer_logits_kernel", "paged_logits_kernel", "fp8_paged_mqa_logits")


def logits_bound(rows: list, sparsities=(0.4, 0.5)) -> str:
    """From a dense step's kernel_table rows (us, launches, name): the indexer logits' share of the step's kernels
    and the most SPIN could gain at each sparsity s with its logits exactly (1 - s) of these and no work of its own,
    1 / (1 - s x share): the e2e's physical limit on this proxy (metric of #14's e2e line)."""
    total = sum(t for t, _, _ in rows)
    logits = sum(t for t, _, name in rows if any(k in name for k in LOGITS_KERNELS))
    share = logits / total if total > 0 else 0.0
    bounds = ", ".join(f"{s:.0%} {1 / (1 - s * share):.3f}x" for s in sparsities)
    return (f"indexer logits {logits / 1000:.2f} of {total / 1000:.2f} ms of kernels ({share:.1%}): SPIN with no own "
            f"work and proportional logits at most {bounds}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="32x32768")
    p.add_argument("--configs", nargs="+", default=["dense", "spin-0.5"])
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--indexer-shape", type=bench_e2e.parse_indexer_shape, default=None, metavar="HEADSxDIMS",
                   help="as bench_e2e's: a random indexer head of this shape (with --random-weights or --tiny)")
    bench_e2e.add_indexer_dtype(p)
    p.add_argument("--distinct", type=int, default=2)
    p.add_argument("--task", default="niah_single_2")
    p.add_argument("--top", type=int, default=25, help="kernels listed per config")
    p.add_argument("--out", type=Path, default=Path("/tmp/out"))
    args = p.parse_args(argv)
    points = bench_e2e.parse_points(args.points)
    steps = 3 + 4 + 4  # warm-up + profiled (kernel_table: 2 + iters) + margin
    max_len = max(c for _, c in points) + steps + 8
    model, indexer, tok, name = bench_e2e.load(args, max_len, max(c for _, c in points))
    lines = [f"# e2e step profile: {json.dumps(environment())}, model {name}"]
    for batch, context, config, caches, selector, token in bench_e2e.each_config(args, model, indexer, tok, points,
                                                                                  steps):
        def step():
            logits = decode_one_step(model, caches, token, "lightning", args.k, indexer, selector, validate=False)
            token.copy_(logits[:, -1].argmax(-1, keepdim=True))

        step()
        rows = kernel_table(step, iters=3)
        total = sum(t for t, _, _ in rows)
        launches = sum(c for _, c, _ in rows)
        lines.append(f"\n== {config} B={batch} L={context}: {total / 1000:.2f} ms of kernels per step, "
                     f"{launches:.0f} launches")
        for t, c, kname in rows[:args.top]:
            lines.append(f"  {t:9.1f} us  {c:5.0f}x  {kname[:110]}")
        shown = min(args.top, len(rows)) + 1
        if config in ("dense", "all-keep"):
            lines.append(f"  {logits_bound(rows)}")
            shown += 1
        print("\n".join(lines[-shown:]), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "profile_e2e.txt").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
