"""A per-layer sparsity profile (SpinConfig.sparsity_profile) calibrated from traces.

Layers differ in how well their history predicts them: on the proxy's head at 8K, 40%, a layer's mean miss ranges
from 0.3% to 13% (benchmarks/NOTES.md, session 56). With the same mean sparsity (the same key bytes a step), moving
budget from the layers SPIN predicts well to the ones it predicts badly lowers the mean and the tail of the miss.

    1. replay the policy at every sparsity of a menu (evenly spaced, uniform over the layers): per layer, the mean
       miss over the eligible rows of every trace;
    2. a dynamic program gives each layer one menu sparsity, their mean equal to the target, with the least
       summed mean miss (exact on the menu's grid: O(layers x menu x layers x menu));
    3. profile[l] = sparsity_l / target, so SpinConfig(sparsity=target, sparsity_profile=profile) replays the
       choice. Calibrate at the sparsity served: a 0.4 profile scaled to 0.5 widened the tail (NOTES).
"""
from __future__ import annotations

import dataclasses

import torch

from ..checks import check_float, check_sequence
from ..predictor.config import SpinConfig
from ..traces.replay import replay
from ..traces.schema import Trace


def layer_miss(traces: list[Trace], config: SpinConfig, device: str = "cpu", max_batch: int = 4) -> torch.Tensor:
    """float64 [L]: per layer, the mean miss of `config` over the eligible rows of every trace (uniform sparsity:
    the layers replay folded, as any eval)."""
    result = replay(traces, config, device=device, max_batch=max_batch)
    sums, counts = None, 0
    for trace in traces:
        miss = result.miss[trace.name].double()  # [S, L, N]
        eligible = result.eligible[trace.name][:, None, :].expand_as(miss)
        per_layer = torch.where(eligible, miss, 0.0).sum(dim=(0, 2))
        sums = per_layer if sums is None else sums + per_layer
        counts += int(result.eligible[trace.name].sum())
    if sums is None or counts == 0:
        raise ValueError("traces: expected at least one row longer than the top-k (eligible), got none")
    return sums / counts


def allocate(miss: torch.Tensor, menu: list[float], target: float) -> list[int]:
    """Menu index a layer whose sparsities average `target` with the least summed miss. miss: [M, L], the mean
    miss of each layer at each menu sparsity; menu: evenly spaced ascending sparsities. Ties go to the choice
    found first (lower sparsities for lower layers)."""
    count, layers = miss.shape
    step = menu[1] - menu[0] if count > 1 else 1.0
    units = [round((m - menu[0]) / step) for m in menu]  # grid units above the menu's first value
    budget = round((target - menu[0]) * layers / step)
    on_grid = abs(menu[0] * layers + budget * step - target * layers) <= 1e-6 * layers
    if not on_grid or not 0 <= budget <= units[-1] * layers:
        raise ValueError(f"sparsity: expected a mean the menu {menu} can make over {layers} layers, got {target:g}")
    best: dict[int, tuple[float, list[int]]] = {0: (0.0, [])}  # grid units spent -> (summed miss, choice)
    for layer in range(layers):
        nxt: dict[int, tuple[float, list[int]]] = {}
        for spent, (cost, choice) in best.items():
            for i, u in enumerate(units):
                if spent + u > budget:
                    continue
                cand = (cost + float(miss[i, layer]), choice + [i])
                if spent + u not in nxt or cand[0] < nxt[spent + u][0]:
                    nxt[spent + u] = cand
        best = nxt
    return best[budget][1]


@dataclasses.dataclass
class Calibration:
    """profile: SpinConfig.sparsity_profile for `sparsity`; menu; miss [M][L], each layer's mean miss replayed
    uniformly at each menu sparsity (the replays behind the choice); chosen_miss [L], the chosen entries."""

    sparsity: float
    menu: list[float]
    profile: list[float]
    miss: list[list[float]]
    chosen_miss: list[float]

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def calibrate(traces: list[Trace], config: SpinConfig, sparsity: float, menu: list[float], device: str = "cpu",
              max_batch: int = 4) -> Calibration:
    """The profile of `config`'s policy at mean `sparsity` from `traces` (module docstring). config's own
    sparsity and profile are ignored (each menu value replays uniformly)."""
    check_float("sparsity", sparsity, low=0, high=1, high_open=True)
    menu = sorted(check_sequence("menu", menu, lambda name, m: check_float(name, m, low=0, high=1, high_open=True)))
    gaps = [b - a for a, b in zip(menu, menu[1:])]
    if len(menu) < 2 or min(gaps) <= 0 or max(gaps) - min(gaps) > 1e-9:
        raise ValueError(f"menu: expected evenly spaced distinct sparsities, got {menu}")
    if sparsity == 0:
        raise ValueError("sparsity: expected > 0 (a profile multiplies it), got 0")
    base = dataclasses.replace(config, sparsity_profile=())
    miss = torch.stack([layer_miss(traces, dataclasses.replace(base, sparsity=m), device, max_batch) for m in menu])
    choice = allocate(miss, menu, sparsity)
    return Calibration(sparsity, menu, [menu[i] / sparsity for i in choice], miss.tolist(),
                       [float(miss[i, layer]) for layer, i in enumerate(choice)])

