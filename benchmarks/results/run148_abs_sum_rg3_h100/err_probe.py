"""Worst |logit - float64| / magnitude (log2) of the CUDA kernel builds on normal and wide-range inputs."""
import math, os, sys
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
import numpy as np, torch
from conftest import T, PagedInputs, logits_f64, make_paged_inputs, random_fp8
from spin_indexer.ops import indexer_logits_cuda as C

def inputs_for(kind, next_n, seed):
    gen = torch.Generator().manual_seed(seed)
    x = make_paged_inputs((3 * T + 5, 9 * T, 2 * T - 1), next_n, 64, 128, gen, extra_width=1)
    if kind == "normal":
        return x
    q = random_fp8(x.q_fp8.shape, gen, spread=6.0 if kind != "wide-w" else 1.0)
    w = torch.randn(x.weights.shape, generator=gen)
    if kind != "wide-q":
        w = w * torch.exp2((torch.rand(x.weights.shape, generator=gen) * 2 - 1) * 8.0)
    return PagedInputs(q, x.kv_cache, w, x.seq_lens, x.block_table)

for build, defs in (("relu", ("SPIN_LOGITS_ABS_SUM=0",)), ("abs", ())):
    lib = C.load_library(defs)
    for kind in ("normal", "wide-q", "wide-w", "wide"):
        worst = []
        for next_n in (1, 2, 3, 4):
            for seed in range(3):
                x = inputs_for(kind, next_n, seed)
                args = [t.cuda() for t in x.args()]
                out = C.paged_indexer_logits_cuda(*args, library=lib).cpu().double().numpy()
                exp, mag = logits_f64(*x.args())
                live = np.isfinite(exp)
                r = (np.abs(out[live] - exp[live]) / np.maximum(mag[live], 1e-30)).max()
                worst.append(r)
        print(f"{build:5s} {kind:7s} worst err/magnitude 2^{math.log2(max(worst)):.2f}  (per next_n max: "
              + " ".join(f"2^{math.log2(max(worst[i*3:(i+1)*3])):.1f}" for i in range(4)) + ")", flush=True)
