"""Which objective should `spin-indexer calibrate` minimize? Per-layer allocations by several objectives, calibrated
on one domain and scored on the other (4K and 8K, RULER <-> python_stdlib), composed offline from uniform replays:
a layer's misses under a profile are its misses replayed alone at its sparsity (exact without exploration,
tests/eval/test_calibrate.py; here spin-default, so up to the exploration draws).

    python benchmarks/profile_objectives.py 0.4 [TRACES]   # TRACES/{ruler,stdlib}{4096,8192}: capture's folders
Output (session 56): results/fidelity/cpu-v3-head-layers/cross/objectives.txt. The replays of a trace set are
cached in /tmp/obj/<set>.pkl.
"""
from __future__ import annotations

import os
import pickle
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from spin_indexer.eval.calibrate import allocate as allocate_menu  # noqa: E402
from spin_indexer.eval.metrics import nearest_rank  # noqa: E402
from spin_indexer.predictor.policies import get_policy  # noqa: E402
from spin_indexer.traces import list_traces, load_trace  # noqa: E402
from spin_indexer.traces.replay import replay  # noqa: E402

MENU = [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
CACHE = "/tmp/obj"
PAIRS = [("ruler4096", "stdlib4096"), ("stdlib4096", "ruler4096"), ("ruler8192", "stdlib8192"),
         ("stdlib8192", "ruler8192")]


def _mean(x: torch.Tensor) -> float:
    return float(x.double().mean())


OBJECTIVES = {  # a layer's cost from its rows' misses at one sparsity; the allocation minimizes their sum
    "mean": _mean,
    "mean+.1q99": lambda x: _mean(x) + 0.1 * nearest_rank(x, 0.99),
    "mean+.25q99": lambda x: _mean(x) + 0.25 * nearest_rank(x, 0.99),
    "mean+.25q95": lambda x: _mean(x) + 0.25 * nearest_rank(x, 0.95),
    "q95": lambda x: nearest_rank(x, 0.95),
    "sq": lambda x: float((x.double() ** 2).mean()),
}


def layer_rows(folder: str) -> list[list[torch.Tensor]]:
    """[menu][layer]: the eligible rows' misses of every trace in folder, spin-default at each menu sparsity."""
    cache = os.path.join(CACHE, os.path.basename(folder) + ".pkl")
    if os.path.exists(cache):
        with open(cache, "rb") as f:
            return pickle.load(f)
    traces = [load_trace(f) for f in list_traces(folder)]
    out = []
    for sparsity in MENU:
        res = replay(traces, get_policy("spin-default", sparsity))
        layers = res.miss[traces[0].name].shape[1]
        out.append([torch.cat([res.miss[t.name][:, layer, :][res.eligible[t.name]] for t in traces])
                    for layer in range(layers)])
    os.makedirs(CACHE, exist_ok=True)
    with open(cache, "wb") as f:
        pickle.dump(out, f)
    return out


def score(rows: list[list[torch.Tensor]], choice: list[int]) -> tuple[float, float]:
    """(mean, p99) over every row when layer l runs at MENU[choice[l]]."""
    x = torch.cat([rows[i][layer] for layer, i in enumerate(choice)])
    return _mean(x), nearest_rank(x, 0.99)


def allocate(rows, target: float, cost, lo: int, hi: int) -> list[int]:
    """Menu index a layer (within MENU[lo:hi]) with mean sparsity target and the least summed cost
    (eval.calibrate.allocate over the cost of every (sparsity, layer))."""
    costs = torch.tensor([[cost(x) for x in rows[i]] for i in range(lo, hi)], dtype=torch.float64)
    return [lo + i for i in allocate_menu(costs, MENU[lo:hi], target)]


def main() -> int:
    target = float(sys.argv[1])
    root = sys.argv[2] if len(sys.argv) > 2 else "/tmp/tr"
    torch.set_num_threads(1)
    for cal, ev in PAIRS:
        rc, re = layer_rows(os.path.join(root, cal)), layer_rows(os.path.join(root, ev))
        u = MENU.index(target)
        print(f"{cal} -> {ev} @ {target}: uniform %.2f / %.2f" % tuple(100 * v for v in score(re, [u] * len(re[0]))))
        for name, cost in OBJECTIVES.items():
            for lo, hi in ((0, len(MENU)), (max(0, u - 2), u + 3)):
                choice = allocate(rc, target, cost, lo, hi)
                out, ins = score(re, choice), score(rc, choice)
                print(f"   {name:12s} menu {MENU[lo]}-{MENU[hi - 1]}: {100 * out[0]:.2f} / {100 * out[1]:.2f}   "
                      f"(in-sample {100 * ins[0]:.2f} / {100 * ins[1]:.2f})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
