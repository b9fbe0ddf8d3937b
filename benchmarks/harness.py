"""Benchmark machinery: environment capture, copy bandwidth, CUDA-graph timing with rotated inputs, a random
FP8 key pool, result rows.

Timing (STYLE.md rule 11): every measured callable is captured in a CUDA graph, `rotations` times with
different inputs (so repeated replays do not hit L2), the graph is warmed up, then replayed `reps` times
with device events around each replay; per-call time = replay time / rotations; we report the median
(p20, p80 beside it).
"""
from __future__ import annotations

import contextlib
import dataclasses
import datetime
import json
import math
import os
import platform
import subprocess

import torch

DEVICE = os.environ.get("SPIN_BENCH_DEVICE", "cuda")  # "cpu" + TRITON_INTERPRET=1: a dry run of the code paths
L2_ROTATE_BYTES = 256 << 20  # rotate inputs until one replay touches >= 256 MiB (H200 L2: 60 MB)
MAX_ROTATIONS = int(os.environ.get("SPIN_BENCH_MAX_ROTATIONS", "32"))


@dataclasses.dataclass
class Timing:
    p50_us: float
    p20_us: float
    p80_us: float
    reps: int
    rotations: int

    def as_dict(self):
        return dataclasses.asdict(self)


def environment() -> dict:
    """GPU, versions, commit, date: embedded in every results file."""
    import triton

    commit = "unknown"
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(__file__)).stdout.strip() or commit
    except OSError:
        pass
    if DEVICE == "cpu":
        gpu, sms, mem = "cpu (dry run)", 0, 0
    else:
        props = torch.cuda.get_device_properties(0)
        gpu, sms, mem = props.name, props.multi_processor_count, round(props.total_memory / 2**30, 1)
    return {
        "gpu": gpu, "sms": sms, "mem_gib": mem,
        "torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
        "python": platform.python_version(), "commit": os.environ.get("SPIN_COMMIT", commit),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


def load_module_copy(path: str, name: str, package: str, arg: str, expected: str):
    """The file at path (a copy of one of the package's modules, e.g. an older build of a kernel file) loaded as
    module `name` of `package`, so its relative imports resolve there (the A/B scripts: select_ab, topk_ab).
    arg / expected name the command-line option and what it should point at, for the error."""
    import importlib.util
    import sys
    if not os.path.isfile(path):
        raise SystemExit(f"{arg}: expected {expected}, got {path!r} (no such file)")
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    module.__package__ = package
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def rotations_for(bytes_per_call: int, limit: int = MAX_ROTATIONS) -> int:
    """How many input sets so that one graph replay reads >= L2_ROTATE_BYTES."""
    return max(1, min(limit, math.ceil(L2_ROTATE_BYTES / max(1, bytes_per_call))))


def quantile(values, p: float) -> float:
    """The nearest-rank p-quantile of values (p in [0, 1]; 0.5: the median of an odd count)."""
    s = sorted(values)
    return s[min(len(s) - 1, int(round(p * (len(s) - 1))))]


def time_graph(calls, target_s: float = 0.06, min_reps: int = 5, max_reps: int = 30) -> Timing:
    """Median time of one call: `calls` is a list of zero-argument callables (one per rotation)."""
    if DEVICE == "cpu":  # dry run: exercise the calls, time nothing
        for fn in calls:
            fn()
        return Timing(1.0, 1.0, 1.0, 1, len(calls))
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up outside the graph: compiles kernels, allocates buffers
        for fn in calls:
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for fn in calls:
            fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    torch.cuda.synchronize()
    first = start.elapsed_time(end) / 1e3
    reps = int(max(min_reps, min(max_reps, target_s / max(first, 1e-6))))
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for a, b in events:
        a.record()
        graph.replay()
        b.record()
    torch.cuda.synchronize()
    per_call = [a.elapsed_time(b) * 1e3 / len(calls) for a, b in events]
    del graph
    return Timing(quantile(per_call, 0.5), quantile(per_call, 0.2), quantile(per_call, 0.8), reps, len(calls))


def time_graphs_paired(calls: dict, rounds: int = 10) -> dict:
    """{name: [ms of each round]}: each zero-argument callable captured in its own CUDA graph, then `rounds`
    rounds of one replay of every graph in turn, each replay timed alone. Slow drifts (clocks, heat) then hit
    every graph of a round alike, so per-round differences and ratios (a step minus attention alone, SPIN's
    indexer over the dense one) are steadier than ones of medians taken apart (bench_v32_step's "attention
    alone" moved by ~1 ms between runs when it was timed on its own). CPU dry run: each callable once, every time
    NaN (nothing is timed)."""
    if DEVICE == "cpu":
        for fn in calls.values():
            fn()
        return {name: [float("nan")] * rounds for name in calls}
    graphs = {}
    for name, fn in calls.items():
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up outside the graph: compiles kernels, allocates buffers
            fn()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        graphs[name] = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graphs[name]):
            fn()
        graphs[name].replay()
    torch.cuda.synchronize()
    events = [{name: (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for name in calls}
              for _ in range(rounds)]
    for per_round in events:
        for name, (a, b) in per_round.items():
            a.record()
            graphs[name].replay()
            b.record()
    torch.cuda.synchronize()
    out = {name: [per_round[name][0].elapsed_time(per_round[name][1]) for per_round in events] for name in calls}
    del graphs
    return out


@contextlib.contextmanager
def patched(module, **values):
    """The module's attributes set to `values` while the block runs, restored after (experiments that time a
    kernel's constants without an environment knob in the production code)."""
    saved = {name: getattr(module, name) for name in values}
    for name, value in values.items():
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def copy_bandwidth_gbps(gib: float = 4.0) -> float:
    """Device-to-device copy of `gib` GiB: (bytes read + bytes written) / median time."""
    if DEVICE == "cpu":
        return float("nan")
    n = int(gib * 2**30)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE).random_()
    dst = torch.empty_like(src)
    # Eager copies timed with events (a memcpy node inside a CUDA graph may run on a copy engine: slower).
    times = []
    for i in range(12):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src)
        b.record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(a.elapsed_time(b) * 1e3)
    t = Timing(sorted(times)[len(times) // 2], min(times), max(times), len(times), 1)
    del src, dst
    torch.cuda.empty_cache()
    return 2 * n / (t.p50_us * 1e-6) / 1e9


class KeyPool:
    """One large paged cache uint8 [num_blocks, 64, 1, 132] of random finite FP8 keys with power-of-two
    scales, and a random permutation of its blocks from which block tables are cut (disjoint slices, so
    rotated inputs never share blocks)."""

    def __init__(self, num_blocks: int, seed: int = 0, tokens: int = 64, dim: int = 128):
        gen = torch.Generator(device=DEVICE).manual_seed(seed)
        self.tokens, self.dim = tokens, dim
        self.cache = torch.empty(num_blocks, tokens, 1, dim + 4, dtype=torch.uint8, device=DEVICE)
        flat = self.cache.view(num_blocks, -1)
        step = 1 << 16
        for b0 in range(0, num_blocks, step):
            part = flat[b0:b0 + step]
            vals = part[:, : tokens * dim]
            vals.random_(0, 256, generator=gen)
            vals.copy_(torch.where((vals & 0x7F) == 0x7F, vals ^ 1, vals))  # no fp8 NaN bytes
            exps = torch.randint(-9, -4, (part.shape[0], tokens), device=DEVICE, generator=gen)
            part[:, tokens * dim:].view(torch.float32).copy_(torch.exp2(exps.float()))
        self.perm = torch.randperm(num_blocks, device=DEVICE, generator=gen).to(torch.int32)
        self.num_blocks = num_blocks

    def tables(self, batch: int, width: int, count: int) -> list[torch.Tensor]:
        """`count` block tables int32 [batch, width] over disjoint physical blocks."""
        need = batch * width
        count = max(1, min(count, self.num_blocks // max(1, need)))
        return [self.perm[i * need:(i + 1) * need].view(batch, width).contiguous() for i in range(count)]


def random_queries(batch: int, next_n: int, heads: int = 64, dim: int = 128, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    q = torch.randn(batch, next_n, heads, dim, device=DEVICE, generator=gen).to(torch.float8_e4m3fn)
    w = torch.randn(batch * next_n, heads, device=DEVICE, generator=gen) * heads ** -0.5
    return q, w


def random_topk_rows(rows: int, cols: int, k: int):
    """Full rows of random logits as the top-k benchmarks give them to ops.topk_positions: (logits float32
    [rows, cols], lengths int32 [rows] = cols, block maxima float32 [rows, cols / 64], group maxima at
    topk_group(cols, k) or None where that group is a whole block)."""
    from spin_indexer import ops

    gen = torch.Generator(device=DEVICE).manual_seed(rows * 7 + cols)
    logits = torch.randn(rows, cols, device=DEVICE, generator=gen)
    lens = torch.full((rows,), cols, dtype=torch.int32, device=DEVICE)
    group = ops.topk_group(cols, k)
    gmax = ops.group_max_ref(logits, lens, group) if group < 64 else None
    return logits, lens, ops.block_max(logits, 64), gmax


def decode_lens(batch: int, next_n: int, ctx: int) -> torch.Tensor:
    """seq_lens int32 [B, next_n]: row j of every request has ctx - next_n + j + 1 tokens."""
    j = torch.arange(next_n, device=DEVICE, dtype=torch.int32)
    return (ctx - next_n + 1 + j)[None, :].expand(batch, next_n).contiguous()


def random_history_indexer(cfg, batch: int, width: int, lens: torch.Tensor, gen: torch.Generator,
                           num_cache_blocks: int | None = None, num_layers: int = 1):
    """(SpinIndexer, slots int64 [B]): an indexer of num_layers layers x batch requests x width blocks whose history
    is random (every block scored, none entering: decoding's steady state), its slots allocated and seen up to
    lens[:, 0]; the history drawn from gen (vertical, then diagonal). num_cache_blocks: default batch * width + 1."""
    from spin_indexer.indexer import SpinIndexer

    idx = SpinIndexer(cfg, num_layers=num_layers, max_batch=batch, max_blocks=width,
                      num_cache_blocks=num_cache_blocks or batch * width + 1, device=DEVICE)
    st = idx.state
    slots = torch.tensor([st.allocate() for _ in range(batch)], dtype=torch.int64, device=DEVICE)
    fill_random_history(st, gen)
    st.seen_len[slots] = lens[:, 0]
    return idx, slots


def fill_random_history(st, gen: torch.Generator) -> None:
    """A SpinState's history drawn from gen as after many decode steps, every block scored: V standard normal
    and its block maxima (block grain: the block maxima alone, normal around 2.5, about the max of 64 normals),
    then the diagonal windows."""
    dev = st.block_max.device
    if st.vertical is not None:
        st.vertical.copy_(torch.randn(st.vertical.shape, generator=gen, device=dev).to(st.vertical.dtype))
        st.block_max.copy_(st.vertical.float().amax(dim=2).t().to(st.block_max.dtype))
    else:
        st.block_max.copy_(torch.randn(st.block_max.shape, generator=gen, device=dev).add_(2.5).to(st.block_max.dtype))
    st.diagonal.copy_(torch.randn(st.diagonal.shape, generator=gen, device=dev).to(st.diagonal.dtype))


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    """||got - want|| / ||want|| over the finite entries of want; inf if the -inf masks differ."""
    fin = torch.isfinite(want)
    if not torch.equal(fin, torch.isfinite(got)):
        return float("inf")
    g, w = got[fin].double(), want[fin].double()
    return float((g - w).norm() / w.norm().clamp_min(1e-30))


def long_row(suite: str, case: dict, provider: str, metric: str, unit: str, t: Timing | float, env: dict) -> dict:
    """One long-format row (STYLE.md rule 12)."""
    if isinstance(t, Timing):
        p50, p20, p80 = t.p50_us, t.p20_us, t.p80_us
    else:
        p50 = p20 = p80 = t
    return {"suite": suite, "case": json.dumps(case, sort_keys=True), "provider": provider, "metric": metric,
            "unit": unit, "p50": round(p50, 3), "p20": round(p20, 3), "p80": round(p80, 3),
            "config_json": json.dumps(case, sort_keys=True), "gpu": env["gpu"], "torch": env["torch"],
            "triton": env["triton"], "commit": env["commit"], "date": env["date"]}


def markdown_table(columns, rows: list[dict], fmt=str) -> list[str]:
    """A results page's table: header, separator, one line per row (row[c] through fmt, NaN for a missing c)."""
    return (["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
            + ["| " + " | ".join(fmt(r.get(c, float("nan"))) for c in columns) + " |" for r in rows])
