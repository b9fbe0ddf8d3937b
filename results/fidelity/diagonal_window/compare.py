"""Diagonal window vs the paper's unbounded diagonal table: replay miss on synthetic traces (CPU)."""
import dataclasses, json, sys, time
import torch
from spin_indexer.traces.synthetic import generate_set
from spin_indexer.traces.replay import replay
from spin_indexer.eval.policies import get_policy
torch.set_num_threads(1)
rows = []
for preset in ("v4-like", "v32-like"):
    traces = generate_set(preset, 2, seed=0, num_steps=48)
    for s in (0.3, 0.5):
        for window in (None, 8192, 2048):
            cfg = dataclasses.replace(get_policy("spin-default", s), diagonal_window=window)
            t0 = time.time()
            res = replay(traces, cfg)
            miss = torch.cat([m[:, :, :][res.eligible[n][:, None, :].expand_as(m)] for n, m in res.miss.items()])
            row = dict(preset=preset, sparsity=s, window=window, mean=float(miss.mean()), p99=float(miss.quantile(0.99)),
                       realized=float(torch.cat([v.flatten() for v in res.sparsity.values()]).mean()), seconds=round(time.time()-t0, 1))
            print(json.dumps(row), flush=True)
            rows.append(row)
json.dump(rows, open("results/fidelity/diagonal_window/window_rows.json", "w"), indent=1)
