"""SpinConfig: every knob of the SPIN predictor, frozen and validated, with the paper's defaults.

Variants are made with dataclasses.replace(PRESETS["paper"], sparsity=0.4). Choices are str enums so
they print and parse ("a1-max", "random", "row0").
"""
from __future__ import annotations

import dataclasses
import enum
import json
import math

import torch

from ..checks import check_bool, check_enum, check_float, check_int, check_sequence, describe
from .adaptive import AdaptiveConfig


class Pooling(str, enum.Enum):
    A0 = "a0"  # select top slots first; kept blocks are those holding a selected slot (count <= budget)
    A1 = "a1"  # predict per slot, pool to blocks with `reduce`, keep the top-m blocks (paper default, max)
    A2 = "a2"  # pool V and D to blocks first, then combine (loses the slot-level pairing of V and D)


class Reduce(str, enum.Enum):
    MAX = "max"
    MEAN = "mean"
    TOP4 = "top4"  # mean of the 4 best slots of the block


class Combine(str, enum.Enum):
    MAX = "max"  # a slot matters if either its vertical or its diagonal history says so
    SUM = "sum"  # average of both estimates (x2); a missing one counts as the other
    VERTICAL = "vertical"  # V only
    DIAGONAL = "diagonal"  # D only


class Exploration(str, enum.Enum):
    NONE = "none"
    RANDOM = "random"  # gamma of the budget to uniformly random skipped blocks
    STALENESS = "staleness"  # skipped blocks ranked by age x predicted importance (percentile)
    BLOCK_AGE = "block_age"  # skipped blocks not scored for the longest time


class Grain(str, enum.Enum):
    SLOT = "slot"  # the paper's vertical table: one EMA a KV slot (2 B a cached token a layer)
    BLOCK = "block"  # one EMA a KV block, of the block's max score (2 B a block): the same A1-Max scores (below)
    AUTO = "auto"  # BLOCK where the rule reads no slot's own V, else SLOT (SpinConfig.grain)


class MtpPolicy(str, enum.Enum):
    ROW0 = "row0"  # all rows use row 0's predicted blocks; only row 0 updates the state
    ROW_LOCAL = "row-local"  # union of per-row predictions; rows 0..num_accepted update (prefix-valid)


# Contexts (tokens) below which the guard scores every block of a request: its few blocks save less than
# their share of SPIN's work. A placeholder, not a measured crossover (benchmarks/NOTES.md, "guard").
AUTO_DENSE_BELOW = 16384
# Cached tokens per step (the sum over requests of their longest row) below which the guard scores every
# block of every request. With DeepGEMM computing SPIN's logits at every size (ops/deepgemm.py, run 27) SPIN's
# step beat the dense one at every step of 64K tokens and more the H200 timed at s >= 0.4 (run 28,
# benchmarks/results/run28_deepgemm_every_size: B = 1 x 64K..512K 1.04-1.14x, 8 x 64K 1.10-1.17x), while the
# guarded step cost 0.95-1.01x there (plan() on top of the dense kernels; 0.95x at 1 x 512K): the guard moved
# from 1M tokens (runs 12-14, when the small steps ran the fused Triton kernel) to below the smallest step
# measured. Steps SPIN still loses (1 x 512K at s = 0.2 / 0.3: 0.95x / 0.99x, 1 x 256K at s = 0.2: 0.98x) the
# guarded step loses as well (0.95x / 0.95x / 1.00x).
AUTO_DENSE_BATCH_TOKENS = 1 << 16
# A step of one query row (B x next_n = 1) is guarded below more cached tokens at low sparsity ("auto" only):
# AUTO_ONE_ROW_GUARDS lists (max sparsity, tokens below which the step is guarded), the first that holds wins.
# There SPIN saves s x one row's logits (~2-4 us a layer at s = 0.2 from 128K to 512K) against its own plan share
# and update (~2.5-4 us). Run 49 measured 1 x 128K at s = 0.3 / 0.2 0.99x / 0.96x, 1 x 256K and 1 x 512K at s =
# 0.2 0.99x / 0.98x; run 58 1 x 128K s = 0.3 / 0.2 0.997x / 0.978x, 1 x 512K s = 0.2 0.990x; run 63 (SPIN on the
# prefetching Triton logits) 1 x 64K / 128K at s = 0.2 0.983x / 0.989x, 1 x 256K s = 0.2 42.4 us against run 58's
# dense step of 42.1 (the dense kernel there is run 58's again since 2597683). At s = 0.3 from 256K SPIN wins:
# 1 x 256K / 512K 39.6 / 49.0 us (run 63) against 42.1 / 51.9 (run 58), where the earlier rule (s <= 0.3 below 1M)
# ran the dense step. Since plan() launches nothing for a table its shape guards (SpinIndexer._dense_plan) a
# guarded step is the dense step's kernels (run 58: 0.996-1.03x of the dense step timed apart; run 63: >= 0.999x).
# 1 x 1M at s = 0.2 (1.02-1.08x) and every step of two rows or more measured >= 1.0x.
# Runs 68 / 69 (benchmarks/results/run68_plan_dram, run69_plan_layer_major; SPIN's compact logits on Triton, the
# set top-k), dense step / SPIN step unguarded -> guarded at B = 1: s = 0.3 64K 1.001 / 1.022 -> 0.990 / 1.016,
# 128K 1.019 / 1.030 -> 0.993 / 1.010; s = 0.2 256K 1.015 / 1.008 -> 1.001 / 0.995, 512K 1.059 / 1.062 -> 1.003 /
# 1.002; only s = 0.2 below 256K still gains: 64K 0.988 / 1.010 -> 0.996 / 1.010, 128K 0.997 / 1.006 -> 1.000 /
# 1.016. So the guard keeps that one rule (it was s <= 0.2 below 1M and s <= 0.3 below 256K).
# Since the top-k's one-tile threshold (0a932b0: both steps' top-k ~2-3 us shorter at one row) 1 x 64K at s = 0.3
# lost again, paired: 0.998x (run 100, H200) and 0.992x (run 157, H100), where 1 x 128K s = 0.3 won (1.020x /
# 1.016x) and the guarded 1 x 64K s = 0.2 step took 1.017x / 1.018x: s <= 0.3 is guarded below 128K.
AUTO_ONE_ROW_GUARDS = ((0.2, 1 << 18), (0.3, 1 << 17))


