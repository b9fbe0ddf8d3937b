"""Stand-ins for a CPU dry run of benchmarks/h200_quality.py: the same CLI code paths without the SmolLM2 GGUF,
the tokenizer or the RULER generators.

`install(args)` patches, for this process only: loader.load_model -> bench_e2e.load's tiny random Llama
(vocab 97, 2 layers; the same weights every call), loader.load_tokenizer -> WordTokenizer, loader.missing_reason
and ruler.missing_reason -> None, ruler.make_prompt -> random 'w<i>' words with answer 'w7'. It also writes what
a stage reads and the real run brings (files=True; a capture worker process reads its parent's): a random token
corpus (args.corpus), a tiny head (args.weights, unless given) and a word prompt file (args.prompt_file).
"""
from __future__ import annotations

import json
import os
from types import SimpleNamespace

import torch

VOCAB = 97  # bench_e2e's tiny model


class WordTokenizer:
    """'w<i>' words <-> ids i mod 97; id 96 is EOS."""

    eos_token_id = VOCAB - 1

    def __call__(self, text, add_special_tokens=False):
        ids = [int(w[1:]) % VOCAB for w in text.split() if w[:1] == "w" and w[1:].isdigit()]
        return SimpleNamespace(input_ids=ids)

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


def _words(n: int, seed: int) -> str:
    g = torch.Generator().manual_seed(seed)
    return " ".join(f"w{i}" for i in torch.randint(0, VOCAB - 1, (n,), generator=g).tolist())


def install(args, files: bool = True) -> None:
    os.environ.setdefault("SPIN_BENCH_DEVICE", "cpu")
    from bench_e2e import load as tiny_load

    from spin_indexer.model import loader, ruler

    def load_model(*a, max_len: int = 8192, **kw):
        model, _, _, _ = tiny_load(SimpleNamespace(tiny=True), max(max_len, 1024), max_len)
        return model, (WordTokenizer() if kw.get("tokenizer", True) else None)

    loader.load_model = load_model
    loader.load_tokenizer = lambda *a, **kw: WordTokenizer()
    loader.missing_reason = lambda: None
    ruler.missing_reason = lambda: None
    ruler.make_prompt = lambda task, context, seed, tok: (_words(context - 40, seed), ["w7"])
    if not files:  # a worker process of capture(): its parent wrote them
        return
    args.corpus = args.out / "corpus.pt"
    torch.save({"train": torch.randint(0, VOCAB - 1, (4000,), dtype=torch.int32),
                "heldout": torch.randint(0, VOCAB - 1, (1, 256), dtype=torch.int32), "corpus": "ood",
                "sources": "dry run: random tokens"}, args.corpus)
    if args.weights is None and args.stage != "distill32k":
        _, head, _, _ = tiny_load(SimpleNamespace(tiny=True), 1024, 1024)
        args.weights = args.out / "tiny_head.safetensors"
        head.save(args.weights)
    args.prompt_file = args.out / "words.jsonl"
    args.prompt_file.write_text("".join(json.dumps({"id": f"doc{i}", "text": _words(900, 50 + i)}) + "\n"
                                        for i in range(2)))
