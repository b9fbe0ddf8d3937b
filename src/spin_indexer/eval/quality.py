"""Task quality of the proxy model (SmolLM2) under DSA-style sparse decoding: dense vs all-keep vs SPIN.

For each (task, context, sample) one RULER prompt is prefilled densely once; every configuration then
greedily decodes from a copy of that cache:
    dense               full attention (no indexer)
    all-keep            each layer attends to the top-k of the full indexer (every block scored)
    spin-<s>            SpinIndexer at target block sparsity s, 5% random exploration (paper default)
    spin-<s>-noexp      the same without exploration
    spin-<s>-hybrid<w>  SPIN with the hybrid predictor (SpinConfig.hybrid = w, previous layer's same-step scores)
    spin-<s>-sum<w>     SPIN with the summary mix (SpinConfig.summary = w: this step's query against each block's
                        sub-block mean keys, docs/current_step_selection.md); -sum<w>x<S>: S sub-blocks a block
                        (SpinConfig.summary_parts, default 4); -sum<w>[x<S>]b<K>k: only requests shorter than K x
                        1024 tokens mix (SpinConfig.summary_below); -sum<w>...-quiet: the requests that mix do
                        not explore (SpinConfig.summary_explores = False; the others do); lightning mode only
    <policy>@<s>        SPIN with a named policy of predictor/policies.py at sparsity s (its SpinConfig as
                        get_policy builds it), e.g. spin-layers-mix@0.3: the shipped head's chosen default;
                        mtp<N>-<policy>@<s>: the same with N rows a step
    adaptive-<t>        SPIN with adaptive per-(layer, request) budgets, per-audit (p99) miss target t, starting
                        at PRESETS["adaptive"]'s sparsity and menu (predictor/adaptive.py); sparsity = realized
    mtp<N>-all-keep     next_n = N rows per step; drafts = the all-keep greedy continuation of the sample
    mtp<N>-spin-<s>     the same drafts verified with SPIN (row-0 sharing + row-0 update); mtp<N>- also
                        prefixes spin-<s>-hybrid<w> and adaptive-<t>
The indexer is the distilled lightning indexer when its weights ship in spin_indexer/weights/, else the
oracle (the layer's own attention logits, max over heads): `indexer_mode()` says which.

Scoring is RULER's string match: per sample, the fraction of expected strings found in the output
(`ruler.score_answer`); a cell's score is the mean x 100 with a 95% Wilson interval over its samples.
Miss (REFERENCE.md sec. 3): per decode row and layer, the fraction of the dense top-k of the same step
(same scores: the run's own trajectory) that falls in blocks the SPIN plan skipped; mean and nearest-rank
p99 over rows with context > k. Generation stops at EOS, at the token budget, or as soon as every
expected string is in the output (the score cannot change after that: string match only adds hits).
"""
from __future__ import annotations

import dataclasses
import math
import re
from typing import Callable

import torch

from .. import ops
from ..checks import check_int, check_range
from ..eval.metrics import miss_per_row, nearest_rank

_SPARSITIES = (0.2, 0.3, 0.4, 0.5)
DEFAULT_CONFIGS = (("dense", "all-keep") + tuple(f"spin-{s}" for s in _SPARSITIES)
                   + tuple(f"spin-{s}-noexp" for s in _SPARSITIES) + ("mtp3-all-keep", "mtp3-spin-0.4"))
DEFAULT_TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "vt")
_NUM = r"0?\.\d+|0|1(?:\.0*)?"  # range-checked after parsing
_MTP = re.compile(r"mtp(?P<n>[2-8])-")  # the MTP prefix of every name form: N rows a step
_NAME = re.compile(rf"^(?:{_MTP.pattern})?(?:(?P<dense>dense)|(?P<allkeep>all-keep)|"
                   rf"spin-(?P<s>{_NUM})(?:-hybrid(?P<w>{_NUM}))?"
                   rf"(?:-sum(?P<sw>{_NUM})(?:x(?P<sp>\d+))?(?:b(?P<sb>\d+)k)?(?P<quiet>-quiet)?)?"
                   rf"(?P<noexp>-noexp)?(?P<block>-block)?"
                   rf"(?P<prof>-profile)?|"
                   rf"adaptive-(?P<t>{_NUM}))$")
