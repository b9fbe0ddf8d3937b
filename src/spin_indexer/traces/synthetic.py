"""Synthetic indexer-score traces: controlled stand-ins for real-model traces (fast tests, stress).

The score of logical position p for query row j of decode step s in layer l is a sum of parts, each one
a pattern the paper's Figure 1 shows or a failure mode it names:

    score = background[l, p] + segment[l, p]      content baseline; segments give block-level locality
          + vertical[l, p]                        persistent important tokens (sinks + verticals)
          + diagonal(q_j - p)                     offset-relative bands: local window, RoPE-like bands
          + noise                                 fresh every step and row (prev-iteration Pearson < 1)

and over the steps:
- background and segment levels drift as an AR(1) process (`drift` = innovation std per step);
- verticals are born (`birth_rate` per step per layer; half among the newest 10% of tokens, half anywhere)
  and die (`death_rate` per vertical per step); the first `sink_tokens` positions never die;
- at each step in `shift_steps` a `shift_fraction` of the background, segments and verticals is redrawn
  (a sudden attention shift: the known failure mode of any history-based predictor);
- layers are chained: layer l's random draws share a fraction `layer_share` of variance with layer
  l - 1, which sets the previous-layer correlation of Table 1.

With next_n > 1 the cache advances by (accepted + 1) tokens per step, `accepted` uniform in [0, N-1];
row j of step s has length L_s - N + j + 1. The dense top-k is computed from the stored float16 scores
(ties to the lower position), so a replay that recomputes it gets the same set.
Deterministic: the same spec and seed give bit-identical traces.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from ..checks import check_int, check_range
from ..layout import TOKENS_PER_BLOCK
from ..ops.topk import topk_ref
from .schema import Trace, TraceMeta


@dataclass(frozen=True)
class SyntheticSpec:
    """Generator parameters (scores are in units of the background's standard deviation)."""
    context_len: int = 8192       # prompt tokens before decode step 0
    num_steps: int = 64           # decode steps
    num_layers: int = 4           # indexer layers
    next_n: int = 1               # query rows per step (1 + draft tokens)
    k: int = 512                  # dense top-k
    tokens_per_block: int = TOKENS_PER_BLOCK
    background: float = 1.0       # std of the per-position content baseline
    segment: float = 1.0          # std of the piecewise-constant segment level
    segment_len: int = 256        # mean segment length in tokens (exponential)
    layer_share: float = 0.3      # variance fraction each layer's draws share with the previous layer
    drift: float = 0.02           # AR(1) innovation std per step of background and segment levels
    noise: float = 0.3            # per-step, per-row iid noise std
    num_verticals: int = 32       # verticals per layer at step 0
    vertical_strength: float = 4.0  # mean added score of a vertical's centre (exponential spread)
    vertical_width: int = 4       # tokens each vertical covers (decaying from its centre)
    vertical_share: float = 0.0   # fraction of the step-0 verticals common to all layers
    sink_tokens: int = 4          # first positions that are always strong (attention sinks)
    sink_strength: float = 6.0
    birth_rate: float = 0.2       # expected new verticals per step per layer
    death_rate: float = 0.005     # probability per step that a vertical dies
    local_window: int = 128       # decay length (tokens) of the local diagonal; 0 disables it
    local_strength: float = 3.0
    band_offsets: tuple[int, ...] = ()  # centres (offset q - p) of extra diagonal bands
    band_strength: float = 2.0
    band_width: int = 16
    shift_steps: tuple[int, ...] = ()   # steps at which the pattern shifts
    shift_fraction: float = 1.0   # fraction of background/segments/verticals redrawn at a shift

    def __post_init__(self) -> None:
        for name in ("context_len", "num_steps", "num_layers", "next_n", "k", "tokens_per_block",
                     "segment_len", "vertical_width"):
            check_int(f"SyntheticSpec.{name}", getattr(self, name), low=1)
        for name in ("num_verticals", "sink_tokens", "local_window", "band_width"):
            check_int(f"SyntheticSpec.{name}", getattr(self, name), low=0)
        for name in ("background", "segment", "noise", "vertical_strength", "sink_strength", "birth_rate",
                     "local_strength", "band_strength", "drift"):
            check_range(f"SyntheticSpec.{name}", getattr(self, name), low=0.0)
        for name in ("layer_share", "death_rate", "shift_fraction", "vertical_share"):
            check_range(f"SyntheticSpec.{name}", getattr(self, name), low=0.0, high=1.0)
        check_range("SyntheticSpec.drift", self.drift, low=0.0, high=1.0)


PRESETS: dict[str, SyntheticSpec] = {
    # DeepSeek-V3.2 in Figure 1: strong vertical lines that persist for the whole decode, a thin local
    # diagonal, little layer-to-layer agreement (Table 1: prev layer 0.29, prev iteration 0.91).
    "v32-like": SyntheticSpec(context_len=16384, k=2048, num_layers=6, num_steps=96, background=1.0,
                              segment=1.2, segment_len=384, layer_share=0.25, drift=0.01, noise=0.45,
                              num_verticals=256, vertical_share=0.5, vertical_strength=4.0, birth_rate=0.05,
                              death_rate=0.001,
                              local_window=64, local_strength=3.0),
    # DeepSeek-V4 Flash: more diagonal structure (local window + RoPE-like bands), verticals that come and
    # go, stronger layer agreement (Table 1: prev layer 0.55, prev iteration 0.88).
    "v4-like": SyntheticSpec(context_len=16384, k=512, num_layers=6, num_steps=96, background=1.0,
                             segment=1.0, segment_len=256, layer_share=0.5, drift=0.03, noise=0.45,
                             num_verticals=64, vertical_share=0.5, vertical_strength=4.0, birth_rate=0.4,
                             death_rate=0.01,
                             local_window=256, local_strength=3.5, band_offsets=(512, 1024, 2048),
                             band_strength=2.0, band_width=24),
    # Adversarial: v4-like with three sudden, complete pattern shifts (at fixed steps 24, 48, 72).
    "shift": SyntheticSpec(context_len=16384, k=512, num_layers=6, num_steps=96, background=1.0,
                           segment=1.0, segment_len=256, layer_share=0.5, drift=0.03, noise=0.45,
                           num_verticals=64, vertical_share=0.5, vertical_strength=4.0, birth_rate=0.8,
                           death_rate=0.02,
                           local_window=256, local_strength=3.5, band_offsets=(512, 1024, 2048),
                           band_strength=2.0, band_width=24, shift_steps=(24, 48, 72), shift_fraction=1.0),
}


def get_spec(preset: str | SyntheticSpec, **overrides) -> SyntheticSpec:
    """A preset by name (or a spec) with fields replaced; unknown names list the known ones."""
    if isinstance(preset, SyntheticSpec):
        spec = preset
    elif preset in PRESETS:
        spec = PRESETS[preset]
    else:
        raise ValueError(f"preset: expected one of {', '.join(sorted(PRESETS))}, got {preset!r}")
    return dataclasses.replace(spec, **overrides) if overrides else spec


class _Chain:
    """Random draws chained across layers: layer l = sqrt(share) * layer parent(l) + sqrt(1 - share) * fresh.

    parent(l) is fixed per trace: l - 1 with probability 0.4, else one of l - 2 .. l - 5, so (as in the
    paper's Table 1) the best of the five previous layers predicts better than the previous one alone.
    """

    def __init__(self, gen: torch.Generator, layers: int, share: float):
        self.gen, self.layers, self.a, self.b = gen, layers, math.sqrt(share), math.sqrt(1.0 - share)
        self.parents = [0]
        for l in range(1, layers):
            back = 1 if float(torch.rand(1, generator=gen)) < 0.4 else int(torch.randint(2, 6, (1,), generator=gen))
            self.parents.append(max(0, l - back))

    def normal(self, *shape: int) -> torch.Tensor:
        fresh = torch.randn(self.layers, *shape, generator=self.gen)
        out = fresh.clone()
        for l in range(1, self.layers):
            out[l] = self.a * out[self.parents[l]] + self.b * fresh[l]
        return out


def _lengths(spec: SyntheticSpec, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
    """seq_lens int32 [S, N] and accepted int32 [S] (None when next_n = 1)."""
    n = spec.next_n
    if n == 1:
        total = spec.context_len + 1 + torch.arange(spec.num_steps)  # the prompt plus this step's token
        return total.to(torch.int32)[:, None], None
    accepted = torch.randint(0, n, (spec.num_steps,), generator=gen, dtype=torch.int32)
    advance = torch.cat([torch.zeros(1, dtype=torch.long), (accepted[:-1].long() + 1).cumsum(0)])
    total = spec.context_len + n + advance  # L_s: prompt + accepted history + this step's N tokens
    rows = total[:, None] - n + torch.arange(n)[None, :] + 1
    return rows.to(torch.int32), accepted


def _segments(spec: SyntheticSpec, max_len: int, gen: torch.Generator) -> torch.Tensor:
    """Segment id of each position, long [max_len]: boundaries with exponential gaps of mean segment_len."""
    gaps = torch.empty(max_len // max(1, spec.segment_len // 4) + 2).exponential_(1.0 / spec.segment_len,
                                                                                 generator=gen)
    edges = torch.cumsum(gaps.clamp(min=1.0), 0).long()
    return torch.bucketize(torch.arange(max_len), edges, right=True)


def _vertical_profile(spec: SyntheticSpec) -> torch.Tensor:
    """Score added around a vertical's centre, float [vertical_width]: 1, 1/2, 1/4, ..."""
    return 0.5 ** torch.arange(spec.vertical_width, dtype=torch.float32)


def _vertical_map(pos: list[torch.Tensor], amp: list[torch.Tensor], profile: torch.Tensor,
                  max_len: int) -> torch.Tensor:
    """float [L, max_len]: each layer's verticals stamped with `profile` (max where they overlap)."""
    out = torch.zeros(len(pos), max_len)
    for l, (p, a) in enumerate(zip(pos, amp)):
        if p.numel() == 0:
            continue
        cols = (p[:, None] + torch.arange(profile.numel())[None, :]).clamp(max=max_len - 1)  # [V, width]
        out[l].scatter_reduce_(0, cols.reshape(-1), (a[:, None] * profile[None, :]).reshape(-1), "amax")
    return out


def _diagonal(spec: SyntheticSpec, offsets: torch.Tensor) -> torch.Tensor:
    """Offset-relative score, float like `offsets` (q - p, >= 0 where valid)."""
    o = offsets.float().clamp(min=0)
    out = torch.zeros_like(o)
    if spec.local_window > 0:
        out += spec.local_strength * torch.exp(-o / spec.local_window)
    for centre in spec.band_offsets:
        out += spec.band_strength * torch.exp(-((o - centre) / max(1, spec.band_width)) ** 2)
    return out


def generate(preset: str | SyntheticSpec = "v4-like", seed: int = 0, prompt_id: str | None = None,
             **overrides) -> Trace:
    """One synthetic trace (float16 scores [S, L, N, C], dense top-k included).

    preset: a name in PRESETS or a SyntheticSpec; overrides replace spec fields (e.g. context_len=4096).
    The same arguments always give the same trace.
    """
    spec = get_spec(preset, **overrides)
    gen = torch.Generator().manual_seed(int(seed))
    seq_lens, accepted = _lengths(spec, gen)
    max_len = int(seq_lens.max())
    L, S, N = spec.num_layers, spec.num_steps, spec.next_n
    chain = _Chain(gen, L, spec.layer_share)
    seg_id = _segments(spec, max_len, gen)
    num_segments = int(seg_id.max()) + 1
    background = chain.normal(max_len)  # [L, C], unit variance
    seg_level = chain.normal(num_segments)  # [L, num_segments]
    profile = _vertical_profile(spec)
    recent_from = int(0.9 * spec.context_len)

    def draw_verticals(count: int, newest: int) -> tuple[torch.Tensor, torch.Tensor]:
        anywhere = torch.randint(spec.sink_tokens, max(spec.sink_tokens + 1, newest), (count,), generator=gen)
        recent = torch.randint(min(recent_from, newest - 1), newest, (count,), generator=gen)
        pos = torch.where(torch.rand(count, generator=gen) < 0.5, anywhere, recent)
        amp = spec.vertical_strength * torch.empty(count).exponential_(1.0, generator=gen).clamp(0.25, 3.0)
        return pos, amp

    shared = int(round(spec.vertical_share * spec.num_verticals))
    common_p, common_a = draw_verticals(shared, spec.context_len)
    pos, amp = [], []
    for _ in range(L):
        p, a = draw_verticals(spec.num_verticals - shared, spec.context_len)
        pos.append(torch.cat([common_p, p]))
        amp.append(torch.cat([common_a, a]))
    sinks = torch.zeros(max_len)
    sinks[: spec.sink_tokens] = spec.sink_strength
    decay = math.sqrt(1.0 - spec.drift ** 2)
    scores = torch.empty(S, L, N, max_len, dtype=torch.float16)
    topk = torch.empty(S, L, N, spec.k, dtype=torch.int32)
    cols = torch.arange(max_len)
    diag_table = _diagonal(spec, cols)  # score by offset q - p, [C]
    shift_steps = set(spec.shift_steps)
    for s in range(S):
        newest = int(seq_lens[s, 0])
        if s in shift_steps:
            redraw = torch.rand(L, max_len, generator=gen) < spec.shift_fraction
            background = torch.where(redraw, chain.normal(max_len), background)
            seg_redraw = torch.rand(L, num_segments, generator=gen) < spec.shift_fraction
            seg_level = torch.where(seg_redraw, chain.normal(num_segments), seg_level)
        for l in range(L):
            keep = torch.rand(pos[l].numel(), generator=gen) >= spec.death_rate
            if s in shift_steps:
                keep &= torch.rand(pos[l].numel(), generator=gen) >= spec.shift_fraction
                births = int(round(spec.num_verticals * spec.shift_fraction))
            else:
                births = int(torch.poisson(torch.tensor(spec.birth_rate), generator=gen))
            new_p, new_a = draw_verticals(births, newest)
            pos[l] = torch.cat([pos[l][keep], new_p])
            amp[l] = torch.cat([amp[l][keep], new_a])
        if s > 0 and spec.drift > 0:
            background = decay * background + spec.drift * chain.normal(max_len)
            seg_level = decay * seg_level + spec.drift * chain.normal(num_segments)
        base = (spec.background * background + spec.segment * seg_level[:, seg_id]
                + torch.maximum(_vertical_map(pos, amp, profile, max_len), sinks[None, :]))  # [L, C]
        query = seq_lens[s].long() - 1  # [N] position of each row's own query token
        diag = diag_table[(query[:, None] - cols[None, :]).clamp(min=0)]  # [N, C]
        noise = spec.noise * torch.randn(L, N, max_len, generator=gen)
        step = base[:, None, :] + diag[None, :, :] + noise  # [L, N, C]
        past = cols[None, :] >= seq_lens[s].long()[:, None]  # [N, C]
        step = step.masked_fill(past[None], float("-inf")).half()
        scores[s] = step
        rows = step.float().reshape(L * N, max_len)
        lens = seq_lens[s].repeat(L)  # row (l, j) -> seq_lens[s, j]
        topk[s] = topk_ref(rows.float(), lens.to(torch.int32), spec.k, validate=False).view(L, N, spec.k)
    meta = TraceMeta(model=f"synthetic-{preset if isinstance(preset, str) else 'custom'}", indexer="synthetic",
                     prompt_id=prompt_id or f"synthetic-{seed}", task="synthetic",
                     context_len=spec.context_len, k=spec.k, next_n=N, tokens_per_block=spec.tokens_per_block,
                     extra={"seed": int(seed), "spec": dataclasses.asdict(spec)})
    return Trace(scores, seq_lens, meta, topk, accepted)


def generate_set(preset: str | SyntheticSpec, num_prompts: int, seed: int = 0, **overrides) -> list[Trace]:
    """`num_prompts` traces of one preset, seeds seed, seed+1, ..."""
    name = preset if isinstance(preset, str) else "custom"
    return [generate(preset, seed=seed + i, prompt_id=f"{name}-{seed + i}", **overrides) for i in range(num_prompts)]
