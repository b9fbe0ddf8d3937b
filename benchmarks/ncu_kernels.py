"""The kernels worth hardware counters, for Nsight Compute (`h200_step.sh ncu`): SPIN's step at 96 x 128K,
96 x 512K (one layer: the pipelined update pass) and 1 x 128K (plan, DeepGEMM or the Triton logits, the update
pass, the top-k chain), the Triton logits kernel alone at next_n = 2 and 4 in its production configurations and the
CUDA logits kernel at 96 x 128K, next_n = 2 and 4 (cuda2, cuda4; cudaN-VARIANT: a probe build of
cuda_logits_probe.py) with DeepGEMM's at next_n = 2 beside it (dg2), and the summary mix's per-layer select
(mix8x8k: one program's chain; mix96x128k); DenseIndexer at 1 x 128K / 1 x 1M (dense1, dense1x1m) and SPIN at 1 x 1M
(step1x1m): at one request the top-k chain is most of either step.
Each part runs once eagerly (compiles, warms), then once more inside an NVTX range "measure" (plan() and two
layers of the step, one at 96 x 512K; one logits call), so `ncu --nvtx --nvtx-include measure/` profiles exactly
one launch of each kernel of each part.

    ncu --clock-control none --nvtx --nvtx-include measure/ ... python3 benchmarks/ncu_kernels.py [--parts ...]
"""
from __future__ import annotations

import argparse
import functools
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

PARTS = ("step96", "step96x512k", "step1", "step1x1m", "dense1", "dense1x1m", "mtp2", "mtp4", "plan96x128k",
         "plan96x512k", "plan96x1m", "plan8x128k",
         "plan1x128k", "cuda2", "cuda4", "cuda2-compact", "cuda4-rg1", "cuda3-rg", "dg2", "mix8x8k", "mix96x128k")


def known_part(part: str) -> bool:
    """A name of PARTS (the default set), or any cudaN / cudaN-VARIANT (N in 1-4, VARIANT a cuda_logits_probe
    build): those are too many to profile by default."""
    if part in PARTS:
        return True
    m = re.fullmatch(r"cuda[1-4](?:-(.+))?", part)
    if m is None:
        return False
    from cuda_logits_probe import VARIANTS
    return m[1] is None or m[1] in VARIANTS


def spin_step(batch: int, ctx: int, measured_layers: int = 2, dense: bool = False) -> None:
    """SPIN's step at batch x ctx (dense: DenseIndexer's, its logits and top-k chain: at one request the top-k is
    the step); measured_layers: layers run in the measured part (0 = plan() alone)."""
    import torch
    from run_all import TOPK, Point, steady_indexer

    from spin_indexer.indexer import DenseIndexer
    from spin_indexer.predictor import SpinConfig

    p = Point(batch, ctx, 1, dry=False)
    if dense:
        idx = DenseIndexer(min(TOPK, ctx), 1, device=p.table.device)
        plan = functools.partial(idx.plan, p.table, p.lens, validate=False)
    else:
        idx, slots = steady_indexer(p, SpinConfig(sparsity=0.5, topk=min(TOPK, ctx)))
        plan = functools.partial(idx.plan, p.table, p.lens, slots, validate=False)
    for measured, layers in ((False, p.layers), (True, measured_layers)):
        if measured:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("measure")
        plan()
        for i in range(layers):
            idx.run(i, p.q[i][0], p.caches[i], p.q[i][1])
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def mix_select(batch: int, ctx: int) -> None:
    """The summary mix's per-layer select launch (plan_triton.select_layer_triton, S = 1, s = 0.4) over a random
    history and random summary scores, after one plan() for the step's stash (bench_summary.select_times' set-up)."""
    import dataclasses

    import torch
    from harness import DEVICE, decode_lens, random_history_indexer

    from spin_indexer.predictor import SpinConfig
    from spin_indexer.predictor.plan_triton import plan_step_triton, select_layer_triton

    width = ctx // 64
    cfg = dataclasses.replace(SpinConfig(sparsity=0.4, topk=2048), summary=0.5, summary_parts=1)
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    lens = decode_lens(batch, 1, ctx)
    idx, slots = random_history_indexer(cfg, batch, width, lens, gen)
    st, ws = idx.state, idx.workspace
    table = torch.randperm(batch * width, device=DEVICE).to(torch.int32).view(batch, width)
    summary = torch.randn(batch, width, generator=gen, device=DEVICE)
    plan_step_triton(cfg, st, ws, table, lens, slots, None)  # the step's stash, once
    gpu = DEVICE == "cuda"  # SPIN_BENCH_DEVICE=cpu: a dry run of the part under the interpreter
    for measured in (False, True):
        if measured and gpu:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("measure")
        select_layer_triton(cfg, st, ws, 0, table, lens, slots, summary, cached=False)
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()


