"""Experiment (#14, next_n = 2 own work): the maxima pass behind DeepGEMM's logits, alone, by configuration.

DeepGEMM writes logits only, so at next_n = 2 on large tables (deepgemm.spin_step_uses) SPIN's step and the dense
step run maxima_triton.row_maxima_triton over every row's logits before the top-k: 4 bytes a column read, 4 / G +
4 / T written. At 96 x 128K next_n = 2 s = 0.2 that is 192 rows x ~105K columns = 80.5 MB, ~19 us at the H200's
copy bandwidth; run 162's own work there was 43.9 us (9.3% of the dense logits), and the dense step there took ~52
us over DeepGEMM's logits + the top-k (two reads of 100.7 MB then: the pass, and the top-k's group-max launch).
Each configuration TB:PER_SM:WARPS:MAXNREG (64-column units a tile, programs an SM, warps a program, register cap;
0 = none) is timed alone in a CUDA graph over rotated logits buffers (so that no call
reads another's bytes from L2), beside torch's amax over the same blocks (a read-only stream) and the copy
bandwidth; the GB/s column counts the bytes read and written. Not a production path: the configurations patch
maxima_triton's constants while they run. 32:9:4:64 gives 192 rows the grid of before 2026-12-07 (P = 6 a row
rounded up: 1152 programs for 1056 resident places, a second wave; programs_per_row now rounds down to 5).
Run 164 (H100): the two grids within 1% at every shape.

    PYTHONPATH=src:benchmarks python benchmarks/maxima_pass_configs.py [--shapes 192x131072x0.8] [--configs ...]
"""
from __future__ import annotations

import argparse
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

SHAPES = "192x131072x0.8,192x131072x0.5,96x131072x1.0,64x524288x0.8,96x65536x0.8"
CONFIGS = "32:8:4:64,32:9:4:64,32:8:4:0,16:8:4:64,64:8:4:0,32:16:4:64,32:4:4:64,16:16:4:64,64:4:8:0,32:8:8:0"


def config(spec: str):
    """maxima_triton's constants set from TB:PER_SM:WARPS:MAXNREG while the block runs."""
    from harness import patched

    from spin_indexer.ops import maxima_triton as mt
    units, per_sm, warps, maxnreg = (int(x) for x in spec.split(":"))
    return patched(mt, TILE_UNITS=units, PROGRAMS_PER_SM=per_sm, NUM_WARPS=warps, MAX_REGISTERS=maxnreg)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default=SHAPES, help="comma list of ROWSxCOLSxKEPT (KEPT: the rows' length / C)")
    ap.add_argument("--configs", default=CONFIGS)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    import torch
    from harness import DEVICE, copy_bandwidth_gbps, environment, rotations_for, time_graph

    from spin_indexer import ops
    from spin_indexer.ops.maxima_triton import row_maxima_triton

    env = environment()
    copy = copy_bandwidth_gbps()
    print(json.dumps({**env, "copy_GBps": copy}))
    rows_out = []
    for shape in a.shapes.split(","):
        r, c, kept = shape.split("x")
        rows, cols, kept = int(r), int(c), float(kept)
        tokens, group = 64, ops.topk_group(cols, a.topk)
        length = max(tokens, int(cols * kept) // tokens * tokens)
        lens = torch.full((rows,), length, dtype=torch.int32, device=DEVICE)
        moved = rows * length * 4 + rows * (length // group + length // tokens) * 4
        rot = rotations_for(rows * cols * 4)
        bufs = [torch.randn(rows, cols, device=DEVICE) for _ in range(rot)]
        gmax = torch.empty(rows, cols // group, device=DEVICE)
        bmax = torch.empty(rows, cols // tokens, device=DEVICE)
        results = {}

        def amax_call(x):
            return lambda: torch.amax(x[:, :length].view(rows, -1, tokens), dim=2, out=bmax[:, :length // tokens])
        results["torch amax (blocks only)"] = time_graph([amax_call(x) for x in bufs])
        want_g, want_b = None, None
        for spec in a.configs.split(","):
            with config(spec):
                def call(x):
                    return lambda: row_maxima_triton(x, lens, group_max_out=gmax, group=group, block_max_out=bmax,
                                                     tokens=tokens)
                gmax.fill_(float("nan"))
                bmax.fill_(float("nan"))
                call(bufs[0])()
                got = (gmax[:, :length // group].clone(), bmax[:, :length // tokens].clone())
                if want_g is None:
                    want_g, want_b = got
                elif not (torch.equal(got[0], want_g) and torch.equal(got[1], want_b)):
                    print(f"{shape} {spec}: maxima differ from the first configuration's", flush=True)
                results[spec] = time_graph([call(x) for x in bufs])
        print(f"== {rows} x {cols}, length {length} (G = {group}): {moved / 1e6:.1f} MB, copy floor "
              f"{moved / (copy * 1e3):.1f} us", flush=True)
        for name, t in results.items():
            gbps = moved / (t.p50_us * 1e3)
            print(f"  {name:26s} {t.p50_us:8.2f} us  {gbps:7.0f} GB/s  {gbps / copy:5.1%} of copy", flush=True)
            rows_out.append({"shape": shape, "config": name, "us": t.p50_us, "GBps": gbps, "copy_GBps": copy,
                             "bytes": moved})
        del bufs
        if DEVICE == "cuda":
            torch.cuda.empty_cache()
    if a.out:
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "maxima_pass_configs.json"), "w") as f:
            json.dump({"env": env, "copy_GBps": copy, "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