_FORMS = ("dense, all-keep, spin-<s>, spin-<s>-noexp, spin-<s>-hybrid<w>[-noexp], "
          "spin-<s>[-hybrid<w>]-sum<w>[x<S>][b<K>k][-quiet][-noexp], spin-<s>[-hybrid<w>][-noexp]-block (block grain), "
          "spin-<s>[...]-profile (with --sparsity-profile), [mtp<N>-]<policy>@<s> (a name of predictor/policies.py), "
          "adaptive-<t>, mtp<N>-all-keep, "
          "mtp<N>-spin-<s>[...], mtp<N>-adaptive-<t> (0 <= s < 1, 0 <= w <= 1, 0 <= t <= 1, 2 <= N <= 8)")
CSV_COLUMNS = ("task", "context", "config", "samples", "score", "mean_miss", "p99_miss")


@dataclasses.dataclass(frozen=True)
class QualityConfig:
    """One evaluated configuration, parsed from its name (see the module docstring)."""

    name: str
    kind: str  # "dense" | "all-keep" | "spin" (hybrid and adaptive are spin kinds)
    sparsity: float = 0.0  # the starting sparsity when adaptive
    exploration: bool = True
    next_n: int = 1
    hybrid: float = 0.0  # SpinConfig.hybrid
    summary: float = 0.0  # SpinConfig.summary
    summary_parts: int = 4  # SpinConfig.summary_parts
    summary_below: int = 0  # SpinConfig.summary_below (tokens)
    summary_explores: bool = True  # SpinConfig.summary_explores (False: the name has -quiet)
    adaptive: float | None = None  # AdaptiveConfig.target_miss; None = fixed budget
    profiled: bool = False  # the name ends in -profile: SpinConfig.sparsity_profile from the run's profile file
    sparsity_profile: tuple[float, ...] = ()  # SpinConfig.sparsity_profile (the runner sets it on -profile names)
    profile_from: int = 0  # SpinConfig.profile_from (likewise)
    short_profile_strength: float = 0.0  # SpinConfig.short_profile_strength (likewise)
    block: bool = False  # the name has -block: SpinConfig.vertical_grain = "block"
    policy: str = ""  # <policy>@<s>: the SpinConfig is predictor.policies.get_policy(policy, sparsity, ...)

    def spin_config(self, topk: int, seed: int):
        """The SpinConfig of a spin kind: 5% random exploration (or none), hybrid weight, adaptive budgets."""
        from ..predictor import SpinConfig
        from ..predictor.config import PRESETS

        if self.policy:
            from ..predictor.policies import get_policy

            return get_policy(self.policy, self.sparsity, topk, seed)  # dense_below = 0 there too
        adaptive = None
        if self.adaptive is not None:
            adaptive = dataclasses.replace(PRESETS["adaptive"].adaptive, target_miss=self.adaptive)
        return SpinConfig(sparsity=self.sparsity, topk=topk, exploration="random" if self.exploration else "none",
                          gamma=0.05 if self.exploration else 0.0, seed=seed, hybrid=self.hybrid,
                          summary=self.summary, summary_parts=self.summary_parts,
                          summary_below=self.summary_below, summary_explores=self.summary_explores,
                          adaptive=adaptive,
                          sparsity_profile=self.sparsity_profile, profile_from=self.profile_from,
                          short_profile_strength=self.short_profile_strength,
                          vertical_grain="block" if self.block else "slot",
                          dense_below=0)  # quality measures the predictor: the speed guard is off


