"""MTP-native paged logits (issue #17): the own kernel's candidate configurations at next_n = 1..4 against
DeepGEMM and against the floors, all measured in one run on one GPU.

    PYTHONPATH=src:benchmarks python3 benchmarks/bench_mtp_logits.py --out $OUT/mtp
    bash benchmarks/h200_step.sh mtp                  # the same on the H200, DeepGEMM built from .dg

Per point (B requests x context L x next_n; H = 64, D = 128, T = 64; one random paged key cache of B x L
tokens: each call reads >= 1.6 GB, far past the 60 MB L2), CUDA graphs, every provider timed in the same
PAIRED_ROUNDS rounds (one replay of each in turn); us = the median, vs_deepgemm = the median per-round ratio:
  own:<config>        paged_indexer_logits_triton(..., config=<config>), block max fused, tail unwritten, for
                      every candidate in CANDIDATES[next_n] (the first is the production one, CONFIGS[next_n])
  own_cuda:<launch>   the CUDA kernel for SM90 (ops/indexer_logits_cuda.py: math warpgroups on blocks in turn,
                      each refilling its own TMA stages), blocks a CTA c<chunk> or the launcher's default; -nomax:
                      without block_max_out (the build that writes the logits only, as DeepGEMM's; SPIN's step asks
                      for the maxima); built with nvcc in the run; a failed build or check drops it from the run;
                      cuda...+switches: the build of --cuda-defines NAME=VALUE,... (cuda_logits_probe.py's
                      switches, e.g. a shape to be made the default: the report names them) beside the library's
  deepgemm            DeepGEMM fp8_paged_mqa_logits at this next_n (n <= 2, where deep_gemm imports)
  deepgemm_per_row    DeepGEMM at next_n = 1 over the B x next_n rows as requests (each row reads its own
                      keys: the cost of an engine that flattens MTP rows)
A point BxLxNxS (S > 0, e.g. 96x131072x4x0.5) times the same providers on SPIN's compact table at sparsity S
instead: each request's kept blocks (predictor.select.budget_of with K = TOPK: the first columns of a table of
ceil(L / T) columns, the rest ids no kernel reads) and rows as long as those blocks; the project's kernels are told
the kept width (active_width, as SPIN's step tells them), DeepGEMM gets the same table and lengths. Its floor and
bytes count the kept tokens; no #17 target is set there (they are for full tables).
Same run: copy bandwidth (4 GiB device-to-device, read + written) and the FP8 MMA peak (torch._scaled_mm,
fast accumulation, the best of two large shapes). Floor of a point = max(key bytes / copy bandwidth, MMA
FLOPs / FP8 peak), key bytes = B x L x 132, MMA FLOPs = 2 x H x D x (sum of the rows' lengths).
Every provider is first checked against paged_indexer_logits_ref on a small odd shape (rel. error < 5e-3,
block max = max of the written logits). Writes <out>/mtp_logits.csv (one row per point and provider),
<out>/mtp_logits.md (environment, floors, table, targets). A CPU dry run (SPIN_BENCH_DEVICE=cpu,
TRITON_INTERPRET=1) runs every provider and config at tiny shapes; nothing is timed there.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import re
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import torch  # noqa: E402

from harness import (DEVICE, KeyPool, copy_bandwidth_gbps, decode_lens, environment, markdown_table,  # noqa: E402
                     quantile, random_queries, rel_err, time_graph, time_graphs_paired)

from spin_indexer.ops import deepgemm  # noqa: E402
from spin_indexer.ops import indexer_logits_cuda  # noqa: E402
from spin_indexer.ops.indexer_logits import block_max_ref, paged_indexer_logits_ref  # noqa: E402
from spin_indexer.ops.indexer_logits_triton import CONFIGS, LogitsConfig, paged_indexer_logits_triton  # noqa: E402
from spin_indexer.predictor.select import budget_of  # noqa: E402

H, D, T = 64, 128, 64
C = LogitsConfig
# Candidates per next_n, the production config first, at most 8 (the sweep fits ~90 s). Register counts and the
# PTX check of the key tile's pipelining (logits_registers.py) in benchmarks/NOTES.md. p2: scales two blocks
# ahead; s4 with a hand prefetch: the key tile three blocks ahead (the pipeliner issues it num_stages - 1 ahead
# when its coordinate is a carried value). Dropped after run 15 (measured slower than their prefetch twins):
# g2w4s3r128, g2w4s3 and g1w4s3 at n = 2, g2w4s3r168 and g1w4s3 at n = 3, g4w4s3 and g1w4s3 at n = 4.
CANDIDATES = {
    1: [CONFIGS[1], C(1, 4, 3, prefetch=1), C(1, 4, 3, prefetch=2), C(1, 4, 4, prefetch=1)],
    2: [CONFIGS[2], C(2, 4, 3, prefetch=2), C(2, 4, 4, prefetch=1), C(2, 4, 4, prefetch=2),
        C(2, 4, 3, max_registers=128, prefetch=1), C(2, 4, 3, max_registers=128, prefetch=2), C(2, 8, 3, prefetch=1),
        C(2, 4, 3, prefetch=1, target_programs=4096), C(2, 4, 3, prefetch=2, target_programs=4096)],
    3: [CONFIGS[3], C(2, 4, 3, max_registers=168, prefetch=1), C(2, 4, 4, max_registers=168, prefetch=1),
        C(2, 4, 3, prefetch=1), C(2, 4, 3, prefetch=2), C(4, 4, 3, prefetch=1),
        C(4, 8, 3, max_registers=128, prefetch=1), C(2, 4, 3, max_registers=168, prefetch=1, target_programs=4096),
        C(2, 4, 3, max_registers=168, prefetch=2, target_programs=4096)],
    4: [CONFIGS[4], C(4, 4, 3, prefetch=2), C(4, 4, 4, prefetch=1), C(4, 8, 3, max_registers=128, prefetch=1),
        C(4, 8, 3, max_registers=128, prefetch=2), C(2, 4, 3, prefetch=1), C(2, 8, 3, max_registers=128, prefetch=1),
        C(4, 4, 3, prefetch=1), C(4, 4, 3, prefetch=2, target_programs=4096),
        C(4, 4, 4, prefetch=1, target_programs=4096)],
}
CASES = [dict(batch=b, ctx=c, next_n=n) for b, c, n in (
    (96, 131072, 2), (32, 524288, 2), (96, 131072, 3), (48, 393216, 4), (96, 131072, 4), (32, 524288, 3),
    (32, 524288, 4), (96, 131072, 1))] + [dict(batch=b, ctx=c, next_n=n, sparsity=0.5) for b, c, n in (
    (96, 131072, 4), (8, 131072, 4))]  # SPIN's compact tables (its step at next_n 3-4 runs these kernels there)
DRY_CASES = [dict(batch=1, ctx=70, next_n=n) for n in (2, 3, 4, 1)] + [dict(batch=2, ctx=300, next_n=3, sparsity=0.5)]
COLUMNS = ["batch", "ctx", "next_n", "sparsity", "provider", "config", "us", "p20_us", "p80_us", "key_GBps",
           "pct_copy_bw", "floor_us", "x_floor", "vs_deepgemm", "production"]
# Every provider of a point is timed in the same rounds (harness.time_graphs_paired: one replay of each in turn),
# and vs_deepgemm is the median over rounds of the per-round ratio. Under sustained load the H200 sits at its
# power limit and its SM clock follows the kernel (run 113: 1.33-1.68 GHz), so medians taken apart moved by up to
# 10-24% between timings of the same build (runs 109, 114); ratios within a round do not see that drift.
PAIRED_ROUNDS = 30
# The top-k a compact point's budget covers (SPIN's budget never drops below K tokens + a block); 64 in a CPU dry
# run, whose tiny contexts would otherwise keep every block
TOPK = 64 if DEVICE == "cpu" else 2048


@dataclasses.dataclass(frozen=True)
class CudaLaunch:
    """A launch of the CUDA kernel: blocks a CTA (None: indexer_logits_cuda.makespan_chunk); defines: the probe
    build's switches (benchmarks/cuda_logits_probe.py; () = the library the logits op calls)."""
    chunk: int | None = None
    defines: tuple[str, ...] = ()
    maxima: bool = True  # block_max_out given (False: the logits-only build)


