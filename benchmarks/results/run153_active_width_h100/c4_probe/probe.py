"""Why is the CUDA logits kernel slower inside SPIN's step (1 x 128K n = 2) than alone? Graph variants, paired."""
import os, sys, statistics
sys.path[:0] = ["benchmarks", "src"]
os.environ["SPIN_INDEXER_LOGITS"] = "cuda"
import torch
from run_all import Point, steady_indexer, TOPK
from harness import time_graphs_paired
from update_overlap import timeline
from spin_indexer import ops
from spin_indexer.predictor import SpinConfig
from spin_indexer.predictor.select import budget_of

for spec in sys.argv[1:]:
    b, L, n = map(int, spec.split("x"))
    p = Point(b, L, n, dry=False)
    idx, slots = steady_indexer(p, SpinConfig(sparsity=0.5, topk=TOPK))
    idx.plan(p.table, p.lens, slots, validate=False)
    for i in range(p.layers):
        idx.run(i, p.q[i][0], p.caches[i], p.q[i][1])
    plans = [idx.plans(i) for i in range(p.layers)]
    rows, cols = b * n, p.width * 64
    active = budget_of(p.width, 0.5, TOPK, 64)
    group = ops.topk_group(cols, TOPK)
    outs = [torch.empty(rows, cols, device="cuda") for _ in range(p.layers)]
    bms = [torch.empty(rows, p.width, device="cuda") for _ in range(p.layers)]
    gms = [torch.empty(rows, -(-cols // group), device="cuda") for _ in range(p.layers)]
    clens = [pl.compact_seq_lens.reshape(-1) for pl in plans]

    def logits(i, gmax, own_plan=True, layer_out=True):
        pl = plans[i] if own_plan else plans[0]
        j = i if layer_out else 0
        return ops.paged_indexer_logits(p.q[i][0], p.caches[i], p.q[i][1], pl.compact_seq_lens, pl.compact_block_table,
                                        validate=False, out=outs[j], block_max_out=bms[j], fill_tail=False,
                                        group_max_out=gms[j] if gmax else None, group=group, active_width=active,
                                        backend="cuda")

    def topk(i):
        return ops.topk_positions(outs[i], clens[i], TOPK, block_max=bms[i], kept_blocks=plans[i].kept_blocks,
                                  next_n=n, validate=False, group_max=gms[i], group=group)
    for i in range(p.layers):
        logits(i, True)
    calls = {
        "alone_plan0_out0": lambda: [logits(i, False, False, False) for i in range(p.layers)],
        "alone_nogmax": lambda: [logits(i, False) for i in range(p.layers)],
        "alone_gmax": lambda: [logits(i, True) for i in range(p.layers)],
        "topk_alone": lambda: [topk(i) for i in range(p.layers)],
        "logits_topk": lambda: [(logits(i, True), topk(i)) for i in range(p.layers)],
        "plan": lambda: idx.plan(p.table, p.lens, slots, validate=False),
        "step": lambda: (idx.plan(p.table, p.lens, slots, validate=False),
                         [idx.run(i, p.q[i][0], p.caches[i], p.q[i][1]) for i in range(p.layers)]),
    }
    ms = time_graphs_paired(calls, rounds=15)
    med = {k: statistics.median(v) * 1e3 / p.layers for k, v in ms.items()}
    print(spec, f"group {group} layers {p.layers}:", ", ".join(f"{k} {v:.2f}" for k, v in med.items()))
    med["step_runs"] = (med["step"] - med["plan"])
    print("  step runs only / layer:", f"{med['step_runs']:.2f}")
    print("  logits_topk - topk_alone - alone_gmax:", f"{med['logits_topk'] - med['topk_alone'] - med['alone_gmax']:.2f}")
    for name in ("alone_gmax", "logits_topk"):
        lines = []
        timeline(calls[name], lines)
        print(" ", name, "timeline:")
        print("\n".join(l[:110] for l in lines[:12]))