def parse_config(name: str) -> QualityConfig:
    """'spin-0.4-noexp' -> QualityConfig(kind='spin', sparsity=0.4, exploration=False); 'adaptive-0.1' ->
    kind 'spin', adaptive=0.1, sparsity = PRESETS['adaptive'].sparsity; unknown names raise ValueError
    listing the accepted forms."""
    if isinstance(name, str) and "@" in name:
        return _parse_policy_config(name)
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None or (m["dense"] and m["n"]):
        raise ValueError(f"config: expected one of {_FORMS}, got {name!r}")
    n = int(m["n"] or 1)
    if m["dense"]:
        return QualityConfig(name, "dense")
    if m["allkeep"]:
        return QualityConfig(name, "all-keep", next_n=n)
    if m["t"] is not None:
        from ..predictor.config import PRESETS

        t = float(m["t"])
        check_range(f"config {name!r}: miss target", t, low=0.0, high=1.0)
        return QualityConfig(name, "spin", PRESETS["adaptive"].sparsity, True, n, adaptive=t)
    s = float(m["s"])
    check_range(f"config {name!r}: sparsity", s, low=0.0, high=1.0, high_open=True)
    w = 0.0 if m["w"] is None else float(m["w"])
    check_range(f"config {name!r}: hybrid weight", w, low=0.0, high=1.0)
    sw = 0.0 if m["sw"] is None else float(m["sw"])
    check_range(f"config {name!r}: summary weight", sw, low=0.0, high=1.0)
    parts = 4 if m["sp"] is None else int(m["sp"])
    if not 1 <= parts <= 64 or 64 % parts:
        raise ValueError(f"config {name!r}: summary sub-blocks: expected a divisor of the 64 tokens a block, got "
                         f"{parts}")
    below = 0 if m["sb"] is None else int(m["sb"]) * 1024
    if m["block"] and sw > 0:
        raise ValueError(f"config {name!r}: -block (block grain) keeps no per-slot history, which the summary mix "
                         f"reads: expected no -sum<w> with it")
    return QualityConfig(name, "spin", s, m["noexp"] is None, n, hybrid=w, summary=sw, summary_parts=parts,
                         summary_below=below, summary_explores=m["quiet"] is None, profiled=m["prof"] is not None,
                         block=m["block"] is not None)


def _parse_policy_config(name: str) -> QualityConfig:
    """'spin-layers-mix@0.3' -> a spin QualityConfig whose SpinConfig is that policy's at sparsity 0.3 (ValueError
    naming the policy, or the sparsity where the policy has no calibrated budgets there); 'mtp3-spin-layers-mix@0.3':
    the same at next_n = 3."""
    from ..predictor.policies import get_policy, policy_names

    m = _MTP.match(name)
    policy, _, sparsity = name[m.end() if m else 0:].rpartition("@")
    if policy not in policy_names():
        raise ValueError(f"config {name!r}: policy: expected one of {', '.join(policy_names())}, got {policy!r}")
    if not re.fullmatch(_NUM, sparsity):
        raise ValueError(f"config {name!r}: expected <policy>@<s> with a sparsity 0 <= s < 1, got {sparsity!r}")
    s = float(sparsity)
    check_range(f"config {name!r}: sparsity", s, low=0.0, high=1.0, high_open=True)
    spin = get_policy(policy, s)  # raises for a layered policy at a sparsity it was not calibrated at
    return QualityConfig(name, "spin", s, spin.gamma > 0, int(m["n"]) if m else 1, summary=spin.summary,
                         policy=policy)


