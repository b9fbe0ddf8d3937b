"""Where the CUDA logits kernel's time goes (issue #17): its production build beside builds of the same source
with fewer math warpgroups and probe builds that leave one stage out, with the Triton production config and
DeepGEMM in the same run (H200.md: "time variants that leave one stage out or do it twice, and take
differences").

    PYTHONPATH=src:benchmarks python3 benchmarks/cuda_logits_probe.py --out $OUT/probe

Variants (ops/csrc/paged_logits_sm90.cu's build switches): cuda (production: see the source's Shape), n3-2wg (next_n
= 3 on two warpgroups, the weights in registers, 4 stages: the library's shape and PTX until runs 182-183), ws
(SPIN_LOGITS_WEIGHTS_SMEM=1: the epilogue reads the weights from shared memory), w3 (three warpgroups on whole
blocks at next_n = 3 and at 4, the weights in shared memory: 151 / 168 registers, no spill; the weights in registers
spilled, run 125; at next_n = 3 the library's shape since runs 182-183), w3-noperwg (w3's loop compiled once, not
per warpgroup), w3-s1 / w3-s2 / w3-s3 (w3 with 1-3 key blocks in flight a block set, at next_n = 3 too: the loop's
code shrinks with its unroll; run 182: w3's three warpgroups at 4 stages stalled on instruction fetch), w3-noroll
(w3's loop not unrolled, 4 stages kept), w3-nopipe (w3 with a block's last steps after its own MMA), pipe / nopipe
(SPIN_LOGITS_PIPELINE=1 / 0: a block's last steps beside the next block's MMA, or not), 2cta
(SPIN_LOGITS_CTAS_PER_SM=2: the SM's warpgroups in two CTAs; chunks of at most 128 / 64 blocks, a larger chunk is
skipped), no-headsum (SPIN_LOGITS_PROBE=1: no ReLU / weights / head sum), no-mma (=2) (the block maxima left out:
--nomax), rg / rg1 (SPIN_LOGITS_ROW_GROUPS=2 / 1: at next_n 3-4 two warpgroups a block, each on half its rows, or
one on all; rg1-nopipe = the next_n = 4 build before run 116), rg3 / rg3x6 (next_n = 3 in three row groups of one
row, 3 or 6 warpgroups), rg4 (next_n = 4 in four row groups of one row), noroll (SPIN_LOGITS_UNROLL=0: the loop not
unrolled by stages), perwg / noperwg (SPIN_LOGITS_PER_WG=1 / 0: the loop compiled per warpgroup or once), compact
(noroll + noperwg), nouni (SPIN_LOGITS_UNIFORM_WG=0), s2 / s3 / s4 (SPIN_LOGITS_STAGES_PER_WG: key blocks in flight
a block set at every next_n), abs (SPIN_LOGITS_ABS_SUM=1: the head sum through |s|, one FFMA a score, with row
groups at next_n = 3; runs 147-149), rp2 / rp2-s3 (SPIN_LOGITS_ROW_PIPE=1: one MMA a row, the next block's row j
issued once this block's row j is summed, on two warpgroups on whole blocks at next_n 3-4, the weights in shared
memory, 4 / 3 key blocks in flight a block set; run 184: 1.18-1.35x the library's time), rp3 (the row pipeline in
the library's next_n = 3 shape, the loop compiled once: 166 registers, no spill; per warpgroup it spills), each at
the launcher's chunk and at 128 and 256 blocks a CTA; --nomax times every build without block_max_out (its
logits-only kernel). Per point (B x L x next_n, H = 64, D = 128), CUDA graphs, every build and chunk timed in the
same paired rounds (one replay of each in turn); us = the median, vs_cuda = the median of per-round ratios to the
production build at its default chunk. The builds that compute logits (CHECKED) are first checked against the torch
reference (a build that fails is reported and not timed); the probes compute wrong logits by design and are only
timed. Writes <out>/cuda_probe.csv and .md.
"""
from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch  # noqa: E402

import bench_mtp_logits as mtp  # noqa: E402
from harness import KeyPool, environment, markdown_table, time_graphs_paired  # noqa: E402
from spin_indexer.ops import deepgemm, indexer_logits_cuda  # noqa: E402
from spin_indexer.ops.indexer_logits_triton import CONFIGS  # noqa: E402

