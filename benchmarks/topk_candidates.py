"""Why SPIN's top-k costs more than all-keep's in the e2e step (issue #14, run 125: the rank launch 1.23x at 50%):
the Triton top-k's candidate counts per row, per layer, for each configuration of one bench_e2e decode step.

    PYTHONPATH=src:benchmarks python3 benchmarks/topk_candidates.py --random-weights --points 96x32768 --out DIR

One eager step (bench_e2e's model, cache and selector, as profile_e2e.py) with `topk_triton` wrapped so that every
call also fills its `stats` (the candidate count of each row: elements >= the row's threshold; > cap means the
row took the overflow merge). Per configuration: calls, the logits' columns, the group size the threshold used
(the caller's `group`, else topk_group(C, k)), and over all rows of all layers the candidate count's
median / p90 / max and the share of rows above cap. Writes <out>/topk_candidates.md.
"""
from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

import bench_e2e
from harness import environment

from spin_indexer.model.decode import decode_one_step
from spin_indexer.ops import topk_triton as tt
from spin_indexer.ops.topk import pruning_group


def recording(calls: list[dict]):
    """topk_triton with `stats` filled and kept (rows' candidate counts, columns, group, cap) in calls."""
    original = tt.topk_triton

    def wrapped(logits, lengths, k, *args, **kwargs):
        stats = torch.zeros(logits.shape[0], dtype=torch.int32, device=logits.device)
        out = original(logits, lengths, k, *args, stats=stats, **kwargs)
        group = pruning_group(kwargs.get("group"), logits.shape[1], k)  # topk_triton's own rules
        cap = tt.candidate_cap(k, kwargs.get("cap"))
        calls.append(dict(cols=logits.shape[1], k=k, group=group, cap=cap, counts=stats.cpu().tolist()))
        return out

    return original, wrapped


def summary(config: str, calls: list[dict]) -> str:
    counts = [c for call in calls for c in call["counts"]]
    if not counts:
        return f"| {config} | 0 | - | - | - | - | - | - |"
    over = sum(c > call["cap"] for call in calls for c in call["counts"]) / len(counts)
    q = statistics.quantiles(counts, n=10) if len(counts) > 1 else [counts[0]] * 9
    cols = sorted({call["cols"] for call in calls})
    groups = sorted({call["group"] for call in calls})
    return (f"| {config} | {len(calls)} | {cols[0]}-{cols[-1]} | {','.join(map(str, groups))} | "
            f"{statistics.median(counts):.0f} | {q[8]:.0f} | {max(counts)} | {over:.1%} |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--points", default="96x32768")
    p.add_argument("--configs", nargs="+", default=["all-keep", "spin-0.4", "spin-0.5"])
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--random-weights", action="store_true")
    p.add_argument("--tiny", action="store_true")
    p.add_argument("--distinct", type=int, default=2)
    p.add_argument("--task", default="niah_single_2")
    p.add_argument("--out", type=Path, default=Path("/tmp/out"))
    args = p.parse_args(argv)
    points = bench_e2e.parse_points(args.points)
    steps = 4
    max_len = max(c for _, c in points) + steps + 8
    model, indexer, tok, name = bench_e2e.load(args, max_len, max(c for _, c in points))
    lines = [f"# Top-k candidates in the e2e step: {environment()}, model {name}", "",
             "| config | top-k calls | columns | group | median candidates | p90 | max | rows over cap |",
             "|---|---|---|---|---|---|---|---|"]
    calls: list[dict] = []
    original, wrapped = recording(calls)
    for batch, context, config, caches, selector, token in bench_e2e.each_config(args, model, indexer, tok, points,
                                                                                  steps):
        decode_one_step(model, caches, token, "lightning", args.k, indexer, selector, validate=False)  # warm
        calls.clear()
        tt.topk_triton = wrapped
        try:
            decode_one_step(model, caches, token, "lightning", args.k, indexer, selector, validate=False)
            torch.cuda.synchronize() if torch.cuda.is_available() else None
        finally:
            tt.topk_triton = original
        lines.append(summary(f"{config} B={batch} L={context}", calls))
        print(lines[-1], flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "topk_candidates.md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