def _check_threshold(name: str, value) -> None:
    """A guard threshold: an int >= 0 or "auto" (TypeError / ValueError naming the field)."""
    if isinstance(value, str):
        if value != "auto":
            raise ValueError(f"{name}: expected an int >= 0 or 'auto', got {value!r}")
    elif isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name}: expected an int >= 0 or 'auto', got {describe(value)}")
    else:
        check_int(name, value, low=0)


_ENUMS = {"pooling": Pooling, "reduce": Reduce, "combine": Combine, "exploration": Exploration, "mtp": MtpPolicy,
          "vertical_grain": Grain}


@dataclasses.dataclass(frozen=True)
class SpinConfig:
    """SPIN predictor settings.

    sparsity: target block sparsity s in [0, 1): fraction of blocks NOT scored; budget per request is
        ceil((1 - s) * n_blocks) kept blocks (raised to cover top-k, see indexer/spin.py).
    topk: K tokens selected per row (2048 on DeepSeek-V3.2, 512 on V4 C4A layers).
    alpha: EMA weight of the newest observation, in (0, 1].
    exploration / gamma: share of the budget given to skipped blocks, gamma in [0, 1).
    pooling / reduce / combine: how slot predictions become block scores (see predictor/score.py).
    mtp: policy for next_n > 1 rows.  seed: exploration randomness (counter-based, reproducible).
    tokens_per_block: T, 64 in every engine.  state_dtype: dtype of the V/D EMA tables (2 B/token each
        in float16).
    adaptive: AdaptiveConfig to move each (layer, request) budget over a sparsity menu toward a miss
        target (predictor/adaptive.py); `sparsity` is then the starting point. None = the paper's fixed s.
    hybrid: weight in [0, 1] of the previous layer's scores from the same step (what that layer's indexer
        just computed) against this layer's own history, mixed as block-score percentiles
        (predictor/hybrid.py). 0 = the paper's history-only predictor.
    summary: weight in [0, 1] of this step's query scored against each block's sub-block mean keys
        (ops.block_summary_scores), mixed with this layer's history as standardized scores
        (predictor/summary.py; docs/current_step_selection.md). It needs the layer's query and keys, so the
        layer selects in run(). 0 = off. summary_parts: sub-blocks a block (a divisor of tokens_per_block).
        summary_below: requests whose longest row holds at least this many tokens select from the history alone
        (the paper's scores, selected in plan() with the other layers) and neither write nor read the summary
        cache; 0 = every request mixes. The mix's select is one launch of B programs a layer, one program's
        chain of reductions: cheap at short contexts only (benchmarks/NOTES.md, session 49). summary_explores:
        whether the requests that mix also give `gamma` of their budget to random skipped blocks. Exploration
        refreshes a history that went stale; the mix has seen every block's summary this step, so False gives
        that share to the mix's own choice (at 4K out of domain 0.4-0.6 points less mean miss:
        results/fidelity/cpu-v3-head-summary). The requests that select from the history alone explore as set.
    sparsity_profile: per-layer multipliers of `sparsity`: layer l skips sparsity x sparsity_profile[l] of its
        blocks (layer_sparsity). Layers differ in how well their history predicts them (the proxy's head: 0.3-13%
        mean miss a layer at 8K, 40%); a profile of mean 1 moves budget to the hard layers and keeps the step's
        key bytes. One entry a layer of the model (SpinIndexer checks the count); () = every layer at `sparsity`
        (the paper). Calibrated from traces at the sparsity it serves: `spin-indexer calibrate` (scaled to another
        sparsity it is an approximation). Not with adaptive budgets. profile_from: requests whose longest row
        holds fewer tokens take the profile at short_profile_strength a (in [0, 1]): layer l at sparsity x
        (1 + a x (sparsity_profile[l] - 1)); a = 0 (the default) budgets every layer at `sparsity` there, 1 the
        whole profile (as profile_from = 0). On the proxy the whole profile's tail gain held across domains from
        8K, not at 4K (benchmarks/NOTES.md, session 56); with the summary mix at 4K half of it gained on both
        domains (results/fidelity/cpu-v3-head-mix4k).
    diagonal_window: offsets from the query (tokens) that keep diagonal history; the diagonal patterns
        live near the query, and a bounded window keeps a request's state the same size at any context.
        None = every offset (the paper's unbounded table; sized to the indexer's maximum context).
    dense_below: the speed guard per request. Requests whose context is shorter than this many tokens
        score every block (the dense path) and keep no history, decided on the device per request; the
        block plan says so (BlockPlan.guarded). "auto" = AUTO_DENSE_BELOW; 0 = off (the default: the
        paper's predictor at every length, what evaluation measures).
    dense_batch_below: the speed guard per step. When the step's cached tokens (sum over requests of the
        longest row) are fewer than this, every request is guarded as above (those with L <= topk too: a
        small step keeps no history), decided on the device (every program of plan() sums the lengths: no
        host sync); a table whose B x W x T is already below it runs the dense kernels
        (SpinIndexer._run_dense). "auto" = AUTO_DENSE_BATCH_TOKENS, from the H200 grid, or more for a step of
        one query row at low sparsity (AUTO_ONE_ROW_GUARDS, guard_batch_tokens_for);
        0 = off (the default).
    vertical_grain: what the vertical history keeps. "auto" (the default): "block" unless the rule reads V slot
        by slot (reduce=mean / top4, combine=sum, the summary mix, A0 pooling), which takes "slot"; `grain` is
        the one in force. "block": one value a block, the EMA of the block's max score (block_max itself: no
        per-slot table), so the score is max(VB, the window's D) and the update reads the block maxima the top-k
        already needs instead of every logit again (O(blocks), 2 B a block of state). "slot" (the paper;
        evaluation's policies pin it, predictor/policies.py): V[i], the EMA of each slot's score (2 B a token),
        and a block's A1-Max score max(max_i V[i], the window's D). For a block scored whole the two differ only
        in where the max is taken: the EMA of the max, against the max of each slot's EMA (the larger: a block
        whose best slot moved keeps its past peak longer). Why block by default: the step at 96 x 512K s = 0.4
        1.51x -> 1.56x the dense step, V3.2's 61 layers 0.583 -> 0.567 of dense's indexer time at 128K (H100,
        benchmarks/results/run160_grain_grid_h100); fidelity within +-0.25 pt of slot's mean miss
        (results/fidelity/vertical_grain). "block" with reduce=mean / top4, combine=sum or the summary mix is
        refused.
    """

    sparsity: float = 0.3
    topk: int = 2048
    alpha: float = 0.5
    exploration: Exploration = Exploration.RANDOM
    gamma: float = 0.05
    pooling: Pooling = Pooling.A1
    reduce: Reduce = Reduce.MAX
    combine: Combine = Combine.MAX
    mtp: MtpPolicy = MtpPolicy.ROW0
    seed: int = 0
    tokens_per_block: int = 64
    state_dtype: torch.dtype = torch.float16
    adaptive: AdaptiveConfig | None = None
    hybrid: float = 0.0
    summary: float = 0.0
    summary_parts: int = 4
    summary_below: int = 0
    summary_explores: bool = True
    sparsity_profile: tuple[float, ...] = ()
    profile_from: int = 0
    short_profile_strength: float = 0.0
    diagonal_window: int | None = 8192
    dense_below: int | str = 0
    dense_batch_below: int | str = 0
    vertical_grain: Grain = Grain.AUTO

    def __post_init__(self):
        # Every field is checked for its type first (TypeError naming it), then its range (ValueError);
        # numbers are stored as exact int / float, so nothing is truncated and to_json() always works.
        for name, cls in _ENUMS.items():
            self._set(name, check_enum(f"SpinConfig.{name}", getattr(self, name), cls))
        self._set("sparsity", check_float("SpinConfig.sparsity", self.sparsity, low=0, high=1, high_open=True))
        self._set("alpha", check_float("SpinConfig.alpha", self.alpha, low=0, high=1, low_open=True))
        self._set("gamma", check_float("SpinConfig.gamma", self.gamma, low=0, high=1, high_open=True))
        self._set("hybrid", check_float("SpinConfig.hybrid", self.hybrid, low=0, high=1))
        self._set("summary", check_float("SpinConfig.summary", self.summary, low=0, high=1))
        self._set("summary_parts", check_int("SpinConfig.summary_parts", self.summary_parts, low=1))
        self._set("summary_below", check_int("SpinConfig.summary_below", self.summary_below, low=0))
        self._set("summary_explores", check_bool("SpinConfig.summary_explores", self.summary_explores))
        self._set("topk", check_int("SpinConfig.topk", self.topk, low=1))
        self._set("seed", check_int("SpinConfig.seed", self.seed, low=0, high=2**31 - 1))
        self._set("tokens_per_block", check_int("SpinConfig.tokens_per_block", self.tokens_per_block, low=1))
        if self.tokens_per_block % self.summary_parts:
            raise ValueError(f"SpinConfig.summary_parts: expected a divisor of tokens_per_block "
                             f"({self.tokens_per_block}), got {self.summary_parts}")
        if self.adaptive is not None and not isinstance(self.adaptive, AdaptiveConfig):
            raise TypeError(f"SpinConfig.adaptive: expected an AdaptiveConfig or None, got {describe(self.adaptive)}")
        self._set("sparsity_profile", self._checked_profile())
        self._set("profile_from", check_int("SpinConfig.profile_from", self.profile_from, low=0))
        self._set("short_profile_strength", check_float("SpinConfig.short_profile_strength",
                                                        self.short_profile_strength, low=0, high=1))
        if self.diagonal_window is not None:
            if isinstance(self.diagonal_window, bool) or not isinstance(self.diagonal_window, int):
                raise TypeError(f"SpinConfig.diagonal_window: expected an int or None, got {describe(self.diagonal_window)}")
            check_int("SpinConfig.diagonal_window", self.diagonal_window, low=1)
        if self.vertical_grain is Grain.BLOCK and self._reads_slot_history(pooling=False):
            raise ValueError(f"SpinConfig.vertical_grain: 'block' keeps no per-slot history; expected reduce='max', "
                             f"combine other than 'sum' and summary = 0 with it (or vertical_grain='slot' or 'auto' "
                             f"for those), got reduce={self.reduce.value!r}, combine={self.combine.value!r}, "
                             f"summary={self.summary:g}")
        for name in ("dense_below", "dense_batch_below"):
            _check_threshold(f"SpinConfig.{name}", getattr(self, name))
        if not isinstance(self.state_dtype, torch.dtype) or \
                self.state_dtype not in (torch.float16, torch.bfloat16, torch.float32):
            raise TypeError(f"SpinConfig.state_dtype: expected torch.float16, bfloat16 or float32, "
                            f"got {describe(self.state_dtype)}")

    @property
    def grain(self) -> Grain:
        """The vertical history in force: vertical_grain, with "auto" resolved (SLOT where the rule reads a slot's
        own V: reduce mean / top4, combine sum, the summary mix, A0 pooling; else BLOCK)."""
        if self.vertical_grain is not Grain.AUTO:
            return self.vertical_grain
        return Grain.SLOT if self._reads_slot_history(pooling=True) else Grain.BLOCK

    def _reads_slot_history(self, pooling: bool) -> bool:
        """Whether the rule reads V slot by slot (pooling: A0's top slots too, which block grain would rank by
        their blocks' values: allowed with an explicit "block", not chosen by "auto")."""
        return (self.reduce is not Reduce.MAX or self.combine is Combine.SUM or self.summary > 0
                or (pooling and self.pooling is Pooling.A0))

    def _checked_profile(self) -> tuple[float, ...]:
        profile = check_sequence("SpinConfig.sparsity_profile", self.sparsity_profile,
                                 lambda name, x: check_float(name, x, low=0, high=math.inf, high_open=True))
        if profile and self.adaptive is not None:
            raise ValueError("SpinConfig.sparsity_profile: expected () with adaptive budgets (the controller moves "
                             "each layer's sparsity itself)")
        if profile and self.sparsity * max(profile) >= 1:
            worst = max(range(len(profile)), key=profile.__getitem__)
            raise ValueError(f"SpinConfig.sparsity_profile: expected sparsity x every entry < 1, got "
                             f"{self.sparsity:g} x {profile[worst]:g} (layer {worst})")
        return profile

    def check_profile_layers(self, num_layers: int, source: str = "config") -> None:
        """A ValueError naming `source` (the argument or setting the profile came from) unless the profile, if
        any, has one entry per indexer layer: a profile is calibrated on one model's layers."""
        if self.sparsity_profile and len(self.sparsity_profile) != num_layers:
            raise ValueError(f"{source}: expected a sparsity_profile of num_layers = {num_layers} entries (one per "
                             f"indexer layer, calibrated on this model's traces), got {len(self.sparsity_profile)}")

    def layer_sparsity(self, layer: int, short: bool = False) -> float:
        """The sparsity of `layer`'s budget: sparsity x sparsity_profile[layer], or sparsity without a profile;
        short: for a request shorter than profile_from (sparsity x (1 + short_profile_strength x (profile - 1)),
        exactly `sparsity` at strength 0)."""
        if not self.sparsity_profile:
            return self.sparsity
        if short:
            return self.sparsity * (1.0 + self.short_profile_strength * (self.sparsity_profile[layer] - 1.0))
        return self.sparsity * self.sparsity_profile[layer]

    def _set(self, name: str, value) -> None:
        object.__setattr__(self, name, value)  # frozen: the normalized (checked) value replaces the given one

    @property
    def guard_tokens(self) -> int:
        """The per-request guard's threshold in tokens (dense_below, "auto" resolved to AUTO_DENSE_BELOW)."""
        return AUTO_DENSE_BELOW if self.dense_below == "auto" else self.dense_below

    @property
    def guard_batch_tokens(self) -> int:
        """The per-step guard's threshold in cached tokens (dense_batch_below, "auto" resolved to
        AUTO_DENSE_BATCH_TOKENS)."""
        return AUTO_DENSE_BATCH_TOKENS if self.dense_batch_below == "auto" else self.dense_batch_below

    def guard_batch_tokens_for(self, rows: int) -> int:
        """The per-step guard's threshold for a step of `rows` query rows (B x next_n): guard_batch_tokens,
        raised for one row at low sparsity under "auto" (the first rule of AUTO_ONE_ROW_GUARDS that holds)."""
        if self.dense_batch_below == "auto" and rows == 1:
            for max_sparsity, tokens in AUTO_ONE_ROW_GUARDS:
                if self.sparsity <= max_sparsity:
                    return max(AUTO_DENSE_BATCH_TOKENS, tokens)
        return self.guard_batch_tokens

    def to_dict(self) -> dict:
        """JSON-ready dict (every results file embeds it)."""
        out = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if isinstance(v, enum.Enum):
                v = v.value
            elif isinstance(v, torch.dtype):
                v = str(v).replace("torch.", "")
            elif isinstance(v, AdaptiveConfig):
                v = dataclasses.asdict(v)
            out[f.name] = v
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)


PRESETS: dict[str, SpinConfig] = {
    "paper": SpinConfig(vertical_grain="slot"),  # A1-max, random 5% exploration, alpha 0.5, s = 0.3
    "v32": SpinConfig(topk=2048),
    "v4-c4a": SpinConfig(topk=512),
    "no-explore": SpinConfig(exploration=Exploration.NONE, gamma=0.0),
    "adaptive": SpinConfig(sparsity=0.2, adaptive=AdaptiveConfig()),
    "hybrid": SpinConfig(hybrid=0.3),
    # the guards on: dense where SPIN measured slower (short requests, small steps)
    "serving": SpinConfig(sparsity=0.4, dense_below="auto", dense_batch_below="auto"),
}