W3 = ("SPIN_LOGITS_WEIGHTS_SMEM=1", "SPIN_LOGITS_MATH_WG_N3=3", "SPIN_LOGITS_MATH_WG_N4=3",
      "SPIN_LOGITS_ROW_GROUPS_N4=1")
RP2 = ("SPIN_LOGITS_ROW_PIPE=1", "SPIN_LOGITS_WEIGHTS_SMEM=1", "SPIN_LOGITS_MATH_WG_N3=2", "SPIN_LOGITS_MATH_WG_N4=2",
       "SPIN_LOGITS_ROW_GROUPS_N4=1")
VARIANTS = {"cuda": (), "ws": ("SPIN_LOGITS_WEIGHTS_SMEM=1",), "w3": W3, "w3-noperwg": (*W3, "SPIN_LOGITS_PER_WG=0"),
            "n3-2wg": ("SPIN_LOGITS_MATH_WG_N3=2",), "w3-s1": (*W3, "SPIN_LOGITS_STAGES_PER_WG=1"),
            "w3-s2": (*W3, "SPIN_LOGITS_STAGES_PER_WG=2"), "w3-s3": (*W3, "SPIN_LOGITS_STAGES_PER_WG=3"),
            "w3-noroll": (*W3, "SPIN_LOGITS_UNROLL=0"), "w3-nopipe": (*W3, "SPIN_LOGITS_PIPELINE=0"),
            "pipe": ("SPIN_LOGITS_PIPELINE=1",),
            "nopipe": ("SPIN_LOGITS_PIPELINE=0",), "2cta": ("SPIN_LOGITS_CTAS_PER_SM=2",),
            "no-headsum": ("SPIN_LOGITS_PROBE=1",), "no-mma": ("SPIN_LOGITS_PROBE=2",),
            "rg": ("SPIN_LOGITS_ROW_GROUPS=2",), "rg1": ("SPIN_LOGITS_ROW_GROUPS=1",),
            "rg3": ("SPIN_LOGITS_ROW_GROUPS_N3=3",),
            "rg3x6": ("SPIN_LOGITS_ROW_GROUPS_N3=3", "SPIN_LOGITS_MATH_WG_N3=6"),
            "rg4": ("SPIN_LOGITS_ROW_GROUPS_N4=4",),
            "rg1-nopipe": ("SPIN_LOGITS_ROW_GROUPS=1", "SPIN_LOGITS_PIPELINE=0"),
            "noroll": ("SPIN_LOGITS_UNROLL=0",), "perwg": ("SPIN_LOGITS_PER_WG=1",),
            "noperwg": ("SPIN_LOGITS_PER_WG=0",), "compact": ("SPIN_LOGITS_UNROLL=0", "SPIN_LOGITS_PER_WG=0"),
            "nouni": ("SPIN_LOGITS_UNIFORM_WG=0",), "s4": ("SPIN_LOGITS_STAGES_PER_WG=4",),
            "s2": ("SPIN_LOGITS_STAGES_PER_WG=2",), "s3": ("SPIN_LOGITS_STAGES_PER_WG=3",),
            "abs": ("SPIN_LOGITS_ABS_SUM=1",), "rp2": (*RP2, "SPIN_LOGITS_STAGES_PER_WG=4"),
            "rp2-s3": (*RP2, "SPIN_LOGITS_STAGES_PER_WG=3"),
            "rp3": ("SPIN_LOGITS_ROW_PIPE=1", "SPIN_LOGITS_PER_WG=0")}
# the builds that compute the logits: all but the probes (SPIN_LOGITS_PROBE leaves a stage out)
CHECKED = tuple(name for name, defines in VARIANTS.items()
                if not any(d.startswith("SPIN_LOGITS_PROBE=") for d in defines))
POINTS = "96x131072x2,96x131072x1,96x131072x4,32x524288x2"
COLUMNS = ["batch", "ctx", "next_n", "variant", "chunk", "us", "vs_cuda"]