# emptied when the kernel fails its check
CUDA_LAUNCHES = [CudaLaunch(), CudaLaunch(128), CudaLaunch(256), CudaLaunch(maxima=False),
                 CudaLaunch(256, maxima=False)]


def log(*a):
    print(*a, flush=True)


def config_name(cfg: LogitsConfig | CudaLaunch) -> str:
    """g<rows per MMA>w<warps>s<stages>[r<register cap>][p: scale prefetch one block ahead, p2: two]
    [t<target programs>]; a CudaLaunch: cuda[-c<chunk>][-nomax][+switches: the --cuda-defines build]."""
    if isinstance(cfg, CudaLaunch):
        return ("cuda" + (f"-c{cfg.chunk}" if cfg.chunk else "") + ("" if cfg.maxima else "-nomax")
                + ("+switches" if cfg.defines else ""))
    name = f"g{cfg.group}w{cfg.num_warps}s{cfg.num_stages}"
    name += f"r{cfg.max_registers}" if cfg.max_registers else ""
    name += {0: "", 1: "p", 2: "p2"}[cfg.prefetch]
    return name + (f"t{cfg.target_programs}" if cfg.target_programs != C().target_programs else "")


def scored_tokens(case: dict) -> int:
    """Tokens a request's rows reach: L, or on a compact point (sparsity S > 0) its kept blocks' worth (the
    budget of ceil(L / T) blocks at S, capped at L)."""
    if not case.get("sparsity"):
        return case["ctx"]
    kept = budget_of(-(-case["ctx"] // T), case["sparsity"], min(TOPK, case["ctx"]), T)
    return min(case["ctx"], kept * T)


def key_bytes(case: dict) -> int:
    return case["batch"] * scored_tokens(case) * (D + 4)


def bytes_moved(case: dict) -> int:
    """Keys read + logits and block maxima written (over the blocks the rows touch)."""
    rows, width = case["batch"] * case["next_n"], -(-scored_tokens(case) // T)
    return key_bytes(case) + rows * width * (T + 1) * 4


def mma_flops(case: dict) -> int:
    """2 H D per (row, token): row j of a request has L - next_n + j + 1 tokens (L: scored_tokens)."""
    n, ctx = case["next_n"], scored_tokens(case)
    return 2 * H * D * case["batch"] * sum(ctx - n + j + 1 for j in range(n))


def fp8_mma_peak_tflops() -> float:
    """Best median TFLOP/s of torch._scaled_mm (fp8 e4m3, fast accumulation, bf16 out) over two shapes."""
    if DEVICE == "cpu":
        return float("nan")
    best = float("nan")
    one = torch.ones((), device=DEVICE, dtype=torch.float32)
    for m, n, k in ((8192, 8192, 8192), (16384, 8192, 8192)):
        a = torch.randn(m, k, device=DEVICE).to(torch.float8_e4m3fn)
        b = torch.randn(n, k, device=DEVICE).to(torch.float8_e4m3fn)  # b.t() is column-major, as cuBLAS wants
        try:
            t = time_graph([lambda: torch._scaled_mm(a, b.t(), scale_a=one, scale_b=one, out_dtype=torch.bfloat16,
                                                     use_fast_accum=True)], min_reps=10, max_reps=40)
        except Exception as exc:  # an unsupported build: the MMA floor is then unknown, not made up
            log(f"fp8 peak {m}x{n}x{k}: {exc!r}")
            continue
        tflops = 2 * m * n * k / t.p50_us / 1e6
        best = tflops if math.isnan(best) else max(best, tflops)
        del a, b
    return best


class Inputs:
    """Queries, weights, lengths and block table of one point over a key pool of B x W blocks; sparsity > 0: SPIN's
    compact table (the rows as long as the kept blocks, `active` = those blocks, told to the project's kernels)."""

    def __init__(self, pool: KeyPool, batch: int, ctx: int, next_n: int, sparsity: float = 0.0):
        self.batch, self.ctx, self.next_n = batch, ctx, next_n
        self.width = -(-ctx // T)
        self.cache = pool.cache
        self.table = pool.tables(batch, self.width, 1)[0]
        self.q, self.w = random_queries(batch, next_n, H, D, seed=next_n)
        scored = scored_tokens(dict(ctx=ctx, sparsity=sparsity))
        self.active = -(-scored // T) if sparsity else None
        self.lens = decode_lens(batch, next_n, scored)
        rows = batch * next_n
        self.out = torch.empty(rows, self.width * T, device=DEVICE)
        self.bmax = torch.empty(rows, self.width, device=DEVICE)

    def own(self, cfg: LogitsConfig):
        return lambda: paged_indexer_logits_triton(self.q, self.cache, self.w, self.lens, self.table, validate=False,
                                                   out=self.out, block_max_out=self.bmax, fill_tail=False, config=cfg,
                                                   active_width=self.active)

    def own_cuda(self, launch: CudaLaunch):
        lib = indexer_logits_cuda.load_library(launch.defines) if launch.defines else None
        if launch.defines and lib is None:  # never the library's build timed under the switches' name
            raise RuntimeError(f"the CUDA kernel built with {', '.join(launch.defines)} does not build or load")
        return lambda: indexer_logits_cuda.paged_indexer_logits_cuda(
            self.q, self.cache, self.w, self.lens, self.table, validate=False, out=self.out,
            block_max_out=self.bmax if launch.maxima else None, chunk=launch.chunk, library=lib,
            active_width=self.active)

    def deepgemm(self):
        return lambda: deepgemm.paged_indexer_logits_deepgemm(self.q, self.cache, self.w, self.lens, self.table,
                                                              validate=False)

    def deepgemm_per_row(self):
        rows, n = self.batch * self.next_n, self.next_n
        q = self.q.reshape(rows, 1, H, D)
        lens = self.lens.reshape(rows, 1)
        table = self.table.repeat_interleave(n, dim=0)  # [B*n, W]: every row its request's table
        return lambda: deepgemm.paged_indexer_logits_deepgemm(q, self.cache, self.w, lens, table, validate=False)


def providers(next_n: int, have_dg: bool,
              have_cuda: bool = False) -> list[tuple[str, LogitsConfig | CudaLaunch | None]]:
    """(provider, config) pairs timed at this next_n (PROVIDERS of STYLE.md rule 11, config-parametrized)."""
    out = [("own", cfg) for cfg in CANDIDATES[next_n]]
    if have_cuda:
        out += [("own_cuda", launch) for launch in CUDA_LAUNCHES]
    if have_dg and next_n <= 2:
        out.append(("deepgemm", None))
    if have_dg and next_n >= 2:
        out.append(("deepgemm_per_row", None))
    return out


def run(inputs: Inputs, provider: str, cfg: LogitsConfig | CudaLaunch | None):
    if provider in ("own", "own_cuda"):
        return getattr(inputs, provider)(cfg)
    return getattr(inputs, provider)()


def check(have_dg: bool, env: dict, have_cuda: bool = False) -> None:
    """Every provider and config against the torch reference on a small odd shape; raises on a mismatch (a CUDA
    build's failure drops that build's launches from CUDA_LAUNCHES instead, logged and kept in env["cuda_failed"])."""
    torch.backends.cuda.matmul.allow_tf32 = False
    for n in sorted(CANDIDATES):
        x, ref, live = check_inputs(n)
        for provider, cfg in providers(n, have_dg, have_cuda and bool(CUDA_LAUNCHES)):
            if provider == "own_cuda" and cfg not in CUDA_LAUNCHES:  # its build failed at this next_n
                continue
            try:
                _check_one(x, provider, cfg, n, ref, live, env)
            except Exception as exc:
                if provider != "own_cuda":
                    raise
                log(f"own_cuda {config_name(cfg)} n={n} failed ({exc!r:.300}): that build is dropped")
                env.setdefault("cuda_failed", []).append(f"{config_name(cfg)} n={n}: {exc!r:.300}")
                CUDA_LAUNCHES[:] = [launch for launch in CUDA_LAUNCHES if launch.defines != cfg.defines]
        del x
    log(f"checks passed ({len(env['checks'])} provider x next_n)")


def check_inputs(next_n: int) -> tuple[Inputs, torch.Tensor, torch.Tensor]:
    """The checks' small odd shape at next_n (its last request shorter: a partial last block and a block past
    its length), the reference logits and where they are finite."""
    batch, ctx = (2, 100) if DEVICE == "cpu" else (3, 3001)
    x = Inputs(KeyPool(batch * -(-ctx // T) + 3, seed=next_n), batch, ctx, next_n)
    x.lens[-1] -= 70
    ref = paged_indexer_logits_ref(x.q, x.cache, x.w, x.lens, x.table)
    return x, ref, torch.isfinite(ref)


def _check_one(x: Inputs, provider: str, cfg, n: int, ref: torch.Tensor, live: torch.Tensor, env: dict) -> None:
    """One provider against the reference (AssertionError on a mismatch); its error into env["checks"]."""
    x.out.fill_(float("nan")), x.bmax.fill_(float("nan"))  # poisoned: what a provider skips cannot pass
    got = run(x, provider, cfg)()
    if provider in ("own", "own_cuda"):
        got = x.out
    if provider == "own" or (provider == "own_cuda" and cfg.maxima):
        want_bmax = block_max_ref(torch.where(live, got, float("-inf")), T)
        used = torch.isfinite(want_bmax)
        if not torch.equal(x.bmax[used], want_bmax[used]):
            raise AssertionError(f"{provider} {config_name(cfg)} n={n}: block max differs from the written logits")
    err = rel_err(torch.where(live, got, float("-inf")), ref)
    name = provider + (":" + config_name(cfg) if cfg else "")
    env.setdefault("checks", {})[f"{name}_n{n}_rel_err"] = err
    if not err < 5e-3:
        raise AssertionError(f"{name} n={n}: relative error {err:.2e}")


def time_case(case: dict, pool: KeyPool, have_dg: bool, env: dict, timing: dict) -> list[dict]:
    x = Inputs(pool, case["batch"], case["ctx"], case["next_n"], case.get("sparsity", 0.0))
    floor_us = max(key_bytes(case) / env["copy_GBps"] / 1e3, mma_flops(case) / env["fp8_peak_tflops"] / 1e6
                   if env["fp8_peak_tflops"] == env["fp8_peak_tflops"] else 0.0)
    rows = []
    todo = providers(case["next_n"], have_dg, bool(env.get("cuda_kernel")) and bool(CUDA_LAUNCHES))
    calls = {i: run(x, provider, cfg) for i, (provider, cfg) in enumerate(todo)}
    ms = time_graphs_paired(calls, rounds=timing.get("rounds", PAIRED_ROUNDS))
    dg = next((i for i, (provider, _) in enumerate(todo) if provider == "deepgemm"), None)
    for i, (provider, cfg) in enumerate(todo):
        per_round = [1e3 * t for t in ms[i]] if DEVICE != "cpu" else [1.0]
        us = statistics.median(per_round)
        vs_dg = statistics.median(a / b for a, b in zip(ms[i], ms[dg])) if dg is not None and DEVICE != "cpu" else \
            float("nan")
        rows.append(dict(case, sparsity=case.get("sparsity", 0.0), provider=provider,
                         config=config_name(cfg) if cfg else "", us=us,
                         p20_us=quantile(per_round, 0.2), p80_us=quantile(per_round, 0.8),
                         key_GBps=key_bytes(case) / us / 1e3,
                         pct_copy_bw=100 * bytes_moved(case) / us / 1e3 / env["copy_GBps"], floor_us=floor_us,
                         x_floor=us / floor_us if floor_us else float("nan"), vs_deepgemm=vs_dg,
                         production=bool(provider == "own" and cfg == CONFIGS[case["next_n"]])))
    del x
    return rows


# ---------------------------------------------------------------------------------------------- report
def fmt(v):
    if isinstance(v, float):
        return "" if math.isnan(v) else f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"
    return str(v)


def targets(rows: list[dict]) -> list[str]:
    """The issue's targets, each beside its measured value (best candidate, and the production config)."""
    out = []
    points = sorted({(r["batch"], r["ctx"], r["next_n"], r.get("sparsity", 0.0)) for r in rows},
                    key=lambda p: (p[3], p[2], p[0] * p[1]))
    for b, c, n, sp in points:
        here = [r for r in rows if (r["batch"], r["ctx"], r["next_n"], r.get("sparsity", 0.0)) == (b, c, n, sp)]
        own = [r for r in here if r["provider"] in ("own", "own_cuda")]  # the project's kernels, Triton and CUDA
        if not own:
            continue
        best = min(own, key=lambda r: r["us"])
        prod = next((r for r in own if r["production"]), best)
        dg = next((r["us"] for r in here if r["provider"] == "deepgemm"), float("nan"))
        per_row = next((r["us"] for r in here if r["provider"] == "deepgemm_per_row"), float("nan"))
        if sp:  # SPIN's compact table: reported, no target (the are for full tables)
            dg_here = f", DeepGEMM on the same table {dg:.1f} us (best own {best['vs_deepgemm']:.3f}x)" if dg == dg \
                else ""
            out.append(f"B={b} L={c} n={n} compact at s={sp:g} (kept {scored_tokens(here[0])} tokens a request): best "
                       f"own {best['config']} {best['us']:.1f} us, production {prod['config']} {prod['us']:.1f} us, "
                       f"{best['x_floor']:.2f}x / {prod['x_floor']:.2f}x the kept keys' floor {best['floor_us']:.1f} "
                       f"us{dg_here}")
            continue
        head = f"B={b} L={c} n={n}: best own {best['config']} {best['us']:.1f} us, production {prod['config']} " \
               f"{prod['us']:.1f} us, floor {best['floor_us']:.1f} us"
        if n == 2:
            goal = " (target <= 1.11)" if b * c >= 8 << 20 else " (B x L < 8M: no target)"
            out.append(f"{head}; own / DeepGEMM (median of per-round ratios): best {best['vs_deepgemm']:.3f}x, "
                       f"production {prod['vs_deepgemm']:.3f}x{goal}; medians apart {best['us'] / dg:.3f}x")
            maxima = [r for r in own if not r["config"].endswith("-nomax")]
            if maxima and best not in maxima:  # the best was the logits-only build: also the best with maxima
                bm = min(maxima, key=lambda r: r["us"])
                out.append(f"  with the block maxima (SPIN's step): best {bm['config']} {bm['us']:.1f} us, "
                           f"{bm['vs_deepgemm']:.3f}x DeepGEMM")
        elif n >= 3:
            out.append(f"{head}; own / floor: best {best['x_floor']:.2f}x, production {prod['x_floor']:.2f}x "
                       f"(target <= 1.3); DeepGEMM per row / own: best {per_row / best['us']:.2f}x, production "
                       f"{per_row / prod['us']:.2f}x (target >= 1.6)")
        else:
            out.append(f"{head}; own / floor {best['x_floor']:.2f}x (control)")
    return out


def write_report(out_dir: str, rows: list[dict], env: dict, command: str) -> list[str]:
    with open(os.path.join(out_dir, "mtp_logits.csv"), "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=COLUMNS + ["gpu", "torch", "triton", "commit", "date"], extrasaction="ignore")
        w.writeheader()
        w.writerows([{**{c: fmt(r.get(c, float("nan"))) for c in COLUMNS},
                      **{k: env.get(k) for k in ("gpu", "torch", "triton", "commit", "date")}} for r in rows])
    floors = sorted({(r["batch"], r["ctx"], r["next_n"], r.get("sparsity", 0.0), r["floor_us"]) for r in rows})
    lines = ["# MTP-native paged logits on one GPU (issue #17)", "",
             f"- GPU: {env.get('gpu')} ({env.get('sms')} SMs), {env.get('date')}, torch {env.get('torch')}, triton "
             f"{env.get('triton')}, CUDA {env.get('cuda')}, commit {env.get('commit')}, DeepGEMM "
             f"{'yes' if env.get('deepgemm') else 'no'}",
             f"- command: `{command}`",
             "- CUDA kernel builds (own_cuda rows): the library's"
             + (f"; +switches: built with {', '.join(env['cuda_defines'])}" if env.get("cuda_defines") else ""),
             f"- copy bandwidth (read + written): {env.get('copy_GBps', float('nan')):.0f} GB/s; FP8 MMA peak "
             f"(torch._scaled_mm, fast accumulation): {env.get('fp8_peak_tflops', float('nan')):.0f} TFLOP/s",
             f"- checks vs paged_indexer_logits_ref: worst rel. error "
             f"{max(env.get('checks', {0: 0.0}).values()):.2e} over {len(env.get('checks', {}))} provider x next_n",
             "- floor = max(B x L x 132 B / copy bandwidth, 2 H D x row tokens / FP8 peak): "
             + "; ".join(f"{b}x{c} n={n}{f' s={sp:g}' if sp else ''} {fl:.1f} us" for b, c, n, sp, fl in floors),
             "- CUDA graphs, paired rounds (median; vs_deepgemm: median of per-round ratios); configs: "
             "g<rows per MMA>w<warps>s<stages>[r<register cap>]"
             "[p: scale prefetch, p2: two blocks ahead][t<target programs>]; "
             "production = CONFIGS[next_n]", "",
             "## Targets", ""] + [f"- {t}" for t in targets(rows)] + [""]
    lines += markdown_table(COLUMNS, rows, fmt)
    with open(os.path.join(out_dir, "mtp_logits.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def cuda_defines(text: str) -> tuple[str, ...]:
    """--cuda-defines' switches, each SPIN_LOGITS_<NAME>=<int> (ValueError naming the bad one)."""
    defines = tuple(d.strip() for d in text.split(",") if d.strip())
    for d in defines:
        if not re.fullmatch(r"SPIN_LOGITS_[A-Z0-9_]+=-?\d+", d):
            raise ValueError(f"--cuda-defines: expected SPIN_LOGITS_<NAME>=<int> items, got {d!r}")
    return defines


def cuda_kernel_available(env: dict) -> bool:
    """Whether the CUDA kernel builds and takes this benchmark's shapes here (why not: env["cuda_build"])."""
    try:
        indexer_logits_cuda.build()
    except RuntimeError as exc:
        env["cuda_build"] = str(exc)[-300:]
        return False
    q = torch.empty(1, 1, H, D, device=DEVICE).to(torch.float8_e4m3fn)
    cache = torch.empty(1, T, 1, D + 4, dtype=torch.uint8, device=DEVICE)
    return indexer_logits_cuda.supports(q, cache)


def point_case(text: str) -> dict:
    """A case from BxLxN or BxLxNxS (S: sparsity of a compact point)."""
    parts = text.split("x")
    if len(parts) not in (3, 4):
        raise ValueError(f"--points: expected BxLxN or BxLxNxS, got {text!r}")
    case = dict(zip(("batch", "ctx", "next_n"), map(int, parts[:3])))
    if len(parts) == 4:
        case["sparsity"] = float(parts[3])
        if not 0.0 <= case["sparsity"] < 1.0:
            raise ValueError(f"--points: expected a sparsity in [0, 1) in {text!r}")
    return case


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=os.path.join(HERE, "results", "mtp"))
    p.add_argument("--points", default=None,
                   help="comma list of BxLxN points (BxLxNxS: SPIN's compact table at sparsity S) instead of CASES")
    p.add_argument("--budget-s", type=float, default=120, help="start no new point after this many seconds")
    p.add_argument("--cuda-defines", default="",
                   help="comma list of SPIN_LOGITS_<NAME>=<int> build switches for the CUDA kernel's own_cuda rows "
                        "(default: none, the library's build)")
    args = p.parse_args(argv)
    try:
        defines = cuda_defines(args.cuda_defines)
    except ValueError as exc:
        p.error(str(exc))
    if defines:  # that build beside the library's, at the launcher's chunk and 256, with and without maxima
        CUDA_LAUNCHES.extend(CudaLaunch(chunk, defines, maxima) for chunk, maxima in ((None, True), (256, True),
                                                                                    (None, False)))
    os.makedirs(args.out, exist_ok=True)
    command = "python benchmarks/bench_mtp_logits.py " + " ".join(argv if argv is not None else sys.argv[1:])
    dry = DEVICE == "cpu"
    t0 = time.time()
    env = environment()
    env["deepgemm"] = have_dg = (not dry) and deepgemm.available()
    env["copy_GBps"] = copy_bandwidth_gbps() if not dry else 4170.0
    env["fp8_peak_tflops"] = fp8_mma_peak_tflops()
    env["cuda_defines"] = list(defines)
    env["cuda_kernel"] = have_cuda = (not dry) and cuda_kernel_available(env)
    if have_cuda and defines:  # the switches' build failing leaves the library's rows
        try:
            indexer_logits_cuda.build(defines=defines)
        except RuntimeError as exc:
            env["cuda_switches_build"] = str(exc)[-300:]
            CUDA_LAUNCHES[:] = [launch for launch in CUDA_LAUNCHES if not launch.defines]
    log(json.dumps(env))
    check(have_dg, env, have_cuda)
    log(f"check done at {time.time() - t0:.0f} s")
    if args.points:
        cases = [point_case(s) for s in args.points.split(",")]
    else:
        cases = DRY_CASES if dry else CASES
    timing = {} if dry else dict(rounds=PAIRED_ROUNDS)
    rows, pool, pool_key = [], None, None
    for case in cases:
        if time.time() - t0 > args.budget_s:
            log(f"skipped {case} (time budget)")
            continue
        key = (case["batch"], case["ctx"])
        if key != pool_key:  # one key pool per (B, L), shared by its next_n points
            pool = None
            torch.cuda.empty_cache() if not dry else None
            pool, pool_key = KeyPool(case["batch"] * -(-case["ctx"] // T), seed=case["batch"] + case["ctx"]), key
        t1 = time.time()
        try:
            got = time_case(case, pool, have_dg, env, timing)
        except Exception as exc:  # one failed point must not cost the whole run
            log(f"FAILED {case}: {exc!r}")
            continue
        rows += got
        best = min((r for r in got if r["provider"] in ("own", "own_cuda")), key=lambda r: r["us"])
        log(f"point {case} ({time.time() - t1:.0f} s): " + ", ".join(
            f"{r['provider']}{':' + r['config'] if r['config'] else ''} {r['us']:.1f}" for r in got)
            + f"; best own {best['config']} {best['x_floor']:.2f}x floor")
        write_report(args.out, rows, env, command)  # after every point: a stopped run keeps what it measured
    with open(os.path.join(args.out, "mtp_env.json"), "w") as f:
        json.dump(env, f, indent=1)
    for line in write_report(args.out, rows, env, command)[:40]:
        log(line)
    log(f"total {time.time() - t0:.1f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
