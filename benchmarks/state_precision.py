"""Experiment (#14, the EMA update's bytes): how much precision does SPIN's vertical table V need?

At 96 x 512K s = 0.4 the update moves 8 B a kept token (logits 4 + V read 2 + V written 2; NOTES, runs 77-80), and
the step misses 1.5x of the dense one by ~1%. A 1-byte V would save 2 B a kept token (~60 MB, ~15 us there). Before
any kernel: does a 1-byte V keep the predictor's fidelity? This replays the fidelity eval (`spin-indexer eval`,
CPU, the torch path) with V stored in fp16 (the production format) and, simulated, in coarser ones: after every
update, each layer's V is rounded to the format and back, and its block max recomputed from the rounded rows.

  fp16         as stored today (the baseline: the eval's own numbers)
  bf16         8 mantissa bits (a control: same bytes as fp16)
  e4m3, e5m2   1-byte floats (float8_e4m3fn clamped to +-448, float8_e5m2), no scale
  int8-block   1 byte a slot with one scale a block (the row's largest magnitude / 127): the block's largest slot
               exact, the others within 1/254 of it
  block        one value a block (no per-slot V): every slot of a block that holds history takes the block's max,
               so the next update is the EMA of the block max (0.5 max obs + 0.5 VB for a fully scored block) and
               the A1-Max score is max(VB, the window's D): the state a block-level vertical table would keep

Unscored slots (-inf) stay -inf in every format. The diagonal table D (per request, a bounded window) stays fp16.
Synthetic presets by default (`--synthetic v32-like v4-like`); `--traces DIR` replays captured model traces.

    PYTHONPATH=src python benchmarks/state_precision.py [--synthetic v32-like v4-like] [--out DIR]
"""
from __future__ import annotations

import argparse
import csv
import os
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

FORMATS = ("fp16", "bf16", "e4m3", "e5m2", "int8-block", "block")


def rounded(v, fmt: str):
    """float16 [P, T] V rounded to `fmt` and back (-inf kept)."""
    import torch
    finite = torch.isfinite(v)
    x = torch.where(finite, v, 0).float()
    if fmt == "bf16":
        y = x.to(torch.bfloat16).float()
    elif fmt == "e4m3":
        y = x.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    elif fmt == "e5m2":
        y = x.clamp(-57344, 57344).to(torch.float8_e5m2).float()
    elif fmt == "int8-block":
        scale = (x.abs().amax(dim=1, keepdim=True) / 127).clamp_min(1e-30)
        y = torch.round(x / scale).clamp(-127, 127) * scale
    elif fmt == "block":  # rows with history become constant at their max (rows with none stay -inf)
        row_max = torch.where(finite, v.float(), float("-inf")).amax(dim=1, keepdim=True)
        return torch.where(torch.isfinite(row_max), row_max, v.float()).expand_as(v).to(v.dtype)
    else:
        raise ValueError(f"format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    return torch.where(finite, y.to(v.dtype), v)


def patched_update(fmt: str):
    """ops.update_history that rounds the updated layer's V (and its block max) to `fmt` after each update."""
    from spin_indexer import ops
    original = ops.update_history

    def update(history, *args, **kw):
        original(history, *args, **kw)
        if history is not None and fmt != "fp16":
            v = history.vertical
            v.copy_(rounded(v, fmt))
            history.block_max.copy_(v.amax(dim=1).to(history.block_max.dtype))
    return original, update


def run_eval(fmt: str, eval_args: list[str]) -> list[dict]:
    """summary.csv rows of one eval with V in `fmt`."""
    from spin_indexer import ops
    from spin_indexer.cli import eval as eval_cli
    original, update = patched_update(fmt)
    ops.update_history = update
    try:
        with tempfile.TemporaryDirectory() as out:
            eval_cli.main(eval_args + ["--out", out, "--jobs", "1", "--quiet", "--no-plots", "--no-table1"])
            with open(os.path.join(out, "summary.csv")) as f:
                return list(csv.DictReader(f))
    finally:
        ops.update_history = original


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--synthetic", nargs="*", default=["v32-like", "v4-like"])
    ap.add_argument("--traces", default=None, help="captured traces instead of the synthetic presets")
    ap.add_argument("--prompts", type=int, default=3)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--out", default=None, help="directory for state_precision.csv / .md")
    a = ap.parse_args(argv)
    sets = [["--traces", a.traces]] if a.traces else [
        ["--synthetic", p, "--prompts", str(a.prompts), "--steps", str(a.steps)] for p in a.synthetic]
    rows = []
    for fmt in a.formats.split(","):
        for s in sets:
            for r in run_eval(fmt, s + ["--sweep", "main", "--policy", "spin-default"]):
                if r["context"] == "all":
                    rows.append(dict(format=fmt, trace_set=r["trace_set"], sparsity=float(r["sparsity_target"]),
                                     mean_miss=float(r["mean_miss"]), p99_miss=float(r["p99_miss"]),
                                     realized=float(r["realized_sparsity"])))
                    print(f"{fmt:>10} {r['trace_set']:>20} s={float(r['sparsity_target']):.1f} mean miss "
                          f"{100 * float(r['mean_miss']):6.2f}%  p99 {100 * float(r['p99_miss']):6.2f}%", flush=True)
    base = {(r["trace_set"], r["sparsity"]): r for r in rows if r["format"] == "fp16"}
    lines = ["| format | trace set | sparsity | mean miss | p99 miss | mean miss vs fp16 |", "|---|---|---|---|---|---|"]
    for r in rows:
        b = base.get((r["trace_set"], r["sparsity"]))
        delta = "" if b is None else f"{100 * (r['mean_miss'] - b['mean_miss']):+.2f} pt"
        lines.append(f"| {r['format']} | {r['trace_set']} | {r['sparsity']:.1f} | {100 * r['mean_miss']:.2f}% | "
                     f"{100 * r['p99_miss']:.2f}% | {delta} |")
    print("\n".join(lines))
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "state_precision.csv"), "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=list(rows[0]))
            w.writeheader()
            w.writerows(rows)
        with open(os.path.join(a.out, "state_precision.md"), "w") as f:
            f.write("# V's precision and SPIN's fidelity (benchmarks/state_precision.py)\n\n"
                    f"command: `python benchmarks/state_precision.py {' '.join(argv if argv is not None else sys.argv[1:])}`"
                    "\n\n" + "\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