def check(env: dict, names) -> None:
    """The CHECKED builds of names against the reference at every next_n on a small odd shape (rel. error < 5e-3)."""
    for name in names:
        if name in CHECKED:
            try:
                check_build(name, env)
            except AssertionError as exc:  # said in env and not timed; the other builds still are
                env[f"{name}_failed"] = str(exc)
                print(f"check {name}: {exc}", flush=True)


def check_build(name: str, env: dict) -> None:
    """bench_mtp_logits' check of the CUDA kernel (logits within 5e-3 of the reference, block maxima equal to the
    written logits') for this build."""
    for n in (1, 2, 3, 4):
        x, ref, live = mtp.check_inputs(n)
        got: dict = {}
        mtp._check_one(x, "own_cuda", mtp.CudaLaunch(defines=VARIANTS[name]), n, ref, live, got)
        env[f"{name}_n{n}_rel_err"] = next(iter(got["checks"].values()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--points", default=POINTS)
    p.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated names of VARIANTS ('cuda' first)")
    p.add_argument("--nomax", action="store_true",
                   help="time every build without block_max_out (the logits-only kernels, as DeepGEMM's output)")
    args = p.parse_args(argv)
    names = args.variants.split(",")
    if names[0] != "cuda" or any(n not in VARIANTS for n in names):
        p.error(f"--variants: names of {sorted(VARIANTS)}, 'cuda' first (the baseline), got {args.variants!r}")
    os.makedirs(args.out, exist_ok=True)
    t0 = time.time()
    env = environment()
    libs = {name: indexer_logits_cuda.load_library(VARIANTS[name]) for name in names}
    env["builds"] = {name: lib is not None for name, lib in libs.items()}
    print(env, flush=True)
    check(env, names)
    libs = {name: lib for name, lib in libs.items() if f"{name}_failed" not in env}
    rows = []
    for spec in args.points.split(","):
        batch, ctx, n = map(int, spec.split("x"))
        pool = KeyPool(batch * -(-ctx // mtp.T), seed=batch + ctx)
        x = mtp.Inputs(pool, batch, ctx, n)
        calls = {}  # every build, chunk and provider of the point, timed in the same rounds (see bench_mtp_logits)
        for name in libs:  # a failed build: said in env
            for chunk in (None, 128, 256):
                call = x.own_cuda(mtp.CudaLaunch(chunk, VARIANTS[name], maxima=not args.nomax))
                try:
                    call()
                except RuntimeError:  # a chunk past this build's CHUNK_MAX (2cta)
                    continue
                calls[(name, chunk or "default")] = call
        calls[(f"triton {mtp.config_name(CONFIGS[n])}", "default")] = x.own(CONFIGS[n])
        if deepgemm.available() and n <= 2:
            calls[("deepgemm", "")] = x.deepgemm()
        ms = time_graphs_paired(calls, rounds=mtp.PAIRED_ROUNDS)
        base = ms[("cuda", "default")]
        here = [dict(batch=batch, ctx=ctx, next_n=n, variant=name, chunk=chunk, us=1e3 * statistics.median(t),
                     vs_cuda=statistics.median(a / b for a, b in zip(t, base))) for (name, chunk), t in ms.items()]
        print(f"point {spec}: " + ", ".join(f"{r['variant']}/{r['chunk']} {r['us']:.1f} ({r['vs_cuda']:.3f})"
                                            for r in here), flush=True)
        rows += here
        del x, pool
        torch.cuda.empty_cache()
    with open(os.path.join(args.out, "cuda_probe.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS)
        w.writeheader()
        w.writerows(rows)
    fmt = mtp.fmt
    lines = ["# CUDA logits kernel: stages left out (issue #17)", "",
             f"- {env.get('gpu')}, {env.get('date')}, torch {env.get('torch')}, commit {env.get('commit')}",
             f"- command: `python benchmarks/cuda_logits_probe.py {' '.join(sys.argv[1:] if argv is None else argv)}`",
             "- builds vs reference (rel. error): " + ", ".join(
                 f"{name} n={n} {env[f'{name}_n{n}_rel_err']:.1e}" for name in names if name in CHECKED
                 for n in (1, 2, 3, 4) if f"{name}_n{n}_rel_err" in env),
             ""] + markdown_table(COLUMNS, rows, fmt)
    with open(os.path.join(args.out, "cuda_probe.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines[-len(rows) - 2:]))
    print(f"total {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
