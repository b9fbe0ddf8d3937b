"""`spin-indexer eval`: replay SPIN policies over traces and write fidelity tables and plots.

    spin-indexer eval --synthetic v4-like --sweep main --out runs/eval/v4
    spin-indexer eval --traces runs/traces/smollm2 --sweep pooling --layer-stride 3 --out results/fidelity/real
Writes OUT/rows.json, summary.csv, table1.csv, report.md and plots/*.png (see eval/report.py).
"""
from __future__ import annotations

import argparse
import datetime
import json
import subprocess
import sys
import time
from pathlib import Path


def _add(parser: argparse.ArgumentParser, *flags, **kw) -> None:
    """Add an option unless the root parser already defines it (the shared --device/--seed/--out/--quiet)."""
    if not any(f in parser._option_string_actions for f in flags):
        parser.add_argument(*flags, **kw)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    src = parser.add_argument_group("traces (one or more sets)")
    src.add_argument("--traces", action="append", default=[], metavar="DIR",
                     help="directory of <name>.safetensors + <name>.json traces (searched recursively)")
    src.add_argument("--synthetic", action="append", default=[], metavar="PRESET",
                     help="synthetic preset: v32-like, v4-like, shift")
    src.add_argument("--name", action="append", default=[],
                     help="trace-set name, one per --traces then per --synthetic, in that order "
                          "(default: the directory name / synthetic-PRESET)")
    syn = parser.add_argument_group("synthetic traces")
    syn.add_argument("--prompts", type=int, default=3, help="synthetic prompts per context (default 3)")
    syn.add_argument("--context", type=int, nargs="+", default=None,
                     help="synthetic context lengths (default: the preset's)")
    syn.add_argument("--steps", type=int, default=None, help="synthetic decode steps (default: the preset's)")
    syn.add_argument("--num-layers", type=int, default=None, help="synthetic indexer layers (default: the preset's)")
    syn.add_argument("--next-n", type=int, default=None,
                     help="synthetic query rows per step (MTP: 4; default: the preset's)")
    sw = parser.add_argument_group("sweep")
    sw.add_argument("--sweep", default="main", help="smoke, main, pooling, exploration, mtp, history, all, "
                    "summary (traces with block summaries at 4, 8, 16 sub-blocks, what capture records unless "
                    "told), summary-coarse (at 1, 2, 4: capture --summary-parts 1 2 4), layers (spin-layers: the "
                    "shipped head's per-layer budgets, 30-layer traces)")
    sw.add_argument("--sparsity", type=float, nargs="+", default=None, help="override the sweep's targets")
    sw.add_argument("--policy", nargs="+", default=None, help="override the sweep's policies")
    sw.add_argument("--sparsity-profile", default=None, metavar="FILE",
                    help="per-layer profiles (spin-indexer calibrate's profile.json): every policy replays with the "
                         "one calibrated at its sparsity, reported as <policy>+profile")
    sw.add_argument("--layer-stride", type=int, default=1, help="replay every n-th layer of real traces (>= 1)")
    sw.add_argument("--max-steps", type=int, default=None,
                    help="replay only the first n (>= 1) decode steps (default: all)")
    sw.add_argument("--batch", type=int, default=4, help="traces per replay batch")
    sw.add_argument("--jobs", type=int, default=1,
                    help="CPU worker processes replaying distinct configs in parallel (default 1); ignored on a GPU")
    sw.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (default 1: the policy's many small ops lose to thread sync)")
    sw.add_argument("--no-table1", action="store_true", help="skip the Table-1 predictor statistics")
    sw.add_argument("--table1-steps", type=int, default=32,
                    help="decode steps per trace (evenly spaced) in the Table-1 statistics (default 32; they run on "
                         "the CPU and dominate a GPU replay of long traces)")
    sw.add_argument("--no-plots", action="store_true", help="skip plots/*.png")
    _add(parser, "--out", default="runs/eval", metavar="DIR",
         help="output directory (rows.json, summary.csv, table1.csv, report.md, plots/)")
    _add(parser, "--device", default="cpu", help="torch device of the replay")
    _add(parser, "--seed", type=int, default=0, help="seed of the synthetic traces and the policies' randomness")
    _add(parser, "--quiet", action="store_true", help="no progress bar or table, only the final line")
    _add(parser, "--debug", action="store_true", help="show tracebacks")


def check_args(args) -> None:
    """Every numeric option in range and --out creatable, before any trace is read or generated."""
    from ..checks import check_int
    from .main import check_out_dir

    if args.max_steps is not None:
        check_int("--max-steps", args.max_steps, low=1)
    check_int("--table1-steps", args.table1_steps, low=2)  # evenly spaced: the first and the last at least
    for name, value in (("--prompts", args.prompts), ("--layer-stride", args.layer_stride),
                        ("--batch", args.batch), ("--jobs", args.jobs), ("--threads", args.threads)):
        check_int(name, value, low=1)
    for name, value in (("--steps", args.steps), ("--num-layers", args.num_layers), ("--next-n", args.next_n)):
        if value is not None:
            check_int(name, value, low=1)
    for ctx in args.context or []:
        check_int("--context", ctx, low=1)
    sets = len(args.traces) + len(args.synthetic)
    if len(args.name) > sets:
        raise ValueError(f"--name: expected at most one per --traces/--synthetic ({sets}), got {len(args.name)}")
    check_out_dir("--out", args.out)


def load_trace_dir(directory: str, layer_stride: int = 1, steps: range | None = None) -> list:
    """The traces of `--traces directory` (searched recursively), every layer_stride-th layer and the given steps
    (None: all), validated; a missing or empty folder is an error naming --traces (eval's and calibrate's)."""
    from ..traces import list_traces, load_trace
    from ..traces.schema import trace_shape

    if not Path(directory).is_dir():
        raise FileNotFoundError(f"--traces {directory}: not a directory")
    files = list_traces(directory)
    if not files:
        raise FileNotFoundError(f"--traces {directory}: no <name>.safetensors with a <name>.json beside it")
    return [load_trace(f, layers=range(0, trace_shape(f)[1], layer_stride), steps=steps, validate=True)
            for f in files]


def _load_sets(args) -> dict:
    from ..traces import generate
    from ..traces.synthetic import get_spec

    sets = {}
    steps = None if args.max_steps is None else range(0, args.max_steps)
    for i, d in enumerate(args.traces):
        sets[args.name[i] if i < len(args.name) else Path(d).name] = load_trace_dir(d, args.layer_stride, steps)
    for j, preset in enumerate(args.synthetic):
        base = get_spec(preset)
        over = {k: v for k, v in (("num_steps", args.steps), ("num_layers", args.num_layers),
                                  ("next_n", args.next_n)) if v is not None}
        traces = []
        for ctx in args.context or [base.context_len]:
            for p in range(args.prompts):
                seed = args.seed * 1000 + p
                traces.append(generate(preset, seed=seed, prompt_id=f"{preset}-{ctx}-{seed}", context_len=ctx, **over))
        suffix = f"-mtp{args.next_n}" if args.next_n and args.next_n > 1 else ""
        i = len(args.traces) + j
        sets[args.name[i] if i < len(args.name) else f"synthetic-{preset}{suffix}"] = traces
    if not sets:
        raise ValueError("expected --traces DIR or --synthetic PRESET")
    return sets


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "?"
    except (OSError, subprocess.SubprocessError):
        return "?"


def _print_table(rows: list[dict]) -> None:
    print(f"{'trace_set':<28} {'indexer':<10} {'policy':<18} {'target':>6} {'real':>6} {'mean':>7} {'p99':>7}")
    for r in rows:
        if r["context"] != "all":
            continue
        print(f"{r['trace_set'][:28]:<28} {r['indexer'][:10]:<10} {r['policy'][:18]:<18} "
              f"{r['sparsity_target']:>6.0%} {r['realized_sparsity']:>6.1%} {r['mean_miss']:>7.2%} "
              f"{r['p99_miss']:>7.2%}")


def run(args) -> int:
    import torch

    from ..eval.ablations import get_sweep, run_sweep, table1
    from ..eval.report import write_run

    try:
        check_args(args)
        torch.set_num_threads(max(1, args.threads))
        pairs = get_sweep(args.sweep, tuple(args.sparsity) if args.sparsity else None,
                          tuple(args.policy) if args.policy else None)
        profile = None
        if args.sparsity_profile:
            from ..predictor.policies import load_profiles

            profile = (load_profiles(args.sparsity_profile), args.sparsity_profile)
        start = time.perf_counter()
        sets = _load_sets(args)
        out = Path(args.out)
        t1 = [] if args.no_table1 else table1(sets, max_steps=args.table1_steps, seed=args.seed)
        from ..predictor.policies import get_policy

        configs = {get_policy(p, s).to_json() for p, s in pairs}  # aliases replay once
        work = sum(t.num_steps * t.num_layers * t.next_n for v in sets.values() for t in v) * len(configs)
        bar = None
        if not args.quiet:
            from tqdm import tqdm

            bar = tqdm(total=work, unit="row", unit_scale=True, desc=f"eval {args.sweep}", file=sys.stderr)
        sweep_start = time.perf_counter()
        rows = run_sweep(sets, pairs, device=args.device, max_batch=args.batch, seed=args.seed,
                         on_step=bar.update if bar else None, jobs=args.jobs, profile=profile)
        sweep_s = time.perf_counter() - sweep_start
        if bar:
            bar.close()
        seconds = time.perf_counter() - start
        unique = _unique_runs(rows)
        replay_s = sum(r["seconds"] for r in unique)
        argv = sys.argv[1:] if Path(sys.argv[0]).name == "spin-indexer" else ["eval", *sys.argv[1:]]
        info = {"command": "spin-indexer " + " ".join(argv),
                "seconds": seconds, "replay_seconds": replay_s, "commit": _commit(),
                "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
                "threads": torch.get_num_threads(), "device": args.device, "torch": torch.__version__,
                "throughput": _throughput(unique), "runs": len(unique), "jobs": args.jobs,
                # work over the sweep's wall time: with --jobs N, up to N x the per-process throughput
                "sweep_throughput": _work(unique) / max(sweep_s, 1e-9),
                "trace_sets": {k: [t.name for t in v] for k, v in sets.items()}}
        write_run(out, rows, t1, info)
        if not args.no_plots:
            from ..eval.plots import all_figures, heatmap_topk

            all_figures(rows, out / "plots")
            for name, traces in sets.items():  # the longest prompt, middle layer
                longest = max(traces, key=lambda t: (t.meta.context_len, t.num_steps))
                heatmap_topk(longest, longest.num_layers // 2, out / "plots" / f"fig1_{name}.png")
        if not args.quiet:
            _print_table(rows)
        best = [r for r in rows if r["context"] == "all"]
        worst = max(best, key=lambda r: r["p99_miss"]) if best else None
        print(f"eval: {len(best)} runs over {sum(len(v) for v in sets.values())} traces in {seconds:.0f} s "
              f"({info['sweep_throughput']:.0f} rows x layers x steps / s); worst p99 miss "
              f"{worst['p99_miss']:.2%} ({worst['policy']} @ {worst['sparsity_target']:.0%}); wrote {out}"
              if worst else f"eval: nothing to replay; wrote {out}")
        return 0
    except (ValueError, TypeError, FileNotFoundError, RuntimeError) as err:
        if getattr(args, "debug", False):
            raise
        print(f"spin-indexer eval: error: {err}", file=sys.stderr)
        return 2


def _unique_runs(rows: list[dict]) -> list[dict]:
    """One 'all'-context row per actual replay (policy aliases share a replay)."""
    runs = {(r["trace_set"], r["indexer"], json.dumps(r["config"], sort_keys=True)): r for r in rows
            if r["context"] == "all"}
    return list(runs.values())


def _work(runs: list[dict]) -> float:
    """rows x layers x steps replayed by these runs."""
    return sum(r["throughput"] * r["seconds"] for r in runs)


def _throughput(runs: list[dict]) -> float:
    """rows x layers x steps per second of replay, over all runs (per process: each run's own time)."""
    secs = sum(r["seconds"] for r in runs)
    return _work(runs) / secs if secs else float("nan")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="spin-indexer eval", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
