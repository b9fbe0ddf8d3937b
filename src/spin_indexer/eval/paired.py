"""Paired score differences of RULER quality samples: a config against a base (all-keep) on the same prompts.

Pairing removes the prompt-to-prompt spread that makes each config's own (Wilson) interval wide: the
difference of two configs is measured per prompt, then averaged. The 95% interval is the normal
approximation over the per-prompt differences (mean +- 1.96 x sample sd / sqrt(n)); with n >= 100 prompts a
bin it is within 1% of Student's t interval. Issue #18's bounds: SPIN 30% within 1 score point of all-keep,
SPIN 40% within 2 (ISSUE_BOUNDS), checked on the interval, not on the mean alone.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

Z95 = 1.959964
# score points (x 100) of the paired difference to all-keep; the -profile configs are the same sparsity with the
# budget moved between layers (spin-layers), the -sum0.8x16b6k-quiet-profile ones spin-layers-mix (the candidate
# default: the summary mix below 6144 tokens), held to the same bounds
ISSUE_BOUNDS = {"spin-0.3": 1.0, "spin-0.4": 2.0, "spin-0.3-profile": 1.0, "spin-0.4-profile": 2.0,
                "spin-0.3-sum0.8x16b6k-quiet-profile": 1.0, "spin-0.4-sum0.8x16b6k-quiet-profile": 2.0}
# a named policy at a sparsity (eval.quality's `<policy>@<s>`: the policy's whole predictor) is held to the
# bound of its sparsity
POLICY_BOUNDS = {0.3: 1.0, 0.4: 2.0}


def issue_bound(config: str) -> float | None:
    """issue #18's bound (score points) for a quality config name, None where it sets none: the names of
    ISSUE_BOUNDS, and `<policy>@0.3` / `<policy>@0.4` for any policy of predictor/policies.py (one row a step: the
    bounds are not set for mtp<N>- names)."""
    if config in ISSUE_BOUNDS:
        return ISSUE_BOUNDS[config]
    if "@" not in config:
        return None
    from .quality import parse_config  # the one reader of <policy>@<s> names (imported here: it needs torch)

    try:
        parsed = parse_config(config)
    except ValueError:  # not a config name
        return None
    return POLICY_BOUNDS.get(parsed.sparsity) if parsed.next_n == 1 else None


@dataclass(frozen=True)
class PairedDiff:
    """mean and 95% interval (lo, hi) of the per-prompt differences, in score points; n pairs (lo = hi =
    nan when n < 2); same / better / worse: pairs with identical output text, a higher, a lower score."""
    n: int
    mean: float
    lo: float
    hi: float
    same: int = 0
    better: int = 0
    worse: int = 0


def paired_diff(diffs: list[float]) -> tuple[float, float, float]:
    """(mean, lo, hi): the mean of the differences and its 95% normal-approximation interval; (nan, nan, nan)
    for no differences, (mean, nan, nan) for one."""
    n = len(diffs)
    if n == 0:
        return math.nan, math.nan, math.nan
    mean = sum(diffs) / n
    if n < 2:
        return mean, math.nan, math.nan
    half = Z95 * math.sqrt(sum((d - mean) ** 2 for d in diffs) / (n - 1) / n)
    return mean, mean - half, mean + half


def verdict(d: PairedDiff, bound: float) -> str:
    """Against a bound of +-bound points: "within" (the whole interval lies in [-bound, +bound]), "not worse"
    (the interval is above -bound but reaches past +bound: SPIN may score higher, not lower, than the bound
    allows), "no" (the interval reaches below -bound), "-" (no interval)."""
    if math.isnan(d.lo):
        return "-"
    if d.lo < -bound:
        return "no"
    return "within" if d.hi <= bound else "not worse"


def paired_diffs(samples: list[dict], configs: list[str], base: str = "all-keep") -> list[tuple[str, int, PairedDiff]]:
    """(config, context, PairedDiff of config minus base) per context bin (ascending) and config (in order,
    the base left out), over the prompts (task, context, seed) both have; scores are x 100."""
    by_prompt = {(s["task"], s["context"], s["seed"], s["config"]): s for s in samples}
    out = []
    for context in sorted({s["context"] for s in samples}):
        for cfg in configs:
            if cfg == base:
                continue
            pairs = [(a, by_prompt.get((a["task"], a["context"], a["seed"], base))) for a in samples
                     if a["config"] == cfg and a["context"] == context]
            pairs = [(a, b) for a, b in pairs if b is not None]
            if not pairs:
                continue
            mean, lo, hi = paired_diff([100 * (a["score"] - b["score"]) for a, b in pairs])
            out.append((cfg, context, PairedDiff(len(pairs), mean, lo, hi,
                                                 same=sum(a.get("text") == b.get("text") for a, b in pairs),
                                                 better=sum(a["score"] > b["score"] for a, b in pairs),
                                                 worse=sum(a["score"] < b["score"] for a, b in pairs))))
    return out
