"""How far any block selection from history can go (issue #18): the miss of block choices that see more than SPIN.

    python benchmarks/fidelity_bounds.py --traces DIR --out DIR [--sparsity 0.3 0.4 0.5]

SPIN predicts this step's block scores from EMAs of what it observed in earlier steps (only the blocks it kept).
Over the same traces, with SPIN's budget (budget_of: n - floor(s n) blocks kept, the newest always), this script
scores block choices made with more information than SPIN has, each an upper bound for a class of predictors:
  ideal            this step's own dense top-k: the blocks holding most of it (no predictor can miss less)
  prev-step-<pool> the previous step's full scores of the same layer (every block observed, no EMA, no
                   staleness), pooled to blocks by max, the mean of the top 4 / 8, or the previous top-k's
                   count a block: what a one-step history predictor gets at best
  ema-full-<pool>  an EMA (alpha = 0.5, as SPIN's vertical table) of every earlier step's full scores, max or
                   top-4 pooled: SPIN's vertical history with every block observed at every step
  ema-full-vd-max  the same with SPIN's diagonal table beside it (an EMA by offset from the query, combined by
                   max, then max-pooled: spin-default's A1-Max prediction with every block observed)
  prev-layer-max   this step's scores of the layer before (max-pooled; current-step information, as
                   cross-layer reuse has it)
miss = the share of the row's dense top-k (the trace's `topk`) in skipped blocks (predictor/miss.py); mean and
nearest-rank p99 over every (trace, step, layer) row with context > k, next_n = 1 traces. Writes <out>/bounds.csv
(predictor, sparsity, mean_miss, p99_miss, rows) and <out>/bounds.md.
"""
from __future__ import annotations

import argparse
import csv
import glob
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import torch  # noqa: E402

from spin_indexer.eval.metrics import nearest_rank  # noqa: E402
from spin_indexer.predictor.config import Reduce  # noqa: E402
from spin_indexer.predictor.miss import miss_per_row  # noqa: E402
from spin_indexer.predictor.score import pool_blocks  # noqa: E402
from spin_indexer.predictor.select import budget_of  # noqa: E402
from spin_indexer.traces.schema import load_trace  # noqa: E402

POOLS = ("max", "top4", "top8", "topk-count")
ALPHA = 0.5  # SpinConfig's default EMA weight of the newest observation


