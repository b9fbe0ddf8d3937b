"""Named sweeps: (policies x target sparsities) replayed over trace sets -> result rows.

A row is one (trace set, indexer, context bin, target sparsity, policy) with mean/p99 miss over the
eligible rows and the realized block sparsity; the columns of results/fidelity/summary.csv come first:

    trace_set, indexer, context, sparsity_target, policy, mean_miss, p99_miss, realized_sparsity,
    rows, prompts, steps, layers, k, next_n, seconds, config

`context` is the power-of-two bin of the prompt length ("4K", "8K", ...) or "all". Policies with the same
SpinConfig (spin-default, a1-max, explore-random, mtp-row0) are replayed once and reported under each name.
"""
from __future__ import annotations

import dataclasses
import json
from typing import Callable

import torch

from ..checks import check_int
from ..traces.replay import ReplayResult, replay
from ..traces.schema import Trace, context_bin
from .metrics import nearest_rank, table1_rows
from ..predictor.policies import describe, get_policy, profile_at

SPARSITIES = (0.2, 0.3, 0.4, 0.5)
SUMMARY_COLUMNS = ("trace_set", "indexer", "context", "sparsity_target", "policy", "mean_miss", "p99_miss",
                   "realized_sparsity")
TABLE1_COLUMNS = ("trace_set", "indexer", "predictor", "pearson", "topk_recall")

SWEEPS: dict[str, tuple[tuple[str, ...], tuple[float, ...], str]] = {
    "smoke": (("spin-default",), (0.3,), "the default policy at 30%"),
    "main": (("spin-default",), SPARSITIES, "paper Tables 3/5: the default at 20-50%"),
    "pooling": (("a0", "a1-max", "a2-max", "a1-mean", "a1-top4", "a1-max-sum", "a2-max-sum"), SPARSITIES,
                "paper Fig. 3"),
    "exploration": (("explore-none", "explore-random", "explore-staleness", "explore-block-age",
                     "explore-random-10"), SPARSITIES, "paper Fig. 4"),
    "mtp": (("mtp-row0", "mtp-row-local"), SPARSITIES, "paper Fig. 2 / Table 7 (needs next_n > 1 traces)"),
    "history": (("spin-default", "combine-vertical", "combine-diagonal", "combine-sum", "alpha-0.25",
                 "alpha-1.0"), SPARSITIES, "vertical vs diagonal table, EMA decay"),
    "summary": (("spin-default", "explore-none", "summary4-0.5", "summary8-0.7", "summary16-0.8",
                 "summary16-0.8-noexp"), SPARSITIES,
                "history mixed with this step's query against sub-block mean keys (traces with block summaries)"),
    "summary-coarse": (("spin-default", "summary1-0.5", "summary1-0.7", "summary1-0.5-noexp", "summary1-0.7-noexp",
                        "summary2-0.5", "summary4-0.5"), SPARSITIES,
                       "the mix with one or two mean keys a block (traces captured with --summary-parts 1 2 4)"),
}
SWEEPS["layers"] = (("spin-default", "spin-layers", "spin-layers-mix"), SPARSITIES,
                    "the shipped head's per-layer budgets against uniform ones (proxy traces of 30 layers; "
                    "spin-layers-mix replays the lightning traces with summaries at S = 16)")
SWEEPS["all"] = (tuple(dict.fromkeys(p for name in ("main", "pooling", "exploration", "mtp", "history")
                                     for p in SWEEPS[name][0])), SPARSITIES, "every sweep above but summary")


def get_sweep(name: str, sparsities: tuple[float, ...] | None = None,
              policies: tuple[str, ...] | None = None) -> list[tuple[str, float]]:
    """(policy, sparsity) pairs of sweep `name`, optionally with other sparsities or a policy subset."""
    if name not in SWEEPS:
        raise ValueError(f"sweep: expected one of {', '.join(SWEEPS)}, got {name!r}")
    pols, sps, _ = SWEEPS[name]
    if policies:
        for p in policies:
            describe(p)  # unknown names raise with the list of known ones
        pols = tuple(policies)
    return [(p, s) for p in pols for s in (sparsities or sps)]