def mtp_logits(batch: int, ctx: int, next_n: int) -> None:
    import torch
    from harness import KeyPool, decode_lens, random_queries

    from spin_indexer.ops.indexer_logits_triton import paged_indexer_logits_triton

    width = -(-ctx // 64)
    pool = KeyPool(batch * width, seed=3)
    table = torch.randperm(batch * width, device="cuda").to(torch.int32).view(batch, width)
    q, w = random_queries(batch, next_n, seed=1)
    out = torch.empty(batch * next_n, width * 64, dtype=torch.float32, device="cuda")
    lens = decode_lens(batch, next_n, ctx)
    for measured in (False, True):
        if measured:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("measure")
        paged_indexer_logits_triton(q, pool.cache, w, lens, table, validate=False, out=out, fill_tail=False)
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def cuda_logits(batch: int, ctx: int, next_n: int, defines: tuple[str, ...] = (), deepgemm: bool = False) -> None:
    """The CUDA logits kernel (ops/csrc/paged_logits_sm90.cu) once, in the library build or a probe build; or
    (deepgemm) DeepGEMM's fp8_paged_mqa_logits on the same inputs."""
    import torch
    from bench_mtp_logits import CudaLaunch, Inputs
    from harness import KeyPool

    pool = KeyPool(batch * -(-ctx // 64), seed=3)
    x = Inputs(pool, batch, ctx, next_n)
    call = x.deepgemm() if deepgemm else x.own_cuda(CudaLaunch(defines=defines))
    for measured in (False, True):
        if measured:
            torch.cuda.synchronize()
            torch.cuda.nvtx.range_push("measure")
        call()
    torch.cuda.synchronize()
    torch.cuda.nvtx.range_pop()


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--parts", default=",".join(PARTS), help=f"comma-separated, of {', '.join(PARTS)}")
    args = ap.parse_args(argv)
    parts = [x for x in args.parts.split(",") if x]
    for part in parts:
        if not known_part(part):
            raise SystemExit(f"--parts: expected names from {', '.join(PARTS)} or cudaN-VARIANT (N 1-4, VARIANT a "
                             f"cuda_logits_probe build), got {part!r}")
    for part in parts:
        if part == "step96":
            spin_step(96, 131072)
        elif part == "step96x512k":  # the pipelined update pass (tables of >= 2^19 blocks) and plan() at 512K
            spin_step(96, 524288, measured_layers=1)
        elif part in ("step1", "step1x1m"):  # one request: the top-k chain is most of the step
            spin_step(1, 1048576 if part.endswith("1m") else 131072)
        elif part in ("dense1", "dense1x1m"):
            spin_step(1, 1048576 if part.endswith("1m") else 131072, dense=True)
        elif part.startswith("plan"):  # plan() alone (reset + select of 61 layers): plan<batch>x<128k|512k|1m>
            batch, ctx = part[4:].split("x")
            spin_step(int(batch), {"128k": 131072, "512k": 524288, "1m": 1048576}[ctx], measured_layers=0)
        elif part.startswith("cuda"):  # 96 x 128K, the library's build or a probe build (cuda_logits_probe's names)
            from cuda_logits_probe import VARIANTS
            cuda_logits(96, 131072, int(part[4]), VARIANTS[part[6:]] if "-" in part else ())
        elif part == "dg2":  # DeepGEMM beside cuda2 (its clock and cycles against the CUDA kernel's)
            cuda_logits(96, 131072, 2, deepgemm=True)
        elif part.startswith("mix"):  # the summary mix's select: one program's chain (8 x 8K) and a full wave
            mix_select(*((8, 8192) if part == "mix8x8k" else (96, 131072)))
        elif part == "mtp2":
            mtp_logits(32, 131072, 2)
        else:
            mtp_logits(16, 131072, 4)
        print(f"{part}: done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
