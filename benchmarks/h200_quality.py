"""The stages of issue #18 that need the H200, each one device call (benchmarks/h200_quality.sh wraps them):

    distill32k  an indexer head trained on the out-of-domain corpus (`distill --corpus ood`): 4K (mean
                target), then 16K and 32K (max target, plain RoPE, random row chunks: more sequences per
                minute), each stage from the one before, the first from scratch or --init; the target is
                computed in row chunks (model/distill.py), never a [heads, S, S] map
    capture     fidelity traces with a head (default the shipped one), oracle and lightning, on RULER
                niah_single_2 (--prompts) and on data/prompts/python_stdlib.jsonl (8 documents) at every
                --contexts length: one worker process per (length, domain), --jobs at once, then per set the
                REPLAYS chain (eval --sweep main, pooling, exploration); the traces stay on the device
    worker      one CLI call of capture's (internal)
    quality     RULER (6 tasks) at every --contexts length, --samples seeds per task (17 x 6 = 102 prompts a
                bin), all decoded --batch at a time with CUDA graphs; paired SPIN vs all-keep tables per bin

    python3 benchmarks/h200_quality.py STAGE --out DIR [options]        (the real model; cuda)
    python3 benchmarks/h200_quality.py STAGE --out DIR --dry-run         (tiny random model on the CPU)

Every stage calls the project's own CLI (spin_indexer.cli.main), one call per length (capture: per length and
domain, in worker processes unless --jobs 1), so a stage stopped by its time limit keeps what finished.
--dry-run replaces the model loader, the tokenizer and the RULER generator with tiny stand-ins
(bench_e2e.load(--tiny), a word tokenizer, random prompts) and shrinks every length and count: the same CLI
code paths, in seconds (tests/benchmarks/test_h200_quality.py).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TASKS = ("niah_single_1", "niah_single_2", "niah_single_3", "niah_multikey_1", "niah_multivalue", "vt")
CONFIGS = ("dense", "all-keep", "spin-0.2", "spin-0.3", "spin-0.4", "spin-0.5", "spin-0.4-noexp", "spin-0.5-noexp")
# distillation curriculum: (seq_len, batch, target, lr); the 16K and 32K stages sample rows (--rows-per-seq)
CURRICULUM = ((4096, 2, "mean", 2e-3), (16384, 1, "max", 1e-3), (32768, 1, "max", 1e-3))
# minutes and rows per sequence per stage. Measured on the H200 (1af221f, results/model/distill32k-ood): 4K
# batch 2 0.54 s a step, 16K all rows 1.86 s, 32K 8192 rows 1.38 s. The chunked target's cost is rows x keys:
# 4096 rows (4 random chunks of 1024) are ~1/4 of a 16K sequence's rows x keys and ~1/2 of 8192 rows at 32K,
# so ~0.6-0.8 s a 16K step and ~0.8-1.0 s a 32K one (the model's forward stays): 3 min at 16K ~250 sequences
# (65 before), 3.5 min at 32K ~230 (131 before). 8 min of training + ~40 s of model loads fit a 570 s call.
MINUTES = "1.5,3,3.5"
ROWS_PER_SEQ = "0,4096,4096"
DRY_CURRICULUM = ((128, 2, "mean", 2e-3), (256, 1, "max", 1e-3), (512, 1, "max", 1e-3))


def cli(argv: list[str]) -> int:
    from spin_indexer.cli.main import main

    print("+ spin-indexer " + " ".join(map(str, argv)), flush=True)
    return main([str(a) for a in argv])


def _per_stage(text: str, name: str, stages: int) -> list[float]:
    values = [float(v) for v in str(text).split(",")]
    if len(values) != stages:
        raise SystemExit(f"{name}: expected {stages} comma-separated values (one per stage), got {text!r}")
    return values


def distill32k(args) -> int:
    """The curriculum; writes DIR/s<len>/ per stage and DIR/head32k.safetensors + DIR/distill_summary.json.

    --minutes and --rows-per-seq hold one value per stage (4K, 16K, 32K); a stage of 0 minutes is skipped.
    --init: the first stage that runs starts from these weights (else from scratch), every later one from
    the stage before."""
    plan = DRY_CURRICULUM if args.dry_run else CURRICULUM
    minutes = _per_stage(args.minutes, "--minutes", len(plan))
    rows = [int(r) for r in _per_stage(args.rows_per_seq, "--rows-per-seq", len(plan))]
    if not any(m > 0 for m in minutes) or any(m < 0 for m in minutes):
        raise SystemExit(f"--minutes: expected values >= 0, at least one > 0, got {args.minutes!r}")
    init, summary, t0 = args.init, [], time.time()
    for (seq, batch, target, lr), mins, rows_per_seq in zip(plan, minutes, rows):
        if mins == 0:
            continue
        # --deadline-s: a stage never trains past it (less its --reserve-s for the model load and the save),
        # so a slow load shortens the last stage instead of the call's timeout killing it before its save
        left = (args.deadline_s - (time.time() - t0) - args.reserve_s) / 60
        if left < mins:
            print(f"s{seq}: {mins:g} min planned, {max(left, 0):.2f} min left before --deadline-s", flush=True)
            mins = round(left, 2)
            if mins <= 0.05:
                break
        out = args.out / f"s{seq}"
        argv = ["distill", "--data", args.corpus, "--corpus", "ood", "--seq-len", seq, "--batch", batch,
                "--target", target, "--lr", lr, "--minutes", mins, "--indexer-rope", "plain", "--row-chunk",
                args.row_chunk, "--no-eval", "--device", args.device, "--out", out, "--quiet"]
        if rows_per_seq:
            argv += ["--rows-per-seq", rows_per_seq]
        if args.max_steps:
            argv += ["--max-steps", args.max_steps]
        if init is not None:
            argv += ["--init", init]
        if cli(argv):
            return 1
        start, init = init, out / "smollm2_indexer.safetensors"
        log = json.loads((out / "training_log.json").read_text())
        summary.append({"seq_len": seq, "steps": log["steps"], "seconds": log["seconds"],
                        "rows_per_seq": rows_per_seq, "init": None if start is None else str(start),
                        "kl_first": log["history"][0]["kl"], "kl_last": log["history"][-1]["kl"]})
        print(json.dumps(summary[-1]), flush=True)
    if init is None or init == args.init:
        print("distill32k: no stage trained", flush=True)
        return 1
    shutil.copy(init, args.out / "head32k.safetensors")
    (args.out / "distill_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


# the replays of every (context, domain) trace set, in this order (a chain: the first matters most): the main
# sweep at every layer (Table-1 statistics on 8 evenly spaced steps: they run on the CPU), the summary mix at every
# layer at 40% / 50% (#18's targets; its policies replay the lightning traces, which record block summaries), the
# shipped per-layer budgets against uniform ones (spin-layers) at every layer, the pooling and exploration sweeps at
# every 3rd layer (10 of 30) without Table 1
REPLAYS = (("main", ("--table1-steps", "8")), ("summary", ("--sparsity", "0.4", "0.5", "--no-table1")),
           ("layers", ("--no-table1",)),
           ("pooling", ("--layer-stride", "3", "--no-table1")),
           ("exploration", ("--layer-stride", "3", "--no-table1")))


def capture_chains(args, traces: Path) -> tuple[list, list]:
    """(captures, replays): per (context, domain) one capture (both indexers, one model load) and one chain of
    REPLAYS; each item (label, [argv, ...]) runs its argvs in order."""
    weights = ["--weights", args.weights] if args.weights else []
    common = ["--steps", args.steps, "--k", args.k, "--indexer", args.indexers, "--device", args.device]
    captures, replays = [], []
    for ctx in sorted(args.contexts, reverse=True):  # the longest first: they take the longest
        for name, source in (("ruler", ["--task", "niah_single_2", "--prompts", args.prompts]),
                             (args.domain, ["--prompts", args.prompt_file, "--domain", args.domain])):
            label, where = f"{name}-{ctx}", traces / f"{name}-{ctx}"
            captures.append((f"capture {label}", [["capture", *source, "--context", ctx, *common, *weights,
                                                   "--out", where]]))  # not --quiet: per-trace seconds in its log
            replays.append((f"replay {label}", [
                ["eval", "--traces", where, "--name", label, "--sweep", sweep, *extra, "--device", args.device,
                 "--quiet", "--no-plots", "--out", args.out / "fid" / str(ctx) / f"{sweep}-{name}"]
                for sweep, extra in REPLAYS if sweep in args.sweeps]))
    return captures, replays


def run_chains(args, chains: list, deadline: float, log_dir: Path) -> dict:
    """Run the chains, up to args.jobs at once (args.jobs = 1: in this process, one after another; else each
    argv in its own `h200_quality.py worker` process, logged to log_dir/<label>.log). No argv starts after
    `deadline` (time.time()); a process still running at the deadline is killed (the traces it finished
    stay: each is written when it is done). Returns {label: {"rc", "seconds", "done": argvs finished}}."""
    import subprocess

    log_dir.mkdir(parents=True, exist_ok=True)
    result = {label: {"rc": None, "seconds": 0.0, "done": 0, "killed": False} for label, _ in chains}
    if args.jobs == 1:
        for label, argvs in chains:
            t = time.time()
            for argv in argvs:
                if time.time() > deadline:
                    print(f"{label}: deadline passed, {len(argvs) - result[label]['done']} step(s) not run", flush=True)
                    break
                result[label]["rc"] = cli(argv)
                if result[label]["rc"]:
                    break
                result[label]["done"] += 1
            result[label]["seconds"] = round(time.time() - t, 1)
        return result
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), str(ROOT / "benchmarks"),
                                                        os.environ.get("PYTHONPATH", "")]))
    env.setdefault("OMP_NUM_THREADS", "2")  # --jobs processes share the host's cores (trace checks run on the CPU)
    pending = [(label, list(argvs)) for label, argvs in chains]
    running = {}  # label -> (Popen, log file, argvs left, start)
    while pending or running:
        while pending and len(running) < args.jobs and time.time() < deadline:
            label, argvs = pending.pop(0)
            running[label] = _start(args, label, argvs, log_dir, env) + (time.time(),)
        for label in list(running):
            proc, log, argvs, start = running[label]
            rc = proc.poll()
            if rc is None and time.time() > deadline:
                proc.kill()  # this worker only (its own pid)
                rc = proc.wait()
                result[label]["killed"] = True
                print(f"{label}: killed at the deadline", flush=True)
            if rc is None:
                continue
            log.close()
            result[label]["rc"], result[label]["seconds"] = rc, round(time.time() - start, 1)
            del running[label]
            if rc == 0:
                result[label]["done"] += 1
                if argvs[1:] and time.time() < deadline:
                    running[label] = _start(args, label, argvs[1:], log_dir, env) + (start,)
                    continue
                if argvs[1:]:
                    print(f"{label}: deadline passed, {len(argvs) - 1} step(s) not run", flush=True)
            print(f"{label}: exit {rc} after {result[label]['seconds']:.0f} s", flush=True)
        if not pending or len(running) >= args.jobs or time.time() >= deadline:
            time.sleep(0.2)
        if pending and time.time() >= deadline and not running:
            for label, _ in pending:
                print(f"{label}: deadline passed, not started", flush=True)
            pending = []
    return result


def _start(args, label: str, argvs: list, log_dir: Path, env: dict) -> tuple:
    import subprocess

    log = open(log_dir / (label.replace(" ", "_") + ".log"), "a")
    cmd = [sys.executable, str(Path(__file__).resolve()), "worker", "--out", str(args.out), *(["--dry-run"] if
           args.dry_run else []), "--", *map(str, argvs[0])]
    log.write("+ " + " ".join(cmd) + "\n")
    log.flush()
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=ROOT), log, argvs


def capture(args) -> int:
    """Traces under --traces (default DIR/traces)/<domain>-<context>/, replays under DIR/fid/<context>/
    <sweep>-<domain>/, worker logs under DIR/logs/, DIR/capture_timing.json.

    Every (context, domain) is one capture process (one model load, oracle and lightning traces of each
    prompt), --jobs of them at once on the one GPU (a B = 1 decode leaves it mostly idle); when all are done
    (or --budget-s has passed: stragglers are killed, what they wrote stays), the replay chains run the same
    way until --total-s."""
    traces = args.traces or args.out / "traces"
    captures, replays = capture_chains(args, traces)
    t0 = time.time()
    if args.jobs > 1:  # fill the loader's weight and tokenizer caches once, not from 8 workers racing on them
        from spin_indexer.model import loader

        loader.load_model("cpu")
    timing = {"captures": run_chains(args, captures, t0 + args.budget_s, args.out / "logs")}
    timing["capture_s"] = round(time.time() - t0, 1)
    traced = [(label, argvs) for label, argvs in replays if list(Path(argvs[0][2]).glob("*.json"))]
    for label in sorted({label for label, _ in replays} - {label for label, _ in traced}):
        print(f"{label}: no traces, not replayed", flush=True)
    timing["replays"] = run_chains(args, traced, t0 + args.total_s, args.out / "logs")
    timing["total_s"] = round(time.time() - t0, 1)
    for label in timing["captures"]:
        where = traces / label.split(" ", 1)[1]
        timing["captures"][label]["traces"] = len(list(where.glob("*.json"))) if where.is_dir() else 0
    (args.out / "capture_timing.json").write_text(json.dumps(timing, indent=1) + "\n")
    print(json.dumps({k: v for k, v in timing.items() if k.endswith("_s")}), flush=True)
    # a failure fails the stage; a worker killed at a deadline does not (its timing entry says killed)
    bad = [label for part in ("captures", "replays") for label, r in timing[part].items()
           if r["rc"] and not r["killed"]]
    return 1 if bad else 0


def worker(args) -> int:
    """One CLI call (the argv after --) in this process: a capture or replay of capture()'s chains."""
    return cli(args.argv)


