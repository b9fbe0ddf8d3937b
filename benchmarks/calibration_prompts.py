"""Calibration text for `spin-indexer calibrate` on the proxy model: the Python language reference topics pydoc
shows (`pydoc_data.topics`, part of the shipped head's training text, `model/offline_text.py` "docs"), neither
RULER's text nor `data/prompts/python_stdlib.jsonl`'s, so a profile calibrated on it is evaluated out of domain
on both. The topics in sorted order, cut at the topic boundaries nearest to equal shares into --docs documents (CPython
3.11.7: 465 KB of text; at 5 documents the shortest holds 83 KB, more than 16K SmolLM2 tokens: some topics are
35 KB long, so 6 leave one document short of 16K). Deterministic for a given Python.

    python benchmarks/calibration_prompts.py /tmp/calibration.jsonl
    spin-indexer capture --prompts /tmp/calibration.jsonl --context 8192 --steps 32 --indexer lightning --k 256 \
        --out /tmp/tr/cal8192
"""
from __future__ import annotations

import argparse
import json
import sys


def documents(count: int) -> list[dict]:
    import pydoc_data.topics

    topics = pydoc_data.topics.topics
    names = sorted(topics)
    texts = [f"# topic: {name}\n{topics[name]}" for name in names]
    ends, at = [], 0
    for text in texts:
        at += len(text)
        ends.append(at)  # a document may end after any topic
    cuts = [min(range(len(ends)), key=lambda j: abs(ends[j] - at * i / count)) + 1 for i in range(1, count)]
    bounds = [0, *sorted(set(cuts)), len(texts)]
    docs = [texts[a:b] for a, b in zip(bounds, bounds[1:])]
    return [{"id": f"pydoc-{i}", "text": "\n\n".join(parts)} for i, parts in enumerate(docs) if parts]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="the .jsonl to write")
    p.add_argument("--docs", type=int, default=5)
    args = p.parse_args(argv)
    docs = documents(args.docs)
    with open(args.out, "w") as f:
        for doc in docs:
            f.write(json.dumps(doc) + "\n")
    print(f"wrote {len(docs)} documents ({', '.join(str(len(d['text'])) for d in docs)} characters) to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