def summarize(result: ReplayResult, names: list[str]) -> dict:
    """Mean/p99 miss over the eligible rows of `names`, and the realized sparsity over eligible requests."""
    miss, sp = [], []
    for n in names:
        elig = result.eligible[n]  # [S, N]
        m = result.miss[n]  # [S, L, N]
        miss.append(m[elig[:, None, :].expand_as(m)])
        req = elig[:, -1]  # the longest row decides whether the request is sparse at all
        sp.append(result.sparsity[n][req])
    miss_all = torch.cat(miss) if miss else torch.zeros(0)
    sp_all = torch.cat([s.reshape(-1) for s in sp]) if sp else torch.zeros(0)
    n = miss_all.numel()
    return {"mean_miss": float(miss_all.double().mean()) if n else float("nan"),
            "p99_miss": nearest_rank(miss_all, 0.99),
            "realized_sparsity": float(sp_all.double().mean()) if sp_all.numel() else float("nan"), "rows": n}


def _profiles(result: ReplayResult, names: list[str]) -> dict:
    """Mean miss per decode step and per layer over the eligible rows of `names` (for the step/layer plots)."""
    steps = max(result.miss[n].shape[0] for n in names)
    layers = result.miss[names[0]].shape[1]
    by_step, n_step = torch.zeros(steps, dtype=torch.float64), torch.zeros(steps, dtype=torch.float64)
    by_layer, n_layer = torch.zeros(layers, dtype=torch.float64), torch.zeros(layers, dtype=torch.float64)
    for n in names:
        m = result.miss[n].double()  # [S, L, N]
        e = result.eligible[n][:, None, :].expand_as(m).double()
        s_n = m.shape[0]
        by_step[:s_n] += (m * e).sum(dim=(1, 2))
        n_step[:s_n] += e.sum(dim=(1, 2))
        by_layer += (m * e).sum(dim=(0, 2))
        n_layer += e.sum(dim=(0, 2))
    mean = lambda a, b: [float(x) if c > 0 else None for x, c in zip(a / b.clamp(min=1), b)]  # noqa: E731
    return {"miss_by_step": mean(by_step, n_step), "miss_by_layer": mean(by_layer, n_layer)}


def _bins(traces: list[Trace]) -> dict[tuple[str, str], list[str]]:
    """(indexer, context bin or 'all') -> trace names."""
    out: dict[tuple[str, str], list[str]] = {}
    for t in traces:
        for ctx in (context_bin(t.meta.context_len), "all"):
            out.setdefault((t.meta.indexer, ctx), []).append(t.name)
    return out


def run_sweep(trace_sets: dict[str, list[Trace]], pairs: list[tuple[str, float]], device: str = "cpu",
              max_batch: int = 4, seed: int = 0,
              on_step: Callable[[int], None] | None = None,
              on_run: Callable[[dict], None] | None = None, jobs: int = 1,
              profile: tuple[dict, str] | None = None) -> list[dict]:
    """Replay every (policy, sparsity) over every trace set; one row per (set, indexer, context bin).

    on_step(n): progress in rows x layers; on_run(row): called with each finished 'all'-context row.
    jobs: CPU worker processes, one distinct config each at a time (configs are independent; one torch
    thread per worker). 1 = in this process; ignored on a GPU.
    profile: (predictor.policies.load_profiles' {sparsity: profile}, its source) or None: every policy replays with the
    profile calibrated at its sparsity (rows name the policy <policy>+profile; a sparsity without one raises).
    """
    check_int("jobs", jobs, low=1)
    rows = []
    for set_name, traces in trace_sets.items():
        if not traces:
            continue
        k = traces[0].meta.k
        cfgs = {pair: get_policy(pair[0], pair[1], topk=k, seed=seed) for pair in pairs}
        if profile:
            cfgs = {pair: dataclasses.replace(cfg, sparsity_profile=profile_at(profile[0], pair[1], profile[1]))
                    for pair, cfg in cfgs.items()}
        # summary-mix policies replay only the traces that recorded block summaries at their sub-block count
        # (lightning captures; oracle traces have none), a sparsity profile only traces of as many layers (spin-layers
        # is the proxy's 30): the other bins get no row for them
        usable = {key: [t for t in traces if (cfg.summary == 0 or t.has_summary(cfg.summary_parts))
                        and (not cfg.sparsity_profile or len(cfg.sparsity_profile) == t.num_layers)]
                  for key, cfg in ((c.to_json(), c) for c in cfgs.values())}
        unique = [key for key in dict.fromkeys(cfg.to_json() for cfg in cfgs.values())
                  if len(usable[key]) == len(traces)]  # the forked workers replay every trace
        if jobs > 1 and torch.device(device).type == "cpu" and len(unique) > 1:
            cache = _replay_parallel(traces, {c.to_json(): c for c in cfgs.values()}, unique, max_batch, jobs,
                                     on_step)
        else:
            cache = {}
        for policy, sparsity in pairs:
            cfg = cfgs[(policy, sparsity)]
            key = cfg.to_json()
            if not usable[key]:
                continue
            if key not in cache:
                cache[key] = replay(usable[key], cfg, device=device, max_batch=max_batch, progress=on_step)
            res = cache[key]
            for (indexer, ctx), names in sorted(_bins(usable[key]).items(),
                                                key=lambda kv: (kv[0][0], _ctx_order(kv[0][1]))):
                row = {"trace_set": set_name, "indexer": indexer, "context": ctx, "sparsity_target": sparsity,
                       "policy": f"{policy}+profile" if profile else policy, **summarize(res, names),
                       "prompts": len(names),
                       "steps": max(res.miss[n].shape[0] for n in names),
                       "layers": res.miss[names[0]].shape[1], "k": k, "next_n": res.miss[names[0]].shape[2],
                       "seconds": res.seconds, "throughput": res.throughput, "config": json.loads(key)}
                if ctx == "all":
                    row.update(_profiles(res, names))
                rows.append(row)
                if on_run is not None and ctx == "all":
                    on_run(row)
    return rows


