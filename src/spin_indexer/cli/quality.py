"""`spin-indexer quality`: RULER scores of SmolLM2 with dense attention, all-keep top-k and SPIN.

    spin-indexer quality --tasks niah_single_1 vt --contexts 4096 --samples 4 --out results/quality

Every finished (task, context, seed) appends its per-config rows to <out>/samples.jsonl, and a rerun skips
what is already there (resume; several processes may share one file). At the end all rows of samples.jsonl
are summarized into <out>/ruler.csv (task,context,config,samples,score,mean_miss,p99_miss; score = RULER
string match x 100; task "all" pools every task), <out>/ruler_detail.csv (+ 95% Wilson interval, realized
sparsity, MTP acceptance length, decode steps) and <out>/README.md (command, settings, tables). Text of
README.md after the line `<!-- notes -->` is kept across reruns.

`--report-only` summarizes the samples of `--from` (default results/quality) into `--out` (default
runs/quality-report), leaving the committed tables alone; `--update-results` rewrites the tables of the
`--from` folder itself (what a finished run does).
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import math
import os
import platform
import shlex
import time
from pathlib import Path

NOTES_MARK = "<!-- notes -->"
RESULTS = "results/quality"  # where runs append samples (the committed tables)
REPORT_OUT = "runs/quality-report"  # where --report-only writes unless --update-results
# what rows without `indexer_weights` mean: they predate the field and came from the first, 4K-distilled head
FIRST_HEAD = "sha256:5ed1d61dbd79 (the 4K head)"
_INDEXER_TEXT = {"lightning": "the distilled lightning indexer, FP8 paged cache",
                 "oracle": "oracle = the layer's own attention logits of the new query, max over its heads"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..eval.quality import DEFAULT_CONFIGS, DEFAULT_TASKS

    p.add_argument("--tasks", nargs="+", default=list(DEFAULT_TASKS), help="RULER tasks (model/ruler.py TASKS)")
    p.add_argument("--contexts", nargs="+", type=int, default=[4096], help="prompt lengths in tokens (4096)")
    p.add_argument("--samples", type=int, default=4, help="prompts per (task, context) (default 4)")
    p.add_argument("--first-seed", type=int, default=0, help="RULER seed of the first prompt (seeds n, n+1, ...)")
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                   help="dense, all-keep, spin-<s>[-noexp], spin-<s>-hybrid<w>[-noexp], adaptive-<t>, "
                        "mtp<N>-all-keep, mtp<N>-spin-<s>, mtp<N>-adaptive-<t>, spin-<s>[...]-profile (with "
                        "--sparsity-profile) (default: the paper's set)")
    p.add_argument("--sparsity-profile", default=None, metavar="FILE",
                   help="per-layer profiles (spin-indexer calibrate's profile.json) for the configs named "
                        "spin-<s>[...]-profile (each takes the one calibrated at its sparsity)")
    p.add_argument("--profile-from", type=int, default=0,
                   help="with --sparsity-profile: prompts shorter than this many tokens budget uniformly "
                        "(SpinConfig.profile_from; spin-layers uses 6144; default 0: every prompt)")
    p.add_argument("--short-profile-strength", type=float, default=0.0, metavar="A",
                   help="with --profile-from: shorter prompts take the profile at strength A in [0, 1] "
                        "(SpinConfig.short_profile_strength; spin-layers-mix uses 0.5; default 0: uniform)")
    p.add_argument("--topk", type=int, default=512,
                   help="tokens each layer attends to (default 512; at 256 the distilled indexer misses 4K needles)")
    p.add_argument("--indexer", choices=("auto", "oracle", "lightning"), default="auto",
                   help="lightning = the shipped distilled indexer; auto uses it when its weights exist")
    p.add_argument("--indexer-weights", type=Path, default=None,
                   help="lightning weights other than the shipped ones (e.g. a long-context distillation)")
    p.add_argument("--max-new", type=int, default=None,
                   help="answer token budget cap (default: min(RULER's, answer tokens + 16))")
    p.add_argument("--batch", type=int, default=1,
                   help="prompts of one context decoded together (> 1: eval/quality_batch.py, CUDA graphs on CUDA; "
                        "configs with one row per step only, no mtp<N>- or adaptive-)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="model weights and KV cache (bfloat16 halves the cache: 0.75 GB per 32K prompt instead of 1.5)")
    p.add_argument("--no-graphs", action="store_true", help="with --batch > 1 on CUDA: eager steps, no CUDA graphs")
    p.add_argument("--shard", default=None, help="write samples-<shard>.jsonl (parallel processes, one file each)")
    p.add_argument("--report-only", action="store_true",
                   help="run nothing: summarize the samples*.jsonl (and .jsonl.xz) of --from into --out")
    p.add_argument("--from", dest="source", default=None, metavar="DIR",
                   help=f"with --report-only: the folder whose samples*.jsonl(.xz) are summarized (default: {RESULTS})")
    p.add_argument("--update-results", action="store_true",
                   help="with --report-only: rewrite ruler.csv, ruler_detail.csv and README.md of the --from folder "
                        "itself (the committed results) instead of writing to --out")
    p.add_argument("--out", default=None, metavar="DIR",
                   help=f"samples and tables of a run (default: {RESULTS}); with --report-only, where the tables go "
                        f"(default: {REPORT_OUT})")


def run(args) -> int:
    from tqdm import tqdm

    from ..checks import check_int, check_range
    from ..eval.quality import parse_config

    from .main import check_out_dir

    if args.report_only:
        source, dest = _report_paths(args)
        return _report(source, _command(args), None, args.quiet, dest=dest)
    if args.source is not None or args.update_results:
        raise ValueError(f"{'--from' if args.source is not None else '--update-results'}: only with --report-only "
                         f"(a run writes its tables beside its samples, in --out)")
    args.out = args.out or RESULTS
    out = check_out_dir("--out", args.out)
    samples_path = out / (f"samples-{args.shard}.jsonl" if args.shard else "samples.jsonl")
    command = _command(args)
    configs = [parse_config(c) for c in args.configs]
    profiled = [c.name for c in configs if c.profiled]
    if profiled and not args.sparsity_profile:
        raise ValueError(f"--configs: {', '.join(profiled)} need --sparsity-profile FILE")
    if args.sparsity_profile:
        from ..predictor.policies import load_profiles, profile_at

        profiles = load_profiles(args.sparsity_profile)
        check_int("--profile-from", args.profile_from, low=0)
        check_range("--short-profile-strength", args.short_profile_strength, low=0.0, high=1.0)
        configs = [dataclasses.replace(c, sparsity_profile=profile_at(profiles, c.sparsity, args.sparsity_profile),
                                       profile_from=args.profile_from,
                                       short_profile_strength=args.short_profile_strength)
                   if c.profiled else c for c in configs]
    check_int("--samples", args.samples, low=1)
    check_int("--batch", args.batch, low=1)
    if args.batch > 1:
        unbatched = [c.name for c in configs if c.next_n > 1 or c.adaptive is not None]
        if unbatched:
            raise ValueError(f"--configs: {', '.join(unbatched)} not with --batch > 1 (MTP and adaptive budgets run "
                             f"per prompt: --batch 1)")
    check_int("--topk", args.topk, low=1)
    for c in args.contexts:
        check_int("--contexts", c, low=256)
    import torch

    from ..model import loader, ruler
    from ..model.indexer_head import Indexer

    for task in args.tasks:
        ruler.check_task(task)
    if args.max_new is not None:
        check_int("--max-new", args.max_new, low=1)
    out.mkdir(parents=True, exist_ok=True)
    reason = loader.missing_reason() or ruler.missing_reason()
    if reason:
        raise RuntimeError(reason)
    torch.set_num_threads(max(1, getattr(args, "threads", 1)))  # the root's --threads (default 1)
    torch.manual_seed(args.seed)
    from .main import device_of
    device = device_of(args)
    mode = args.indexer
    weights_path = args.indexer_weights or loader.INDEXER_WEIGHTS
    if args.indexer_weights is not None and not args.indexer_weights.is_file():
        raise FileNotFoundError(f"--indexer-weights: no file {args.indexer_weights}")
    if mode == "auto":
        mode = "lightning" if weights_path.is_file() else "oracle"
    weights_id = _weights_id(weights_path) if mode == "lightning" else None
    done = _done_keys(out, mode, args.topk, weights_id)  # before loading anything: refuses another setting
    max_len = max(args.contexts) + 64
    t0 = time.perf_counter()
    # YaRN from the nominal context (prompt + answer fit in it); the tables cover a few extra positions
    yarn = loader.yarn_factor_for(max(args.contexts))
    model, tok = loader.load_model(device=device, max_len=max_len, yarn_factor=yarn, dtype=getattr(torch, args.dtype))
    indexer = None
    if mode == "lightning":
        indexer = Indexer.load(weights_path, max_len=max_len, yarn_factor=yarn, device=device)
    load_s = time.perf_counter() - t0
    from ..eval.quality import QualityRunner

    runner = QualityRunner(model, lambda ids: tok.decode(ids, skip_special_tokens=True), mode, indexer, args.topk,
                           tok.eos_token_id, args.seed)
    # seed-major order: stopping early leaves every task with about the same number of samples
    jobs = [(t, c, args.first_seed + i) for c in args.contexts for i in range(args.samples) for t in args.tasks]
    jobs = [j for j in jobs if not all((*j, cfg.name) in done for cfg in configs)]
    meta = {"indexer": mode, "topk": args.topk, "indexer_weights": weights_id, "threads": torch.get_num_threads(),
            "device": device, "torch": torch.__version__, "dtype": args.dtype,
            "cpu": platform.processor() or platform.machine(), "load_s": round(load_s, 1)}
    if args.batch > 1:
        _run_batched(args, model, tok, mode, indexer, jobs, configs, done, samples_path, meta, device)
        return _report(out, command, meta, args.quiet)
    bar = tqdm(jobs, desc="quality", unit="prompt", disable=args.quiet)
    for task, context, seed in bar:
        bar.set_postfix_str(f"{task} {context} seed {seed}: prompt")
        prompt = _prompt(task, context, seed, tok, device, args.max_new)
        todo = [cfg for cfg in configs if (task, context, seed, cfg.name) not in done]
        if any(c.next_n > 1 for c in todo) and not any(c.name == "all-keep" for c in todo):
            todo.insert(0, parse_config("all-keep"))  # the MTP draft is the all-keep continuation
        bar.set_postfix_str(f"{task} {context} seed {seed}: prefill {prompt.ids.shape[0]} tokens")
        t = time.perf_counter()
        rows = runner.run(prompt, todo, lambda s, a: ruler.score_answer(task, s, a),
                          on_config=lambda name: bar.set_postfix_str(f"{task} {context} seed {seed}: {name} done"))
        _append(samples_path, prompt, rows, time.perf_counter() - t, meta, done)
    return _report(out, command, meta, args.quiet)


def _prompt(task: str, context: int, seed: int, tok, device, max_new_cap: int | None):
    """The RULER prompt (task, context, seed) as an eval.quality.Prompt on `device`; its answer budget is
    min(RULER's tokens_to_generate, answer tokens + 16, --max-new)."""
    import torch

    from ..eval.quality import Prompt
    from ..model import ruler

    text, answers = ruler.make_prompt(task, context, seed, tok)
    ids = torch.tensor(tok(text, add_special_tokens=False).input_ids, dtype=torch.int64, device=device)
    budget = ruler.TOKENS_TO_GENERATE[ruler.TASKS[task][0]]
    answer_tokens = len(tok(" " + ", ".join(answers), add_special_tokens=False).input_ids)
    return Prompt(task, context, seed, ids, answers, min(budget, answer_tokens + 16, max_new_cap or budget))


def _append(samples_path: Path, prompt, rows: list[dict], seconds: float, meta: dict, done: set) -> None:
    """One samples.jsonl line per result row not yet in `done` (which it then holds)."""
    with open(samples_path, "a") as f:
        for r in rows:
            key = (prompt.task, prompt.context, prompt.seed, r["config"])
            if key in done:
                continue
            miss = r.get("miss_values")
            rec = {"task": prompt.task, "context": prompt.context, "seed": prompt.seed,
                   "prompt_tokens": prompt.ids.shape[0], "max_new": prompt.max_new, "answers": prompt.answers,
                   **{k: r[k] for k in ("config", "text", "score", "steps", "tokens", "acceptance", "mean_miss",
                                        "p99_miss", "sparsity", "miss_rows")},
                   "miss_values": None if miss is None else [round(float(v), 5) for v in miss],
                   "prompt_seconds": round(seconds, 1), **meta}
            rec = {k: None if isinstance(v, float) and math.isnan(v) else v for k, v in rec.items()}
            f.write(json.dumps(rec) + "\n")
            done.add(key)


def _run_batched(args, model, tok, mode, indexer, jobs, configs, done, samples_path, meta, device) -> None:
    """--batch N > 1: the jobs of each context in groups of N, each group decoded together
    (eval/quality_batch.py); a group's seconds are shared evenly by its prompts in prompt_seconds."""
    from tqdm import tqdm

    from ..eval.quality_batch import BatchedQualityRunner
    from ..model import ruler

    runner = BatchedQualityRunner(model, lambda ids: tok.decode(ids, skip_special_tokens=True), mode, indexer,
                                  args.topk, tok.eos_token_id, args.seed, graphs=False if args.no_graphs else None)
    groups = []
    for task, context, seed in jobs:
        if groups and groups[-1][0][1] == context and len(groups[-1]) < args.batch:
            groups[-1].append((task, context, seed))
        else:
            groups.append([(task, context, seed)])
    bar = tqdm(total=len(jobs), desc=f"quality (batch {args.batch})", unit="prompt", disable=args.quiet)
    for group in groups:
        bar.set_postfix_str(f"{group[0][1]} tokens: {len(group)} prompts")
        prompts = [_prompt(t, c, s, tok, device, args.max_new) for t, c, s in group]
        todo = [cfg for cfg in configs if any((t, c, s, cfg.name) not in done for t, c, s in group)]
        t0 = time.perf_counter()
        scores = [lambda text, answers, task=p.task: ruler.score_answer(task, text, answers) for p in prompts]
        rows = runner.run_batch(prompts, todo, scores,
                                on_config=lambda name: bar.set_postfix_str(f"{group[0][1]} tokens: {name} done"))
        seconds = (time.perf_counter() - t0) / len(prompts)
        for prompt, prompt_rows in zip(prompts, rows):
            _append(samples_path, prompt, prompt_rows, seconds, dict(meta, batch=len(prompts)), done)
        bar.update(len(group))
    bar.close()


def _report_paths(args) -> tuple[Path, Path]:
    """(samples folder, tables folder) of --report-only; refuses an --out that holds another folder's samples
    (the old `--report-only --out DIR` meant "summarize DIR", and must not overwrite DIR's tables from
    another folder)."""
    from .main import check_out_dir

    source = Path(args.source or RESULTS)
    if not source.is_dir():
        raise FileNotFoundError(f"--from: {source}: not a directory")
    if args.update_results:
        if args.out is not None and Path(args.out).resolve() != source.resolve():
            raise ValueError(f"--update-results: writes into --from ({source}); drop --out {args.out}")
        return source, source
    dest = Path(args.out or REPORT_OUT)
    if dest.resolve() == source.resolve():
        raise ValueError(f"--out: {dest} is the --from folder; add --update-results to rewrite its tables")
    if dest.is_dir() and sample_files(dest):
        raise ValueError(f"--out: {dest} holds samples*.jsonl(.xz) of its own; to summarize it use --from {dest} "
                         f"(tables to {REPORT_OUT}) or --from {dest} --update-results (rewrites its tables)")
    return source, check_out_dir("--out", dest)


def _command(args) -> str:
    """The canonical command line of this run (every option spelled out, so it regenerates the same cells)."""
    if args.report_only:
        source = shlex.quote(str(args.source or RESULTS))
        if args.update_results:
            return f"spin-indexer quality --report-only --from {source} --update-results"
        return f"spin-indexer quality --report-only --from {source} --out {shlex.quote(str(args.out or REPORT_OUT))}"
    parts = ["spin-indexer", "quality", "--tasks", *args.tasks, "--contexts", *map(str, args.contexts), "--samples",
             str(args.samples), "--first-seed", str(args.first_seed), "--configs", *args.configs, "--topk",
             str(args.topk), "--indexer", args.indexer, "--out", str(args.out)]
    if args.indexer_weights:
        parts += ["--indexer-weights", str(args.indexer_weights)]
    if args.max_new:
        parts += ["--max-new", str(args.max_new)]
    if args.batch > 1:
        parts += ["--batch", str(args.batch)]
    if args.dtype != "float32":
        parts += ["--dtype", args.dtype]
    if args.shard:
        parts += ["--shard", args.shard]
    if args.sparsity_profile:
        parts += ["--sparsity-profile", str(args.sparsity_profile), "--profile-from", str(args.profile_from)]
        if args.short_profile_strength:
            parts += ["--short-profile-strength", f"{args.short_profile_strength:g}"]
    return " ".join(shlex.quote(p) for p in parts)


def sample_files(folder: Path) -> list[Path]:
    """The samples*.jsonl of `folder` and the xz-compressed ones (samples*.jsonl.xz, as results are committed),
    sorted."""
    return sorted([*folder.glob("samples*.jsonl"), *folder.glob("samples*.jsonl.xz")])


def _lines(out: Path):
    """The rows (json lines) of the folder's sample files. Where X.jsonl sits beside X.jsonl.xz it holds the
    archive's rows again (decompressed with `xz -dk`) or only the rows a run resumed from the archive appended
    since, or both: each row of the pair is read once (a row is one cell's result: a line twice is one row)."""
    import lzma

    seen: dict[str, set] = {}  # stem X -> the lines read from its other file
    for path in sample_files(out):
        packed = path.suffix == ".xz"
        stem = str(path.with_suffix("")) if packed else str(path)
        text = lzma.decompress(path.read_bytes()).decode() if packed else path.read_text()
        other = seen.get(stem, set())
        lines = [line for line in text.splitlines() if line.strip()]
        yield from (line for line in lines if line not in other)
        seen[stem] = set(lines)


def _weights_id(path: Path) -> str:
    """'sha256:<prefix>' of the weights file: the rows say which head made them, whatever the file is called
    (rows without it: FIRST_HEAD)."""
    import hashlib

    return f"sha256:{hashlib.sha256(path.read_bytes()).hexdigest()[:12]}"


def _done_keys(out: Path, indexer: str, topk: int, weights_id: str | None = None) -> set:
    """Cells already in <out>; a folder holds one (indexer, top-k, weights) setting, anything else is refused."""
    rows = list(map(json.loads, _lines(out)))
    _check_one_setting(out, rows, (indexer, topk, weights_id))
    return {(r["task"], r["context"], r["seed"], r["config"]) for r in rows}


def _check_one_setting(out: Path, rows: list[dict], expected: tuple | None = None) -> None:
    # dense rows attend to every token and never run the indexer, so they pair with any head's rows on the
    # same prompts (a new head's folder can reuse the dense rows decoded beside an earlier one)
    settings = {(r.get("indexer"), r.get("topk"), r.get("indexer_weights")) for r in rows if r.get("config") != "dense"}
    settings |= {expected} if expected else set()
    if len(settings) > 1:
        found = ", ".join(f"{i} indexer / top-k {k} / weights {w or FIRST_HEAD}"
                          for i, k, w in sorted(settings, key=str))
        raise ValueError(f"--out: {out} mixes settings ({found}); use one folder per indexer, top-k and weights")


def _load(out: Path) -> list[dict]:
    import torch

    rows = []
    for line in _lines(out):
        r = json.loads(line)
        r["miss_values"] = None if r.get("miss_values") is None else torch.tensor(r["miss_values"])
        for k in ("acceptance", "sparsity", "mean_miss", "p99_miss"):
            r[k] = float("nan") if r.get(k) is None else float(r[k])
        rows.append(r)
    return rows


def _report(out: Path, command: str, meta: dict | None, quiet: bool, dest: Path | None = None) -> int:
    """Summarize the samples of `out` into dest (default: out itself)."""
    from ..eval.quality import CSV_COLUMNS, DEFAULT_CONFIGS, summarize

    source, out = out, dest or out
    samples = _load(source)
    if not samples:
        raise RuntimeError(f"{source}: no samples*.jsonl rows to summarize")
    _check_one_setting(source, samples)
    out.mkdir(parents=True, exist_ok=True)
    pooled = [dict(s, task="all") for s in samples]
    rows = summarize(samples) + summarize(pooled)
    order = {c: i for i, c in enumerate(DEFAULT_CONFIGS)}
    rows.sort(key=lambda r: (r["task"] == "all", r["task"], r["context"], order.get(r["config"], 99), r["config"]))
    _write_csv(out / "ruler.csv", rows, CSV_COLUMNS)
    _write_csv(out / "ruler_detail.csv", rows, CSV_COLUMNS + ("ci_low", "ci_high", "sparsity", "acceptance", "steps"))
    last = next((r for r in reversed(samples) if r.get("config") != "dense"), samples[-1])  # the folder's setting
    meta = meta or {k: last.get(k) for k in ("indexer", "topk", "indexer_weights", "threads", "device",
                                                    "torch", "cpu")}
    table = format_table(rows) + "\n\n" + paired_table(samples, list(dict.fromkeys(r["config"] for r in rows if r["task"] == "all")))
    _write_readme(out / "README.md", command, meta, samples, table, notes_from=source / "README.md")
    if not quiet:
        print(table)
    print(f"wrote {out / 'ruler.csv'}, {out / 'ruler_detail.csv'}, {out / 'README.md'} "
          f"({len(samples)} rows in {source}/samples*.jsonl)")
    return 0


def _fmt(v, spec):
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, spec)


