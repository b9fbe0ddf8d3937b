"""Would a current-step signal close SPIN's 4K gap? A closed-loop simulation with block key summaries (issue #18).

    python benchmarks/coarse_blocks_sim.py capture --context 4096 --rows 32 --out /tmp/qk4096.pt   # CPU, ~2 min
    python benchmarks/coarse_blocks_sim.py sim --qk /tmp/qk4096.pt --k 256 --sparsity 0.4 --out DIR  # ~1 min a config

fidelity_bounds.py shows that at 4K (k = 256) no history predictor reaches issue #18's 3.5% mean miss at 40%, even
seeing every block at every step. This script asks what this step's query adds when it meets a cheap summary of
every block's keys (each block's mean key, or the means of its 2 / 4 / 8 sub-blocks): summary score of a block =
max over its summaries of sum_h w_h ReLU(q_h . mean key), 1/64 of the indexer's work a summary per block.

capture: the proxy model (SmolLM2-135M, the shipped lightning head) over the first context + rows tokens of every
document of data/prompts/python_stdlib.jsonl (teacher-forced: the rows are the document's own next tokens, not a
greedy decode); saves per document and layer q float16 [rows, H, D], w float32 [rows, H], keys float16 [n, D].
sim: per document and layer, rows in order; the first --warm rows score every block (SPIN's state warm), then each
row keeps SPIN's budget (budget_of; the newest block always; random exploration round(gamma m) of it) by:
  hist          SPIN's A1-Max prediction: max(V[i], D[q - i]) max-pooled, V / D EMAs (alpha 0.5) updated only
                from the kept blocks' scores (skipped positions keep their estimate), as the replay does
  coarse-<s>    the summary score alone (s = mean, sub2, sub4, sub8, or one of the two below)
  bound<S>      Quest-style channel bounds (S = 1, 2, 4 sub-blocks a block): each sub-block's per-dimension key min
                and max; ub_h = sum_d max(q_hd kmin_d, q_hd kmax_d), lb_h the same with min; summary = max over
                sub-blocks of sum_h w_h ReLU(ub_h if w_h >= 0 else lb_h), an upper bound of every token's score
  top<m>        the keys of the m tokens of the block that scored highest when the block was last kept, scored
                exactly with this step's query, the max over them (top<m>+<s>: the max of that and summary <s>)
  mix-<s>-<w>   (1 - w) * percentile(hist) + w * percentile(summary) (hybrid.percentile's rule)
  zmix-<s>-<w>  the same with standardized scores ((x - mean) / std a row) instead of percentiles
  xmix-<src>-<w>  (1 - w) * percentile(hist) + w * percentile(the previous layer's block scores of this row):
                layers run in order within a step, so when layer l selects, layer l - 1 has scored its kept
                blocks (src = kept: its exact block max there and its own history's prediction elsewhere, as a
                per-layer select would see them; src = all: its exact block max everywhere, the upper bound of
                the signal). Layer 0 has no previous layer: hist. No key bytes: O(blocks) a row.
miss = the share of the row's exact top-k (float scores) in skipped blocks (predictor/miss.py), mean and nearest-rank
p99 over rows past the warm-up. Writes <out>/coarse.csv and <out>/coarse.md.

layers: per-layer budgets at the same mean sparsity (the step saves the same key bytes). hist (with exploration) is
simulated at every sparsity of --menu for every (document, layer); a dynamic program then gives each layer one
menu sparsity so that their mean is --sparsity and the mean miss over the calibration documents is least. Scored
in-sample and across halves of the documents (calibrated on one half, evaluated on the other, both ways).
Writes <out>/layers.json (every row's miss) and <out>/layers.md.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))

import torch  # noqa: E402

from fidelity_bounds import choose, pooled  # noqa: E402
from spin_indexer.eval.calibrate import allocate as calibrate_allocate  # noqa: E402
from spin_indexer.eval.metrics import nearest_rank  # noqa: E402
from spin_indexer.predictor.hybrid import percentile  # noqa: E402
from spin_indexer.predictor.miss import miss_per_row  # noqa: E402
from spin_indexer.predictor.select import budget_of  # noqa: E402

T = 64
ALPHA = 0.5
PROMPTS = os.path.join(HERE, "..", "data", "prompts", "python_stdlib.jsonl")
CONFIGS = ("hist", "coarse-mean", "coarse-sub4", "mix-mean-0.5", "mix-sub4-0.5", "mix-sub4-0.7", "mix-sub8-0.7")


def capture(context: int, rows: int, out: str) -> None:
    from spin_indexer.model import loader
    from spin_indexer.model.indexer_head import Indexer

    model, tok = loader.load_model("cpu", max_len=context + rows)
    indexer = Indexer.load(loader.INDEXER_WEIGHTS, max_len=context + rows)
    saved = {}
    with open(PROMPTS) as f:
        for line in f:
            doc = json.loads(line)
            ids = tok(doc["text"], add_special_tokens=False)["input_ids"][:context + rows]
            if len(ids) < context + rows:
                raise ValueError(f"{doc['id']}: {len(ids)} tokens, fewer than --context + --rows")
            tokens = torch.tensor([ids])
            pos = torch.arange(tokens.shape[1])
            layers = []
            for layer, (h, _, _) in enumerate(model.attention_inputs(tokens)):
                q, w = indexer.layers[layer].queries(h[:, context:], pos[context:], indexer.rope)
                k = indexer.layers[layer].keys(h, pos, indexer.rope)
                layers.append((q[0].half(), w[0].float(), k[0].half()))
            saved[doc["id"]] = layers
            print(f"captured {doc['id']}", flush=True)
    torch.save(dict(context=context, rows=rows, docs=saved), out)


def summary_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, length: int, kind: str) -> torch.Tensor:
    """float32 [nb] summary score of each block of a row of `length` tokens: q [H, D], w [H], keys [>= nb*T, D];
    kind mean / sub<S> (mean keys), bound<S> (channel bounds) or var<S>c<c> (mean keys + c x the spread of
    q . k over each sub-block's tokens from per-channel variances: twice sub<S>'s bytes)."""
    nb = -(-length // T)
    spread = None  # var<S>c<c>: the mean keys' scores + c x the spread of q . k over the sub-block's tokens
    if kind.startswith("var"):
        parts, _, spread = kind.removeprefix("var").partition("c")
        parts, spread = int(parts), float(spread)
    else:
        parts = 1 if kind == "mean" else int(kind.removeprefix("bound").removeprefix("sub"))
    size = T // parts
    valid = (torch.arange(nb * T) < length).view(nb, parts, size)
    if kind.startswith("bound"):
        blocks = keys[:nb * T].view(nb, parts, size, -1)
        kmin = torch.where(valid[..., None], blocks, float("inf")).amin(2)
        kmax = torch.where(valid[..., None], blocks, float("-inf")).amax(2)
        qp, qn = q.clamp(min=0), q.clamp(max=0)
        ub = torch.einsum("hd,bsd->hbs", qp, kmax) + torch.einsum("hd,bsd->hbs", qn, kmin)
        lb = torch.einsum("hd,bsd->hbs", qp, kmin) + torch.einsum("hd,bsd->hbs", qn, kmax)
        scores = torch.where(w[:, None, None] >= 0, ub, lb).relu().mul(w[:, None, None]).sum(0)
    else:
        blocks = keys[:nb * T].view(nb, parts, size, -1) * valid[..., None]
        count = valid.sum(2, keepdim=True).clamp(min=1)
        means = blocks.sum(2) / count
        center = torch.einsum("hd,bsd->hbs", q, means)
        if spread is not None:
            var = (blocks.pow(2).sum(2) / count - means.pow(2)).clamp(min=0)  # per channel
            width = torch.einsum("hd,bsd->hbs", q.pow(2), var).sqrt()
            sign = torch.where(w >= 0, 1.0, -1.0)[:, None, None]  # a negative-weight head's best token: the least
            center = center + sign * spread * width
        scores = center.relu().mul(w[:, None, None]).sum(0)
    return torch.where(valid.any(2), scores, -1e30).amax(1)


def top_scores(q: torch.Tensor, w: torch.Tensor, keys: torch.Tensor, length: int, best: torch.Tensor) -> torch.Tensor:
    """float32 [nb] the best score, with q [H, D] and w [H], of each block's remembered tokens best [nb, m] (token
    indices; -1 or past `length`: none, -1e30)."""
    known = (best >= 0) & (best < length)
    scores = torch.einsum("hd,bmd->hbm", q, keys[best.clamp(min=0)]).relu().mul(w[:, None, None]).sum(0)
    return torch.where(known, scores, -1e30).amax(1)


def standardized(x: torch.Tensor) -> torch.Tensor:
    """(x - mean) / std over the finite-looking entries (> -1e29); the others (never observed) at the minimum."""
    seen = x > -1e29
    if seen.sum() < 2:
        return torch.zeros_like(x)
    v = x[seen]
    z = (x - v.mean()) / v.std().clamp(min=1e-12)
    return torch.where(seen, z, z[seen].min())


def simulate(q, w, keys, context: int, k: int, sparsity: float, config: str, warm: int, gamma: float,
             gen: torch.Generator, prev: list | None = None) -> tuple[list[float], list[dict]]:
    """Per-row misses of one (document, layer) in closed loop (the module docstring), and per row this layer's
    block signals for the next layer's xmix: {"all": exact block max of every block, "kept": exact where kept,
    the history's prediction elsewhere}. prev: the previous layer's (None for layer 0, or for other configs)."""
    q, w, keys = q.float(), w.float(), keys.float()
    n = keys.shape[0]
    keys = torch.nn.functional.pad(keys, (0, 0, 0, -(-n // T) * T - n))
    scores = torch.einsum("rhd,nd->rhn", q, keys[:n]).relu().mul(w[:, :, None]).sum(1)  # [rows, n]
    vertical = torch.full((n + T,), float("nan"))
    diagonal = torch.full((n + T,), float("nan"))  # by offset q - i
    kind, weight, parts = None, None, [config]
    if config != "hist":
        parts = config.split("-")
        kind, weight = parts[1], (1.0 if parts[0] == "coarse" else float(parts[2]))
    top, also = 0, None  # top<m>[+<s>]: m remembered tokens a block (their indices in best), summary s besides
    if kind is not None and kind.startswith("top"):
        top, _, also = kind[3:].partition("+")
        top, also = int(top), also or None
        best = torch.full((-(-n // T), top), -1)
    misses, signals = [], []
    for r in range(q.shape[0]):
        length = context + r + 1
        nb = -(-length // T)
        row = scores[r, :length]
        topk = row.topk(k).indices.int()
        exact = pooled(torch.nn.functional.pad(row, (0, nb * T - length), value=float("nan")), nb, T, "max")
        hist = None
        if r < warm:
            keep = torch.ones(nb, dtype=torch.bool)
        else:
            cols = torch.arange(nb * T)
            aligned = torch.where(cols < length, diagonal[(length - 1 - cols).clamp(min=0)], float("nan"))
            pred = torch.fmax(vertical[:nb * T], aligned)
            hist = pooled(pred, nb, T, "max")  # A1-Max
            if kind is None:
                block = hist
            elif parts[0] == "xmix":
                block = hist if prev is None else (1 - weight) * percentile(hist, torch.ones(nb, dtype=torch.bool)) \
                    + weight * percentile(prev[r][kind][:nb], torch.ones(nb, dtype=torch.bool))
            else:
                if top:
                    summary = top_scores(q[r], w[r], keys, length, best[:nb])
                    if also:
                        summary = torch.maximum(summary, summary_scores(q[r], w[r], keys, length, also))
                else:
                    summary = summary_scores(q[r], w[r], keys, length, kind)
                every = torch.ones(nb, dtype=torch.bool)
                if parts[0] == "zmix":  # standardized scores: two reductions a row instead of two rankings
                    block = (1 - weight) * standardized(hist) + weight * standardized(summary)
                else:
                    block = summary if weight == 1.0 else \
                        (1 - weight) * percentile(hist, every) + weight * percentile(summary, every)
            kept = budget_of(nb, sparsity, k, T)
            explore = int(gamma * kept + 0.5)
            keep = choose(block, kept - explore)[0]
            skipped = (~keep).nonzero().flatten()
            if explore and len(skipped):
                keep[skipped[torch.randperm(len(skipped), generator=gen)[:explore]]] = True
            misses.append(float(miss_per_row(keep[None], topk[None], 1, T)[0]))
        signals.append({"all": exact, "kept": exact if hist is None else torch.where(keep, exact, hist)})
        if top:  # the kept blocks' best tokens this row
            padded = torch.full((nb * T,), float("-inf"))
            padded[:length] = row
            idx = padded.view(nb, T).topk(top, dim=1).indices + torch.arange(nb)[:, None] * T
            best[:nb][keep.flatten()] = idx[keep.flatten()]
        seen = torch.arange(length)[keep.repeat_interleave(T)[:length]]
        s = row[seen]
        vertical[seen] = torch.where(torch.isnan(vertical[seen]), s, ALPHA * s + (1 - ALPHA) * vertical[seen])
        offsets = length - 1 - seen
        diagonal[offsets] = torch.where(torch.isnan(diagonal[offsets]), s,
                                        ALPHA * s + (1 - ALPHA) * diagonal[offsets])
    return misses, signals


def layer_means(miss: dict, docs: list, menu: list) -> torch.Tensor:
    """float64 [M, L]: each layer's mean miss over the rows of docs at each menu sparsity (miss[doc][layer][i]:
    that layer's per-row misses at menu[i])."""
    layers = len(miss[docs[0]])
    return torch.tensor([[sum(sum(miss[d][layer][i]) for d in docs) / sum(len(miss[d][layer][i]) for d in docs)
                          for layer in range(layers)] for i in range(len(menu))], dtype=torch.float64)