def pooled(scores: torch.Tensor, nb: int, t: int, pool: str, topk: torch.Tensor | None = None) -> torch.Tensor:
    """float32 [nb] block scores of one row's scores [>= nb * t] (NaN, never observed, counts as -inf); max and
    top4 are SPIN's own reductions (predictor.score.pool_blocks)."""
    s = scores[:nb * t].float()
    s = torch.where(torch.isnan(s), float("-inf"), s)
    if pool in ("max", "top4"):
        return pool_blocks(s, t, Reduce.MAX if pool == "max" else Reduce.TOP4)
    blocks = s.view(nb, t)
    if pool == "top8":
        return blocks.topk(8, dim=1).values.mean(1)
    counts = torch.bincount(topk[topk >= 0].long() // t, minlength=nb)[:nb].float()
    return counts + 1e-6 * torch.tanh(blocks.amax(1))  # ties (empty blocks) broken by the block max


def choose(block_scores: torch.Tensor, kept: int) -> torch.Tensor:
    """bool [1, nb]: the newest block and the kept - 1 best others."""
    nb = block_scores.shape[0]
    s = block_scores.clone()
    s[nb - 1] = float("inf")
    mask = torch.zeros(1, nb, dtype=torch.bool)
    mask[0, s.topk(kept).indices] = True
    return mask


def trace_rows(path: str, sparsities) -> dict[tuple[str, float], list[float]]:
    """{(predictor, sparsity): per-row misses} of one trace."""
    tr = load_trace(path)
    t, k = tr.meta.tokens_per_block, tr.meta.k
    if tr.meta.next_n != 1:
        raise ValueError(f"{path}: next_n = {tr.meta.next_n}; this script reads next_n = 1 traces")
    scores, topk = tr.scores, tr.topk
    steps, layers = scores.shape[:2]
    pad = (-scores.shape[-1]) % t
    scores = torch.nn.functional.pad(scores.float(), (0, pad), value=float("-inf"))
    out: dict[tuple[str, float], list[float]] = {}
    ema = torch.full(scores.shape[1:], float("nan"))  # [layers, 1, C]: nan where no step has seen the position
    diag = torch.full(scores.shape[1:], float("nan"))  # [layers, 1, C] by offset q - i from the query position q
    for st in range(steps):
        length = int(tr.seq_lens[st, 0])
        nb = -(-length // t)
        for layer in range(layers if length > k else 0):  # rows with context <= k keep everything
            row_topk = topk[st, layer, 0][None]
            choices = {"ideal": pooled(scores[st, layer, 0], nb, t, "topk-count", topk[st, layer, 0])}
            if st > 0:
                for pool in POOLS:
                    choices[f"prev-step-{pool}"] = pooled(scores[st - 1, layer, 0], nb, t, pool,
                                                          topk[st - 1, layer, 0])
                for pool in ("max", "top4"):
                    choices[f"ema-full-{pool}"] = pooled(ema[layer, 0], nb, t, pool)
                offsets = (length - 1 - torch.arange(scores.shape[-1])).clamp(min=0)
                aligned = torch.where(torch.arange(scores.shape[-1]) < length, diag[layer, 0, offsets], float("nan"))
                choices["ema-full-vd-max"] = pooled(torch.fmax(ema[layer, 0], aligned), nb, t, "max")
            if layer > 0:
                choices["prev-layer-max"] = pooled(scores[st, layer - 1, 0], nb, t, "max")
            for s in sparsities:
                kept = budget_of(nb, s, k, t)
                for name, block_scores in choices.items():
                    miss = miss_per_row(choose(block_scores, kept), row_topk, 1, t)
                    out.setdefault((name, s), []).append(float(miss[0]))
        seen = scores[st]
        ema = torch.where(torch.isnan(ema), seen, ALPHA * seen + (1 - ALPHA) * ema)
        ema = torch.where(torch.isfinite(seen), ema, torch.full_like(ema, float("nan")))
        by_offset = torch.full_like(seen, float("nan"))  # this step's scores at offset q - i
        cols = torch.arange(length)
        by_offset[..., length - 1 - cols] = seen[..., cols]
        diag = torch.where(torch.isnan(diag), by_offset,
                           torch.where(torch.isnan(by_offset), diag, ALPHA * by_offset + (1 - ALPHA) * diag))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--traces", required=True, help="a folder of traces (<name>.safetensors + <name>.json)")
    p.add_argument("--out", required=True)
    p.add_argument("--sparsity", type=float, nargs="+", default=[0.3, 0.4, 0.5])
    args = p.parse_args(argv)
    paths = sorted(glob.glob(os.path.join(args.traces, "*.safetensors")))
    if not paths:
        p.error(f"--traces: no *.safetensors in {args.traces}")
    rows: dict[tuple[str, float], list[float]] = {}
    for path in paths:
        for key, misses in trace_rows(path, args.sparsity).items():
            rows.setdefault(key, []).extend(misses)
    table = [dict(predictor=name, sparsity=s, mean_miss=sum(m) / len(m),
                  p99_miss=nearest_rank(torch.tensor(m), 0.99), rows=len(m))
             for (name, s), m in sorted(rows.items(), key=lambda kv: (kv[0][1], kv[0][0]))]
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "bounds.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(table[0]))
        w.writeheader()
        w.writerows(table)
    lines = ["| predictor | sparsity | mean miss | p99 miss | rows |", "|---|---|---|---|---|"]
    lines += [f"| {r['predictor']} | {r['sparsity']:.0%} | {r['mean_miss']:.2%} | {r['p99_miss']:.2%} | {r['rows']} |"
              for r in table]
    command = "python benchmarks/fidelity_bounds.py " + " ".join(sys.argv[1:] if argv is None else argv)
    with open(os.path.join(args.out, "bounds.md"), "w") as f:
        f.write(f"# Block-selection bounds over {len(paths)} traces\n\n`{command}`\n\n" + "\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