def quality(args) -> int:
    """Samples and tables under DIR/quality (one samples-h200-<context>.jsonl per length)."""
    weights = ["--indexer-weights", args.weights] if args.weights else []
    if args.sparsity_profile:  # the `spin-<s>-profile` configs' per-layer budgets (spin-indexer calibrate's file)
        weights += ["--sparsity-profile", args.sparsity_profile, "--profile-from", args.profile_from,
                    "--short-profile-strength", args.short_profile_strength]
    for ctx in args.contexts:  # one process per length: the model's YaRN factor follows the longest context
        batch = args.batch if ctx < 32768 else args.batch_32k
        if cli(["quality", "--tasks", *args.tasks, "--contexts", ctx, "--samples", args.samples,
                "--first-seed", args.first_seed, "--configs",
                *args.configs, "--topk", args.k, "--indexer", "lightning", *weights, "--batch", batch, "--dtype",
                args.dtype, "--device", args.device, "--shard", f"h200-{ctx}", "--out", args.out / "quality",
                "--quiet"]):
            return 1
    return 0


STAGES = {"distill32k": distill32k, "capture": capture, "quality": quality, "worker": worker}


def parse(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=tuple(STAGES))
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dry-run", action="store_true", help="tiny random model on the CPU, tiny lengths and counts")
    p.add_argument("--device", default=None, help="default cuda (cpu with --dry-run)")
    p.add_argument("--contexts", type=int, nargs="+", default=None, help="default 4096 8192 16384 32768")
    p.add_argument("--weights", type=Path, default=None, help="capture/quality: indexer weights (default the shipped)")
    g = p.add_argument_group("distill32k")
    g.add_argument("--corpus", type=Path, default=Path("runs/h200q/corpus/corpus.pt"), help="the ood corpus (.pt)")
    g.add_argument("--minutes", default=None,
                   help=f"per curriculum stage (4K, 16K, 32K), comma-separated, 0 skips one (default {MINUTES})")
    g.add_argument("--init", type=Path, default=None,
                   help="the first stage that runs starts from these weights (default: from scratch)")
    g.add_argument("--deadline-s", type=float, default=540.0,
                   help="seconds from the start by which the last stage has trained (the shell's timeout is 570)")
    g.add_argument("--reserve-s", type=float, default=20.0, help="seconds a stage's load and save take")
    g.add_argument("--row-chunk", type=int, default=1024)
    g.add_argument("--rows-per-seq", default=None,
                   help=f"rows trained per sequence, per stage, comma-separated, 0: all (default {ROWS_PER_SEQ})")
    g.add_argument("--max-steps", type=int, default=0, help="cap on steps per stage (0: the clock decides)")
    g = p.add_argument_group("capture")
    g.add_argument("--traces", type=Path, default=None, help="where the traces go (default DIR/traces)")
    g.add_argument("--prompts", type=int, default=6, help="RULER prompts per length")
    g.add_argument("--prompt-file", type=Path, default=ROOT / "data" / "prompts" / "python_stdlib.jsonl")
    g.add_argument("--domain", default="python_stdlib")
    g.add_argument("--steps", type=int, default=32)
    g.add_argument("--indexers", default="lightning,oracle", help="traced indexers (capture --indexer)")
    g.add_argument("--sweeps", nargs="+", default=[sweep for sweep, _ in REPLAYS], choices=[sweep for sweep, _ in REPLAYS],
                   help="the replays of each trace set, in REPLAYS' order (main alone: ~1/3 of the replay time)")
    g.add_argument("--jobs", type=int, default=None,
                   help="processes at once (1: all in this process, in turn; default 8, 1 with --dry-run)")
    g.add_argument("--budget-s", type=float, default=float("inf"),
                   help="seconds after which captures are stopped (killed) and the replays start")
    g.add_argument("--total-s", type=float, default=float("inf"),
                   help="seconds (from the start) after which replays are stopped")
    g = p.add_argument_group("quality")
    g.add_argument("--tasks", nargs="+", default=list(TASKS))
    g.add_argument("--samples", type=int, default=17, help="seeds per task (17 x 6 tasks = 102 prompts per length)")
    g.add_argument("--first-seed", type=int, default=0,
                   help="RULER seed of the first prompt: a second pass with seeds after the first's adds prompts "
                        "to the same tables (prepare caches seeds 0 .. PROMPT_SEEDS - 1)")
    g.add_argument("--configs", nargs="+", default=list(CONFIGS))
    g.add_argument("--batch", type=int, default=102, help="prompts decoded together below 32K")
    g.add_argument("--batch-32k", type=int, default=51, help="prompts decoded together at 32K")
    g.add_argument("--dtype", default="bfloat16")
    g.add_argument("--sparsity-profile", type=Path, default=None, metavar="FILE",
                   help="per-layer budgets of the spin-<s>-profile configs (spin-indexer calibrate's JSON)")
    g.add_argument("--profile-from", type=int, default=0,
                   help="with --sparsity-profile: prompts shorter than this budget uniformly (spin-layers: 6144)")
    g.add_argument("--short-profile-strength", type=float, default=0.0,
                   help="with --profile-from: shorter prompts take the profile at this strength (spin-layers-mix: 0.5)")
    p.add_argument("--k", type=int, default=None, help="top-k (capture default 256, quality 512)")
    if argv is None:
        argv = sys.argv[1:]
    argv, rest = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, [])
    args = p.parse_args(argv)
    args.argv = rest
    dry = args.dry_run
    args.device = args.device or ("cpu" if dry else "cuda")
    args.contexts = args.contexts or ([384, 512] if dry else [4096, 8192, 16384, 32768])
    args.minutes = args.minutes or ("0.05,0.05,0.05" if dry else MINUTES)
    args.rows_per_seq = args.rows_per_seq or ("0,96,96" if dry else ROWS_PER_SEQ)
    args.jobs = args.jobs or (1 if dry else 8)
    args.k = args.k or ((32 if dry else 256) if args.stage == "capture" else (64 if dry else 512))
    if dry:
        args.steps, args.samples, args.prompts = min(args.steps, 4), min(args.samples, 2), 2
        args.tasks, args.batch, args.batch_32k, args.dtype = args.tasks[:2], 3, 3, "float32"
        if args.stage == "quality":  # the default configs shrink to three; configs given are kept
            args.contexts = args.contexts[:1]
            if args.configs == list(CONFIGS):
                args.configs = ["dense", "all-keep", "spin-0.4"]
        args.row_chunk, args.max_steps = 32, args.max_steps or 2
    return args


def main(argv=None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        from dry_run import install

        install(args, files=args.stage != "worker")  # a worker uses the files its parent wrote
    t0 = time.time()
    code = STAGES[args.stage](args)
    print(f"{args.stage}: exit {code} after {time.time() - t0:.1f} s", flush=True)
    return code


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