def allocate(miss: dict, docs: list, menu: list, sparsity: float) -> list[int]:
    """Menu index per layer (mean sparsity = sparsity, on the menu's grid) minimizing the mean miss of docs
    (eval.calibrate.allocate over layer_means)."""
    return calibrate_allocate(layer_means(miss, docs, menu), menu, sparsity)


def layer_budgets(data: dict, args) -> None:
    menu = sorted(args.menu)
    if any(abs((b - a) - (menu[1] - menu[0])) > 1e-9 for a, b in zip(menu, menu[1:])):
        raise SystemExit(f"--menu: expected evenly spaced sparsities, got {menu}")
    miss = {}
    for doc, layers in data["docs"].items():
        miss[doc] = []
        for layer, (q, w, keys) in enumerate(layers):
            per = []
            for s in menu:
                gen = torch.Generator().manual_seed(layer)
                per.append(simulate(q, w, keys, data["context"], args.k, s, "hist", args.warm, args.gamma, gen)[0])
            miss[doc].append(per)
        print(f"simulated {doc}", flush=True)
    docs = list(miss)
    layers = len(miss[docs[0]])
    uniform = min(range(len(menu)), key=lambda i: abs(menu[i] - args.sparsity))

    def score(eval_docs, choice):
        m = torch.tensor([x for d in eval_docs for layer in range(layers) for x in miss[d][layer][choice[layer]]])
        return float(m.mean()), nearest_rank(m, 0.99)

    rows = []
    for name, cal, ev in (("in-sample", docs, docs), ("first half -> second", docs[0::2], docs[1::2]),
                          ("second half -> first", docs[1::2], docs[0::2])):
        choice = allocate(miss, cal, menu, args.sparsity)
        rows.append(dict(split=name, uniform=score(ev, [uniform] * layers), allocated=score(ev, choice),
                         sparsities=[menu[i] for i in choice]))
        print(f"{name}: uniform {rows[-1]['uniform']}, allocated {rows[-1]['allocated']}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "layers.json"), "w") as f:
        json.dump(dict(context=data["context"], k=args.k, menu=menu, sparsity=args.sparsity, miss=miss, rows=rows),
                  f)
    per_layer = layer_means(miss, docs, menu)[uniform].tolist()
    lines = [f"# Per-layer budgets at mean sparsity {args.sparsity:g} ({data['context']} tokens, k = {args.k})", "",
             f"`python benchmarks/coarse_blocks_sim.py {' '.join(sys.argv[1:])}`", "",
             f"Mean miss a layer at uniform {menu[uniform]:g} (%): " + " ".join(f"{100 * x:.1f}" for x in per_layer),
             "",
             "| calibrated -> evaluated | uniform mean / p99 | per-layer mean / p99 | sparsity a layer |",
             "|---|---|---|---|"]
    lines += [f"| {r['split']} | {100 * r['uniform'][0]:.2f} / {100 * r['uniform'][1]:.2f} | "
              f"{100 * r['allocated'][0]:.2f} / {100 * r['allocated'][1]:.2f} | "
              f"{' '.join(f'{x:g}' for x in r['sparsities'])} |" for r in rows]
    with open(os.path.join(args.out, "layers.md"), "w") as f:
        f.write("\n".join(lines) + "\n")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("capture")
    c.add_argument("--context", type=int, default=4096)
    c.add_argument("--rows", type=int, default=32)
    c.add_argument("--out", required=True)
    s = sub.add_parser("sim")
    s.add_argument("--qk", required=True)
    s.add_argument("--k", type=int, default=256)
    s.add_argument("--sparsity", type=float, default=0.4)
    s.add_argument("--warm", type=int, default=8)
    s.add_argument("--gamma", type=float, default=0.05)
    s.add_argument("--configs", nargs="+", default=list(CONFIGS))
    s.add_argument("--out", required=True)
    y = sub.add_parser("layers")
    y.add_argument("--qk", required=True)
    y.add_argument("--k", type=int, default=256)
    y.add_argument("--sparsity", type=float, default=0.4, help="the mean sparsity over the layers")
    y.add_argument("--menu", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7])
    y.add_argument("--warm", type=int, default=8)
    y.add_argument("--gamma", type=float, default=0.05)
    y.add_argument("--out", required=True)
    args = p.parse_args(argv)
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    if args.cmd == "capture":
        capture(args.context, args.rows, args.out)
        return 0
    data = torch.load(args.qk)
    if args.cmd == "layers":
        layer_budgets(data, args)
        return 0
    table = []
    for config in args.configs:
        gen = torch.Generator().manual_seed(0)
        misses = []
        for layers in data["docs"].values():
            prev = None  # layers in order: xmix reads the previous layer's signals of the same rows
            for q, w, keys in layers:
                rows, prev = simulate(q, w, keys, data["context"], args.k, args.sparsity, config, args.warm,
                                      args.gamma, gen, prev)
                misses += rows
        m = torch.tensor(misses)
        table.append(dict(config=config, sparsity=args.sparsity, k=args.k, mean_miss=float(m.mean()),
                          p99_miss=nearest_rank(m, 0.99), rows=len(misses)))
        print(f"{config:16s} {table[-1]['mean_miss']:.2%} {table[-1]['p99_miss']:.2%}", flush=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "coarse.csv"), "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows(table)
    command = "python benchmarks/coarse_blocks_sim.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [f"# Closed-loop block choice with block key summaries ({data['context']} tokens, k = {args.k})", "",
             f"`{command}`", "", "| config | sparsity | mean miss | p99 miss | rows |", "|---|---|---|---|---|"]
    lines += [f"| {r['config']} | {r['sparsity']:.0%} | {r['mean_miss']:.2%} | {r['p99_miss']:.2%} | {r['rows']} |"
              for r in table]
    with open(os.path.join(args.out, "coarse.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
