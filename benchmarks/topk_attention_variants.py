"""ops.topk_attention at the proxy's decode shapes (SmolLM2-135M: 9 query heads on 3 KV heads of 64 dims, bf16
caches of P tokens per request, K = 512 selected positions), per call in a CUDA graph: the Triton kernel under
chunk / warp / stage variants, the selection split over 1-8 programs, and the torch reference. Scattered
positions over 2 x 1.2 GB of keys and values a layer (96 x 32K) make the gather latency-bound, so the variants
trade loads in flight against registers.

    PYTHONPATH=src:benchmarks python3 benchmarks/topk_attention_variants.py [--then-e2e ARGS...]
--then-e2e: set the fastest variant and run bench_e2e.main(ARGS) in this process (one device call for both).
"""
from __future__ import annotations

import argparse
import json
import sys

import torch

from harness import environment, time_graph

from spin_indexer import ops
from spin_indexer.ops import topk_attention_triton as tat
from spin_indexer.ops.topk_attention import topk_attention_ref

# (KB, warps, stages). ptxas (sm_90a, local triton 3.9, the split kernel, bf16, G = 3): KB = 64 at 4 warps takes 162
# registers (3 programs an SM: 1536 programs at 64 x 32K are 4 waves); KB = 32 78 (6 an SM), KB = 16 72 (7), KB = 64
# at 8 warps 66 (3 of 8 warps): the smaller chunks were timed for the waves they would save. Run 170 (H100, 64 x 32K):
# they cost more (KB = 32 76.8 us, 16 81.4) than the shipped KB = 64 at one stage (55.1 us, the fastest of these).
# The fourth field: QK_MMA (the scores on the tensor cores from the bf16 values). Run 173 (H100, 32 x 32K): KB = 128
# with it 14.6 us, the fastest (shipped since), KB = 64 19.1; without it KB = 64 at one stage 30.9, the rest slower.
VARIANTS = [
    (64, 4, 3, False), (64, 4, 1, False), (64, 8, 3, False), (128, 4, 3, False), (128, 8, 3, False),
    (128, 8, 2, False), (256, 8, 2, False), (32, 4, 4, False), (32, 4, 1, False), (16, 4, 1, False),
    (32, 8, 1, False), (64, 8, 1, False), (64, 4, 1, True), (64, 8, 1, True), (128, 4, 1, True), (32, 4, 1, True),
    (64, 4, 3, True),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--batch", type=int, default=96)
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--k", type=int, default=512)
    p.add_argument("--layers", type=int, default=3, help="caches rotated per replay (defeat L2 reuse)")
    p.add_argument("--then-e2e", nargs=argparse.REMAINDER, default=None)
    args = p.parse_args(argv)
    print(json.dumps(environment()), flush=True)
    b, n, hq, hkv, d, P, k = args.batch, 1, 9, 3, 64, args.context, args.k
    gen = torch.Generator(device="cuda").manual_seed(0)
    sets = []
    for _ in range(args.layers):
        keys = torch.randn(b, P, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        vals = torch.randn(b, P, hkv, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        q = torch.randn(b, n, hq, d, device="cuda", dtype=torch.bfloat16, generator=gen)
        topk = torch.argsort(torch.rand(b * n, P, device="cuda", generator=gen), dim=1)[:, :k]
        sets.append((q, keys, vals, topk.to(torch.int32).view(b, n, k)))
    gathered = 2 * b * n * hkv * k * d * 2
    print(f"B={b} P={P} K={k}: {gathered / 1e6:.1f} MB gathered a call (keys + values, bf16)", flush=True)
    want = topk_attention_ref(*sets[0]).float()
    ref_us = time_graph([lambda s=s: topk_attention_ref(*s) for s in sets]).p50_us
    print(f"reference (torch gathers, casts, einsums): {ref_us:8.1f} us", flush=True)
    best = None
    for kb, warps, stages, mma in VARIANTS:
        tat.KB, tat.NUM_WARPS, tat.NUM_STAGES, tat.QK_MMA = kb, warps, stages, mma
        try:
            err = (ops.topk_attention(*sets[0]).float() - want).abs().max().item()
            us = time_graph([lambda s=s: ops.topk_attention(*s, validate=False) for s in sets]).p50_us
        except Exception as exc:  # a variant that does not compile must not cost the run
            print(f"KB={kb} warps={warps} stages={stages} mma={mma}: failed {exc!r}"[:300], flush=True)
            continue
        print(f"KB={kb:4d} warps={warps} stages={stages} mma={int(mma)}: {us:8.1f} us ({gathered / us / 1e3:6.0f} GB/s), "
              f"max |err| {err:.2e}", flush=True)
        if best is None or us < best[0]:
            best = (us, kb, warps, stages, mma)
    if best is None:
        print("no variant ran", flush=True)
        return 1
    print(f"fastest: KB={best[1]} warps={best[2]} stages={best[3]} mma={int(best[4])} {best[0]:.1f} us", flush=True)
    # the selection split over programs (flash-decoding, merged by a second launch) at the fastest variant
    tat.KB, tat.NUM_WARPS, tat.NUM_STAGES, tat.QK_MMA = best[1:]
    for splits in (1, 2, 4, 8, None):
        err = (tat.topk_attention_triton(*sets[0], splits=splits).float() - want).abs().max().item()
        us = time_graph([lambda s=s: tat.topk_attention_triton(*s, splits=splits) for s in sets]).p50_us
        chosen = tat.splits_for(b * n, hkv, k) if splits is None else splits
        print(f"splits={chosen}{' (default)' if splits is None else ''}: {us:8.1f} us "
              f"({gathered / us / 1e3:6.0f} GB/s), max |err| {err:.2e}", flush=True)
    del sets
    torch.cuda.empty_cache()
    if args.then_e2e is not None:
        tat.KB, tat.NUM_WARPS, tat.NUM_STAGES, tat.QK_MMA = best[1:]
        import bench_e2e
        return bench_e2e.main(args.then_e2e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