_WORKER_TRACES: list[Trace] = []  # set in the parent before forking: workers inherit the traces, no copy


def _replay_job(cfg, max_batch: int) -> ReplayResult:
    torch.set_num_threads(1)
    return replay(_WORKER_TRACES, cfg, max_batch=max_batch)


def _replay_parallel(traces: list[Trace], by_key: dict, keys: list[str], max_batch: int, jobs: int,
                     on_step) -> dict[str, ReplayResult]:
    """Each distinct config replayed in a forked worker; progress reported per finished config."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    global _WORKER_TRACES
    if "fork" not in multiprocessing.get_all_start_methods():  # no fork (macOS spawn, Windows): serial
        return {}
    _WORKER_TRACES = traces
    out = {}
    try:
        with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("fork")) as pool:
            futures = {pool.submit(_replay_job, by_key[key], max_batch): key for key in keys}
            for fut in futures:  # in submission order; each result arrives when its worker is done
                out[futures[fut]] = res = fut.result()
                if on_step is not None:
                    on_step(res.row_layer_steps)
    finally:
        _WORKER_TRACES = []
    return out


def table1(trace_sets: dict[str, list[Trace]], max_steps: int | None = 32, seed: int = 0) -> list[dict]:
    """Table-1 rows (trace_set, indexer, predictor, pearson, topk_recall, rows, context) per set and indexer,
    averaged over the eligible rows of all its prompts; also one row per context bin (context column)."""
    out = []
    for set_name, traces in trace_sets.items():
        groups: dict[tuple[str, str], list[Trace]] = {}
        for t in traces:
            for ctx in ("all", context_bin(t.meta.context_len)):
                groups.setdefault((t.meta.indexer, ctx), []).append(t)
        per_trace = {t.name: table1_rows(t.scores, t.seq_lens, t.meta.k, t.topk, seed=seed, max_steps=max_steps)
                     for t in traces}
        for (indexer, ctx), members in sorted(groups.items(), key=lambda kv: (kv[0][0], _ctx_order(kv[0][1]))):
            for predictor in ("random", "prev-layer", "prev-layer-best5", "prev-iteration"):
                parts = [per_trace[t.name][predictor] for t in members if predictor in per_trace[t.name]]
                parts = [p for p in parts if p["rows"] > 0]
                total = sum(p["rows"] for p in parts)
                if not total:
                    continue
                out.append({"trace_set": set_name, "indexer": indexer, "predictor": predictor, "context": ctx,
                            "pearson": sum(p["pearson"] * p["rows"] for p in parts) / total,
                            "topk_recall": sum(p["topk_recall"] * p["rows"] for p in parts) / total,
                            "rows": total, "prompts": len(parts)})
    return out


def _ctx_order(ctx: str) -> float:
    return float("inf") if ctx == "all" else float(ctx.rstrip("K") or 0)