def wilson_interval(p: float, n: int, z: float = 1.959964) -> tuple[float, float]:
    """95% Wilson score interval of a proportion p observed over n samples; (nan, nan) when n = 0.

    Fractional per-sample scores (multi-value tasks) are treated as a proportion over n samples."""
    check_int("n", n, low=0)
    check_range("p", p, low=0.0, high=1.0)
    if n == 0:
        return float("nan"), float("nan")
    z2 = z * z
    denom = 1.0 + z2 / n
    center = (p + z2 / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / denom
    # exact at the ends (p = 0 -> low 0, p = 1 -> high 1); rounding would otherwise leave p outside
    return (0.0 if p == 0 else max(0.0, center - half)), (1.0 if p == 1 else min(1.0, center + half))


class MissRecorder:
    """Wraps a SpinIndexer: after each layer's run, compares its block plan with the dense top-k of the same
    step (from the same scores) and keeps the per-row miss, realized sparsity and the (step, layer) grid."""

    def __init__(self, inner, k: int, record_blocks: bool = False):
        self.inner, self.k, self.record_blocks = inner, k, record_blocks
        # (step, layer) -> (keep bool [W], dense top-k tokens per block int [W]) when record_blocks
        self.blocks: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.state = inner.state
        self.rows: list[torch.Tensor] = []  # per (step, layer): miss float32 [eligible rows]
        self.sparsity: list[torch.Tensor] = []
        self.grid: dict[tuple[int, int], float] = {}  # (step, layer) -> mean miss of the eligible rows
        self.step = -1

    def plan(self, block_table, seq_lens, slot_ids, num_accepted=None, validate=True):
        self._table, self._lens = block_table, seq_lens
        self.step += 1
        self.inner.plan(block_table, seq_lens, slot_ids, num_accepted=num_accepted, validate=validate)

    def run_from_scores(self, layer, scores):
        topk = self.inner.run_from_scores(layer, scores)
        self._record(layer, ops.topk(scores, self._lens.reshape(-1), self.k, validate=False))
        return topk

    def run(self, layer, q_fp8, kv_cache, weights):
        topk = self.inner.run(layer, q_fp8, kv_cache, weights)
        logits = ops.paged_indexer_logits(q_fp8, kv_cache, weights, self._lens, self._table, validate=False)
        self._record(layer, ops.topk(logits, self._lens.reshape(-1), self.k, validate=False))
        return topk

    def _record(self, layer: int, dense_topk: torch.Tensor) -> None:
        plan = self.inner.block_plan
        miss = miss_per_row(plan.keep_mask, dense_topk, self.inner.next_n, plan.tokens_per_block)
        eligible = self._lens.reshape(-1) > self.k
        if bool(eligible.any()):  # evaluation only: host syncs are fine here
            vals = miss[eligible].cpu()
            self.rows.append(vals)
            self.sparsity.append(plan.sparsity().cpu())
            self.grid[(self.step, layer)] = float(vals.mean())
            if self.record_blocks:  # request 0, row 0
                width = plan.keep_mask.shape[1]
                pos = dense_topk[0].long()
                hits = torch.bincount(pos[pos >= 0] // plan.tokens_per_block, minlength=width)[:width]
                self.blocks[(self.step, layer)] = (plan.keep_mask[0].cpu(), hits.cpu())

    def summary(self) -> dict:
        miss = torch.cat(self.rows) if self.rows else torch.zeros(0)
        spars = torch.cat(self.sparsity) if self.sparsity else torch.zeros(0)
        return miss_summary(miss, spars)


def check_configs_for_mode(configs, mode: str) -> None:
    """The summary mix scores the lightning indexer's keys: ValueError naming a -sum config in oracle mode."""
    for cfg in configs:
        if cfg.summary > 0 and mode != "lightning":
            raise ValueError(f"configs: {cfg.name!r} mixes in block summaries of the lightning indexer's keys: "
                             f"expected mode 'lightning', got {mode!r}")


def index_head_dim(caches) -> int:
    """D of the lightning indexer's key cache (the summary cache's row), HEAD_DIM when there is none."""
    from ..layout import HEAD_DIM, SCALE_BYTES

    return caches.index_kv[0].shape[3] - SCALE_BYTES if caches.index_kv else HEAD_DIM


def miss_summary(miss: torch.Tensor, sparsity: torch.Tensor) -> dict:
    """{mean_miss, p99_miss (nearest rank), miss_rows, sparsity (mean)} of float miss values [n] and realized
    sparsities [m] (NaN where empty)."""
    return {"mean_miss": float(miss.double().mean()) if miss.numel() else float("nan"),
            "p99_miss": nearest_rank(miss, 0.99), "miss_rows": miss.numel(),
            "sparsity": float(sparsity.double().mean()) if sparsity.numel() else float("nan")}


@dataclasses.dataclass
class Prompt:
    task: str
    context: int
    seed: int
    ids: torch.Tensor  # int64 [S]
    answers: list[str]
    max_new: int  # token budget of the answer


class QualityRunner:
    """Runs every configuration on one prompt. model: a model/llama.Llama; decode_text(ids list) -> str;
    mode: 'oracle' or 'lightning' (then `indexer` is the model/indexer_head.Indexer); k: top-k per layer."""

    def __init__(self, model, decode_text: Callable[[list[int]], str], mode: str = "oracle", indexer=None,
                 k: int = 256, eos_id: int | None = None, seed: int = 0, stop_when_scored: bool = True,
                 record_blocks: bool = False):
        if mode not in ("oracle", "lightning"):
            raise ValueError(f"mode: expected oracle or lightning, got {mode!r}")
        if mode == "lightning" and indexer is None:
            raise ValueError("indexer: mode 'lightning' needs the distilled Indexer")
        check_int("k", k, low=1)
        self.model, self.decode_text, self.mode, self.indexer = model, decode_text, mode, indexer
        self.k, self.eos_id, self.seed = k, eos_id, seed
        self.stop_when_scored, self.record_blocks = stop_when_scored, record_blocks
        self.on_step: Callable[[str], None] | None = None  # called after every decode step with the config name

    def run(self, prompt: Prompt, configs: list[QualityConfig], score: Callable[[str, list[str]], float],
            on_config: Callable[[str], None] | None = None) -> list[dict]:
        """One result dict per config: name, text, score (0..1), steps, tokens, miss/sparsity, acceptance."""
        from ..model.decode import Caches, prefill

        check_configs_for_mode(configs, self.mode)
        n_max = max(c.next_n for c in configs)
        capacity = prompt.ids.shape[0] + prompt.max_new + n_max
        idx = self.indexer if self.mode == "lightning" else None
        base = Caches.allocate(self.model, 1, capacity, idx)
        first_logits = prefill(self.model, base, 0, prompt.ids, idx)
        out, reference = [], None
        # all-keep first: its greedy continuation is the MTP draft
        order = sorted(configs, key=lambda c: (c.next_n > 1, c.kind != "all-keep"))
        for cfg in order:
            caches = _copy_caches(base)
            selector = self._selector(cfg, caches) if cfg.kind == "spin" else None
            mode = "dense" if cfg.kind == "dense" else self.mode
            self._name = cfg.name
            if cfg.next_n == 1:
                ids, steps, acc = self._greedy(caches, first_logits, mode, selector, prompt, score)
            else:
                ref = reference if reference is not None else []
                ids, steps, acc = self._speculative(caches, first_logits, mode, selector, prompt, score, ref,
                                                    cfg.next_n)
            row = self._row(cfg, ids, prompt, score, steps, acc)
            if isinstance(selector, MissRecorder):
                row.update(selector.summary())
                row["grid"], row["blocks"] = selector.grid, selector.blocks
                row["miss_values"] = torch.cat(selector.rows) if selector.rows else torch.zeros(0)
            if cfg.kind == "all-keep" and cfg.next_n == 1:
                reference = ids
            out.append(row)
            if on_config is not None:
                on_config(cfg.name)
        by_name = {r["config"]: r for r in out}
        return [by_name[c.name] for c in configs]

    def _row(self, cfg: QualityConfig, ids: list[int], prompt: Prompt, score, steps: int, acc: float) -> dict:
        """The result dict of one (prompt, config) before the miss fields of a SPIN run are filled in."""
        text = self.decode_text(ids)
        base = 0.0 if cfg.kind == "all-keep" else float("nan")  # all-keep misses nothing; dense has no plan
        return {"config": cfg.name, "text": text, "score": score(text, prompt.answers), "steps": steps,
                "tokens": len(ids), "acceptance": acc, "mean_miss": base, "p99_miss": base, "miss_rows": 0,
                "sparsity": base, "grid": {}}

    def _selector(self, cfg: QualityConfig, caches) -> MissRecorder:
        from ..indexer import SpinIndexer

        spin = SpinIndexer(cfg.spin_config(self.k, self.seed), num_layers=self.model.cfg.num_layers, max_batch=1,
                           max_blocks=caches.block_table.shape[1], next_n=cfg.next_n,
                           device=caches.block_table.device, topk_sorted=True,  # all-keep's ops.topk order
                           head_dim=index_head_dim(caches))
        caches.slot_ids[0] = spin.state.allocate()
        return MissRecorder(spin, self.k, self.record_blocks)

    def _done(self, ids: list[int], prompt: Prompt, score) -> bool:
        if self.eos_id is not None and self.eos_id in ids:
            return True
        if len(ids) >= prompt.max_new:
            return True
        return self.stop_when_scored and score(self.decode_text(ids), prompt.answers) >= 1.0

    def _greedy(self, caches, logits, mode, selector, prompt, score):
        from ..model.decode import decode_one_step

        ids, steps = [], 0
        while True:
            nxt = int(logits.argmax(-1))
            ids.append(nxt)
            if self._done(ids, prompt, score):
                return self._trim(ids, prompt), steps, 1.0
            tok = torch.tensor([[nxt]], dtype=torch.int64, device=logits.device)
            logits = decode_one_step(self.model, caches, tok, mode, self.k, self.indexer, selector)[0, -1]
            steps += 1
            if self.on_step is not None:
                self.on_step(self._name)

    def _speculative(self, caches, logits, mode, selector, prompt, score, reference, n):
        """Self-speculative decoding: row 0 holds the last emitted token, rows 1..n-1 the draft taken from the
        reference continuation at the same output positions; drafts are accepted while they equal the
        verifier's greedy token. The output equals the verifier's own greedy decoding. returns (ids, steps,
        mean tokens emitted per step = acceptance length)."""
        from ..model.decode import verify_step

        ids = [int(logits.argmax(-1))]
        emitted = []
        while not self._done(ids, prompt, score):
            p = len(ids)
            draft = [reference[i] if i < len(reference) else ids[-1] for i in range(p, p + n - 1)]
            tok = torch.tensor([[ids[-1]] + draft], dtype=torch.int64, device=logits.device)
            greedy, accepted = verify_step(self.model, caches, tok, mode, self.k, self.indexer, selector)
            acc = int(accepted)
            ids += draft[:acc] + [int(greedy[acc])]
            emitted.append(acc + 1)
            if self.on_step is not None:
                self.on_step(self._name)
        return self._trim(ids, prompt), len(emitted), (sum(emitted) / len(emitted) if emitted else float("nan"))

    def _trim(self, ids, prompt):
        if self.eos_id is not None and self.eos_id in ids:
            ids = ids[:ids.index(self.eos_id)]
        return ids[:prompt.max_new]


def _copy_caches(base):
    return dataclasses.replace(base, k=[t.clone() for t in base.k], v=[t.clone() for t in base.v],
                               index_kv=None if base.index_kv is None else [t.clone() for t in base.index_kv],
                               lengths=base.lengths.clone(), slot_ids=base.slot_ids.clone())


def summarize(samples: list[dict]) -> list[dict]:
    """Per (task, context, config) cell: samples, score (x100), 95% Wilson CI (x100), mean/p99 miss over all
    eligible rows of the cell, realized sparsity, acceptance length. samples: run() rows plus task/context."""
    cells: dict[tuple, list[dict]] = {}
    for s in samples:
        cells.setdefault((s["task"], s["context"], s["config"]), []).append(s)
    rows = []
    for (task, context, config), group in cells.items():
        n = len(group)
        p = sum(g["score"] for g in group) / n
        lo, hi = wilson_interval(p, n)
        miss = torch.cat([g["miss_values"] for g in group if g.get("miss_values") is not None] or [torch.zeros(0)])
        kind = parse_config(config).kind
        if miss.numel():
            mean_miss, p99 = float(miss.double().mean()), nearest_rank(miss, 0.99)
        else:
            mean_miss = p99 = 0.0 if kind == "all-keep" else float("nan")
        spars = [g["sparsity"] for g in group if not math.isnan(g["sparsity"])]
        accs = [g["acceptance"] for g in group if not math.isnan(g["acceptance"])]
        rows.append({"task": task, "context": context, "config": config, "samples": n, "score": 100 * p,
                     "ci_low": 100 * lo, "ci_high": 100 * hi, "mean_miss": mean_miss, "p99_miss": p99,
                     "sparsity": sum(spars) / len(spars) if spars else float("nan"),
                     "acceptance": sum(accs) / len(accs) if accs and parse_config(config).next_n > 1 else float("nan"),
                     "steps": sum(g["steps"] for g in group)})
    return rows
