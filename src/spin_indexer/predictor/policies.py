"""Named predictor policies: name -> SpinConfig (the paper's variants and ours).

A policy fixes how SPIN predicts, pools, explores and handles MTP rows; the target sparsity and top-k
are given separately, so one name covers a whole sparsity sweep:

    get_policy("a1-mean", sparsity=0.4, topk=512)  ->  SpinConfig(pooling="a1", reduce="mean", ...)

Every policy starts from the paper's default ("spin-default": A1-Max pooling, random exploration with
gamma = 5%, alpha = 0.5, max-combine of the vertical and diagonal histories, row-0 MTP policy).
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from .config import SpinConfig

# dense_below=0: evaluation measures the predictor itself, so the speed guard (which scores every block of
# short contexts) is off; vertical_grain="slot": the paper's per-slot history (SpinConfig's default is "block";
# policy vertical-block measures it).
DEFAULT = SpinConfig(pooling="a1", reduce="max", exploration="random", gamma=0.05, alpha=0.5, combine="max",
                     mtp="row0", dense_below=0, vertical_grain="slot")

# name -> (fields replaced on DEFAULT, one-line description for reports)
POLICIES: dict[str, tuple[dict, str]] = {
    "spin-default": ({}, "A1-Max pooling + random 5% exploration (the paper's default)"),
    # pooling (paper Fig. 3)
    "a0": ({"pooling": "a0"}, "A0: select top slots first, keep their blocks"),
    "a1-max": ({}, "A1-Max: predict per slot, max-pool to blocks, top-m blocks"),
    "a2-max": ({"pooling": "a2"}, "A2-Max: pool V and D to blocks first, then combine"),
    "a1-mean": ({"reduce": "mean"}, "A1 with mean pooling"),
    "a1-top4": ({"reduce": "top4"}, "A1 with mean-of-top-4 pooling"),
    # With combine="max", A2-Max equals A1-Max exactly (max over a block of max(V, D) = max(max V, max D));
    # the two differ only when V and D are summed.
    "a1-max-sum": ({"combine": "sum"}, "A1-Max with V + D summed per slot"),
    "a2-max-sum": ({"pooling": "a2", "combine": "sum"}, "A2-Max with V and D block maxima summed"),
    # exploration (paper Fig. 4)
    "explore-none": ({"exploration": "none", "gamma": 0.0}, "no exploration"),
    "explore-random": ({}, "random 5% of the budget to skipped blocks"),
    "explore-staleness": ({"exploration": "staleness"}, "5% to skipped blocks by age x predicted percentile"),
    "explore-block-age": ({"exploration": "block_age"}, "5% to the longest-unscored blocks"),
    "explore-random-10": ({"gamma": 0.10}, "random 10% exploration"),
    # MTP rows (paper Fig. 2, Table 7)
    "mtp-row0": ({"mtp": "row0"}, "row-0 sharing + row-0 update"),
    "mtp-row-local": ({"mtp": "row-local"}, "row-local union + prefix-valid update"),
    # history tables
    "combine-vertical": ({"combine": "vertical"}, "vertical table only"),
    "combine-diagonal": ({"combine": "diagonal"}, "diagonal table only"),
    "combine-sum": ({"combine": "sum"}, "sum of vertical and diagonal estimates"),
    "vertical-block": ({"vertical_grain": "block"}, "vertical history a block: the EMA of each block's max score"),
    # EMA decay
    "alpha-0.25": ({"alpha": 0.25}, "EMA weight of the newest observation 0.25"),
    "alpha-1.0": ({"alpha": 1.0}, "no averaging: the last observation only"),
}
# the summary mix (beyond the paper, issue #18): history mixed with this step's query against S sub-block mean keys
# a block at weight w (SpinConfig.summary; replays need traces that recorded the summaries at S)
for _parts, _weight in ((1, 0.5), (1, 0.7), (2, 0.5), (4, 0.5), (8, 0.7), (16, 0.8)):
    POLICIES[f"summary{_parts}-{_weight:g}"] = (
        {"summary": _weight, "summary_parts": _parts},
        f"history mixed with the query against {_parts} sub-block mean keys a block, weight {_weight:g}")
for _weight in (0.5, 0.7):
    POLICIES[f"summary1-{_weight:g}-noexp"] = (
        {"summary": _weight, "summary_parts": 1, "exploration": "none", "gamma": 0.0},
        f"summary1-{_weight:g} without exploration (one mean key a block: 132 B a block)")
# S = 8, 16 at weights 0.8-1.0: the 4K weight sweep (results/fidelity/cpu-v3-head-summary/weights4k)
for _parts, _weight in ((16, 0.8), (16, 0.9), (16, 1.0), (8, 0.8), (8, 0.9), (8, 1.0)):
    POLICIES[f"summary{_parts}-{_weight:g}-noexp"] = (
        {"summary": _weight, "summary_parts": _parts, "exploration": "none", "gamma": 0.0},
        f"summary{_parts}-{_weight:g} without exploration (its 5% kept by the mix)")


# Per-layer budgets of the proxy model's shipped head (SpinConfig.sparsity_profile): calibrated by `spin-indexer
# calibrate` on text of neither evaluation domain (weights/README.md says how); requests of PROFILE_FROM tokens
# or more take them (on the proxy their tail gain held across domains from 8K, not at 4K: benchmarks/NOTES.md,
# session 56). Only for 30-layer traces of that head (SpinIndexer refuses another layer count).
SHIPPED_PROFILES = Path(__file__).resolve().parent.parent / "weights" / "smollm2_indexer.profile.json"
PROFILE_FROM = 6144
# apart from POLICIES (every one of which is a SpinConfig at any sparsity): these exist at the calibrated ones only
LAYERED = {"spin-layers": ({"profile_from": PROFILE_FROM},
                           "spin-default with the shipped head's per-layer budgets (calibrated at each sparsity)"),
           # below PROFILE_FROM tokens, where the history alone misses most (results/fidelity/cpu-v3-head-mix4k),
           # the summary mix (16 sub-block means a block, weight 0.8) without exploration and half the per-layer
           # budgets' spread; from PROFILE_FROM on exactly spin-layers (history, budgets, random 5%)
           "spin-layers-mix": ({"profile_from": PROFILE_FROM, "short_profile_strength": 0.5, "summary": 0.8,
                                "summary_parts": 16, "summary_below": PROFILE_FROM, "summary_explores": False},
                               f"spin-layers, and below {PROFILE_FROM} tokens the summary mix (S = 16, weight 0.8, "
                               f"no exploration) with the budgets at half strength")}


def load_profiles(path: str) -> dict[float, tuple[float, ...]]:
    """{sparsity: profile} of a calibrate output at `path` (`spin-indexer calibrate`'s profile.json)."""
    data = json.loads(Path(path).read_text())
    profiles = data.get("profiles") if isinstance(data, dict) else None
    if not isinstance(profiles, dict) or not profiles:
        raise ValueError(f"sparsity profile {path}: expected a calibrate output (a 'profiles' object), got none")
    return {float(s): tuple(p) for s, p in profiles.items()}


def profile_at(profiles: dict[float, tuple[float, ...]], sparsity: float, source: str) -> tuple[float, ...]:
    """The profile calibrated at `sparsity` (a ValueError naming the ones there are)."""
    for s, profile in profiles.items():
        if abs(s - sparsity) < 1e-9:
            return profile
    raise ValueError(f"sparsity profile {source}: no profile calibrated at sparsity {sparsity:g} (it has "
                     f"{', '.join(f'{s:g}' for s in profiles)}): calibrate with --sparsity {sparsity:g}")


def policy_names() -> list[str]:
    return list(POLICIES) + list(LAYERED)


def describe(name: str) -> str:
    """One-line description of a policy."""
    return {**POLICIES, **LAYERED}[_known(name)][1]


def get_policy(name: str, sparsity: float, topk: int | None = None, seed: int = 0) -> SpinConfig:
    """SpinConfig of policy `name` at target block sparsity `sparsity` (topk: the trace's k).

    raises ValueError listing the known names when `name` is unknown.
    """
    changes, _ = {**POLICIES, **LAYERED}[_known(name)]
    extra = {"sparsity": sparsity, "seed": seed}
    if name in LAYERED:
        extra["sparsity_profile"] = profile_at(load_profiles(SHIPPED_PROFILES), sparsity, name)
    if topk is not None:
        extra["topk"] = topk
    return dataclasses.replace(DEFAULT, **changes, **extra)


def _known(name: str) -> str:
    if name not in POLICIES and name not in LAYERED:
        raise ValueError(f"policy: expected one of {', '.join(policy_names())}, got {name!r}")
    return name
