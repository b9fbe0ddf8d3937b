"""The stages of issue #18 that need the H200, each one device call (benchmarks/h200_quality.sh wraps them):

    distill32k  an indexer head trained from scratch on the out-of-domain corpus (`distill --corpus ood`):
                4K (mean target), then 16K and 32K (max target, plain RoPE), each stage from the one before;
                the 32K stage uses row chunks (model/distill.py), never a [heads, S, S] map
    capture     fidelity traces with a head (default the shipped one) on RULER niah_single_2 and on
                data/prompts/python_stdlib.jsonl at every --contexts length, >= 6 prompts each, then the
                `eval --sweep main` replay of each (the traces stay on the device: 127 MB each at 32K)
    quality     RULER (6 tasks) at every --contexts length, --samples seeds per task (17 x 6 = 102 prompts a
                bin), all decoded --batch at a time with CUDA graphs; paired SPIN vs all-keep tables per bin

    python3 benchmarks/h200_quality.py STAGE --out DIR [options]        (the real model; cuda)
    python3 benchmarks/h200_quality.py STAGE --out DIR --dry-run         (tiny random model on the CPU)

Every stage calls the project's own CLI (spin_indexer.cli.main) in this process, one call per length, so
a stage stopped by its time limit keeps what finished. --dry-run replaces the model loader, the tokenizer
and the RULER generator with tiny stand-ins (bench_e2e.load(--tiny), a word tokenizer, random prompts) and
shrinks every length and count: the same CLI code paths, in seconds (tests/benchmarks/test_h200_quality.py).
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
# distillation curriculum: (seq_len, batch, target, lr); the 32K stage samples rows (--rows-per-seq)
CURRICULUM = ((4096, 2, "mean", 2e-3), (16384, 1, "max", 1e-3), (32768, 1, "max", 1e-3))
DRY_CURRICULUM = ((128, 2, "mean", 2e-3), (256, 1, "max", 1e-3), (512, 1, "max", 1e-3))


def cli(argv: list[str]) -> int:
    from spin_indexer.cli.main import main

    print("+ spin-indexer " + " ".join(map(str, argv)), flush=True)
    return main([str(a) for a in argv])


def distill32k(args) -> int:
    """The curriculum; writes DIR/s<len>/ per stage and DIR/head32k.safetensors + DIR/distill_summary.json."""
    plan = DRY_CURRICULUM if args.dry_run else CURRICULUM
    minutes = [float(m) for m in args.minutes.split(",")]
    first = 0 if args.init is None else len(plan) - 1  # --init: only the last (longest) stage
    if len(minutes) != len(plan) - first:
        raise SystemExit(f"--minutes: expected {len(plan) - first} comma-separated values, got {args.minutes!r}")
    init, summary = args.init, []
    for (seq, batch, target, lr), mins in zip(plan[first:], minutes):
        out = args.out / f"s{seq}"
        argv = ["distill", "--data", args.corpus, "--corpus", "ood", "--seq-len", seq, "--batch", batch,
                "--target", target, "--lr", lr, "--minutes", mins, "--indexer-rope", "plain", "--row-chunk",
                args.row_chunk, "--no-eval", "--device", args.device, "--out", out, "--quiet"]
        if seq == plan[-1][0]:
            argv += ["--rows-per-seq", args.rows_per_seq]
        if args.max_steps:
            argv += ["--max-steps", args.max_steps]
        if init is not None:
            argv += ["--init", init]
        if cli(argv):
            return 1
        init = out / "smollm2_indexer.safetensors"
        log = json.loads((out / "training_log.json").read_text())
        summary.append({"seq_len": seq, "steps": log["steps"], "seconds": log["seconds"],
                        "kl_first": log["history"][0]["kl"], "kl_last": log["history"][-1]["kl"]})
        print(json.dumps(summary[-1]), flush=True)
    shutil.copy(init, args.out / "head32k.safetensors")
    (args.out / "distill_summary.json").write_text(json.dumps(summary, indent=1) + "\n")
    return 0


def capture(args) -> int:
    """Traces under --traces (default DIR/traces), fidelity tables under DIR/fid/<context>/."""
    traces = args.traces or args.out / "traces"
    weights = ["--weights", args.weights] if args.weights else []
    common = ["--steps", args.steps, "--k", args.k, "--indexer", "lightning", "--device", args.device, "--quiet"]
    t0 = time.time()
    for ctx in args.contexts:
        if time.time() - t0 > args.budget_s:
            print(f"budget of {args.budget_s:.0f} s spent: {ctx} and longer not captured", flush=True)
            break
        ruler_dir, file_dir = traces / f"ruler-{ctx}", traces / f"{args.domain}-{ctx}"
        if cli(["capture", "--task", "niah_single_2", "--prompts", args.prompts, "--context", ctx, *common, *weights,
                "--out", ruler_dir]):
            return 1
        if cli(["capture", "--prompts", args.prompt_file, "--domain", args.domain, "--context", ctx, *common,
                *weights, "--out", file_dir]):
            return 1
        if cli(["eval", "--traces", ruler_dir, "--name", f"ruler-{ctx}", "--traces", file_dir, "--name",
                f"{args.domain}-{ctx}", "--sweep", args.sweep, "--device", args.device, "--quiet", "--no-plots",
                "--out", args.out / "fid" / str(ctx)]):
            return 1
    return 0


def quality(args) -> int:
    """Samples and tables under DIR/quality (one samples-h200-<context>.jsonl per length)."""
    weights = ["--indexer-weights", args.weights] if args.weights else []
    for ctx in args.contexts:  # one process per length: the model's YaRN factor follows the longest context
        batch = args.batch if ctx < 32768 else args.batch_32k
        if cli(["quality", "--tasks", *args.tasks, "--contexts", ctx, "--samples", args.samples, "--configs",
                *args.configs, "--topk", args.k, "--indexer", "lightning", *weights, "--batch", batch, "--dtype",
                args.dtype, "--device", args.device, "--shard", f"h200-{ctx}", "--out", args.out / "quality",
                "--quiet"]):
            return 1
    return 0


STAGES = {"distill32k": distill32k, "capture": capture, "quality": quality}


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
    g.add_argument("--minutes", default=None, help="per curriculum stage, comma-separated (default 2,2,3)")
    g.add_argument("--init", type=Path, default=None, help="fine-tune these weights with the 32K stage only")
    g.add_argument("--row-chunk", type=int, default=1024)
    g.add_argument("--rows-per-seq", type=int, default=8192, help="rows trained per 32K sequence (0: all)")
    g.add_argument("--max-steps", type=int, default=0, help="cap on steps per stage (0: the clock decides)")
    g = p.add_argument_group("capture")
    g.add_argument("--traces", type=Path, default=None, help="where the traces go (default DIR/traces)")
    g.add_argument("--prompts", type=int, default=6, help="RULER prompts per length")
    g.add_argument("--prompt-file", type=Path, default=ROOT / "data" / "prompts" / "python_stdlib.jsonl")
    g.add_argument("--domain", default="python_stdlib")
    g.add_argument("--steps", type=int, default=48)
    g.add_argument("--sweep", default="main")
    g.add_argument("--budget-s", type=float, default=float("inf"), help="start no new length after this")
    g = p.add_argument_group("quality")
    g.add_argument("--tasks", nargs="+", default=list(TASKS))
    g.add_argument("--samples", type=int, default=17, help="seeds per task (17 x 6 tasks = 102 prompts per length)")
    g.add_argument("--configs", nargs="+", default=list(CONFIGS))
    g.add_argument("--batch", type=int, default=102, help="prompts decoded together below 32K")
    g.add_argument("--batch-32k", type=int, default=51, help="prompts decoded together at 32K")
    g.add_argument("--dtype", default="bfloat16")
    p.add_argument("--k", type=int, default=None, help="top-k (capture default 256, quality 512)")
    args = p.parse_args(argv)
    dry = args.dry_run
    args.device = args.device or ("cpu" if dry else "cuda")
    args.contexts = args.contexts or ([384, 512] if dry else [4096, 8192, 16384, 32768])
    args.minutes = args.minutes or ("0.05,0.05,0.05" if dry else "2,2,3")
    args.k = args.k or ((32 if dry else 256) if args.stage == "capture" else (64 if dry else 512))
    if dry:
        args.steps, args.samples, args.prompts, args.sweep = min(args.steps, 4), min(args.samples, 2), 2, "smoke"
        args.tasks, args.batch, args.batch_32k, args.dtype = args.tasks[:2], 3, 3, "float32"
        if args.stage == "quality":
            args.contexts, args.configs = args.contexts[:1], ["dense", "all-keep", "spin-0.4"]
        args.rows_per_seq, args.row_chunk, args.max_steps = 96, 32, args.max_steps or 2
    return args


def main(argv=None) -> int:
    args = parse(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    if args.dry_run:
        from dry_run import install

        install(args)
    t0 = time.time()
    code = STAGES[args.stage](args)
    print(f"{args.stage}: exit {code} after {time.time() - t0:.1f} s", flush=True)
    return code


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