def _write_csv(path: Path, rows: list[dict], columns) -> None:
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([_fmt(r[c], ".6f") if isinstance(r[c], float) else r[c] for c in columns])


def format_table(rows: list[dict]) -> str:
    """Markdown: one line per cell (task, context, config) with score, CI, miss, sparsity, acceptance."""
    head = ("| task | context | config | n | score | 95% CI | mean miss | p99 miss | realized sparsity | "
            "accept. len |\n|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        lines.append(f"| {r['task']} | {r['context']} | {r['config']} | {r['samples']} | {_fmt(r['score'], '.1f')} | "
                     f"{_fmt(r['ci_low'], '.1f')}-{_fmt(r['ci_high'], '.1f')} | {_fmt(r['mean_miss'], '.2%')} | "
                     f"{_fmt(r['p99_miss'], '.2%')} | {_fmt(r['sparsity'], '.1%')} | {_fmt(r['acceptance'], '.3f')} |")
    return "\n".join(lines)


def paired_table(samples: list[dict], configs: list[str], base: str = "all-keep") -> str:
    """Markdown: per context bin, every config (dense included) minus `base` on the same prompts (all tasks
    pooled): prompts compared, outputs identical to the base's, prompts scored higher / lower, the mean score
    difference x 100 with its 95% interval, and for the configs issue #18 bounds (eval/paired.issue_bound)
    whether the interval lies within them (eval/paired.verdict)."""
    from ..eval.paired import issue_bound, paired_diffs, verdict

    lines = [f"Paired with {base} (config minus {base} on the same prompts, all tasks, per context length; 95% CI: "
             f"normal approximation over the per-prompt score differences; bound: issue #18's, SPIN 30% within "
             f"1 point and 40% within 2, met when the whole interval lies inside):", "",
             "| context | config | prompts | identical output | better | worse | mean diff | 95% CI | bound | meets |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for cfg, context, d in paired_diffs(samples, configs, base):
        ci = "-" if math.isnan(d.lo) else f"{d.lo:+.2f} to {d.hi:+.2f}"
        bound = issue_bound(cfg)
        judged = ("-", "-") if bound is None else (f"+-{bound:g}", verdict(d, bound))
        lines.append(f"| {context} | {cfg} | {d.n} | {d.same} | {d.better} | {d.worse} | {d.mean:+.2f} | {ci} | "
                     f"{judged[0]} | {judged[1]} |")
    return "\n".join(lines)


def _write_readme(path: Path, command: str, meta: dict, samples: list[dict], table: str,
                  notes_from: Path | None = None) -> None:
    """README.md with the tables; the notes after NOTES_MARK survive from `path`, else from `notes_from`
    (the samples folder's README, when the tables go elsewhere)."""
    notes = ""
    for src in (path, notes_from):
        if src is not None and src.is_file() and NOTES_MARK in src.read_text():
            notes = src.read_text().split(NOTES_MARK, 1)[1]
            break
    seeds = sorted({(s["task"], s["context"], s["seed"]) for s in samples})
    secs = {(s["task"], s["context"], s["seed"]): s.get("prompt_seconds", 0) for s in samples}
    devices = {}
    for smp in samples:
        devices.setdefault(smp.get("device") or "?", set()).add(smp["context"])
    where = "; ".join(f"{d} at {', '.join(map(str, sorted(c)))} tokens" for d, c in sorted(devices.items()))
    weights = ""
    if meta.get("indexer") == "lightning":
        weights = f"; weights {meta.get('indexer_weights') or FIRST_HEAD}"
    text = f"""# RULER quality: dense vs all-keep vs SPIN (SmolLM2-135M-Instruct)

Regenerate (resumes from samples.jsonl; delete it to start over):

    {command}

- Model: SmolLM2-135M-Instruct (Q4_1 GGUF de-quantized to fp32), own Llama forward (model/llama.py).
- Indexer: **{meta.get('indexer')}** ({_INDEXER_TEXT.get(meta.get('indexer'), '?')}{weights}),
  top-k = {meta.get('topk')} tokens per layer and row, block = 64 tokens; prefill dense, decode sparse.
- Devices: {where} (last run: torch {meta.get('torch')}, {meta.get('threads')} CPU thread(s));
  {len(seeds)} prompts, {sum(secs.values()):.0f} s of decoding (prefill + all configs).
- Score = RULER string match (fraction of expected strings in the output) x 100, mean over samples;
  95% Wilson interval over the n samples. task `all` pools every task's samples.
- mean/p99 miss: fraction of the dense indexer top-k (same step, same scores) in blocks SPIN skipped, over
  every (decode row, layer) with context > k, pooled over the cell's samples (nearest-rank p99).
  all-keep scores every block (miss 0 by construction); dense has no indexer (-).
- MTP (`mtp3-*`): 3 rows per step, drafts = the sample's all-keep greedy continuation; acceptance length =
  tokens emitted per verification step (max 3). The output equals the verifier's greedy output.
- Generation: greedy; stops at EOS, at min(RULER's tokens_to_generate, answer tokens + 16) tokens, or as
  soon as every expected string is present (string match cannot change after that).

{table}

{NOTES_MARK}{notes}"""
    path.write_text(text if text.endswith("\n") else text + "\n")
