"""Hit rate of the top-k threshold's tau hint on real decoding (proxy model, shipped lightning indexer head).

    PYTHONPATH=src python benchmarks/tau_hint_hits.py --out benchmarks/results/tau_hint_hits

What is hinted (ops/topk_triton.py, v1 chain, `_threshold_kernel`): per row, the threshold searches the
group maxima S_g of G = topk_group(C, k) columns (C = the logits' width, W x 64; the row's first
n_valid = ceil(length / G) groups) for the largest 16-bit t with count(hi16(ukey(S_g)) >= t) >= k, i.e. t =
the upper 16 bits of the order-preserving uint32 key (`_ukey`) of the k-th largest group maximum. Only where
n_valid >= k (else tau = 0: no search, the hint is neither read nor written) and, for reading, n_valid <= the
register tile (16384). The hint is the row's t of the last call that searched; a call hits when its t lies in
[h - 32, h + 32] (TAU_HINT_RADIUS): 1 packed count + 7 bisection counts; a miss costs 1 + 16; no hint 16.

This script decodes greedily with the proxy model (all-keep "dense" indexer: every block scored, and SPIN's
SpinIndexer at sparsity 0.5 whose top-k sees the compact columns; both on the CPU torch references), computes
t in torch for every (layer, step, row) and k in --ks, replays the hint state exactly as the kernel keeps it
(per layer and batch row, zero-initialised as Workspace.tau_hint), and reports the share of hits among the
searches of steps >= 1 plus the distribution of |t - hint|. --verify checks the torch key against the Triton
kernel itself (TRITON_INTERPRET=1 on the CPU) on sampled rows.
"""
from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import json
import os
import platform
import sys
import time
from pathlib import Path

import torch

if "TRITON_INTERPRET" not in os.environ and not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # the kernel check (--verify) runs in the interpreter; CPU ops never use Triton

from spin_indexer import ops  # noqa: E402
from spin_indexer.ops.topk import group_max_ref, monotone_bits, topk_group  # noqa: E402

TAU_HINT_RADIUS = 32  # = ops.topk_triton.TAU_HINT_RADIUS (not imported: that module needs triton)
TILE_MAX = 16384  # = THRESHOLD_TILE_MAX: the hint is read only where the row's group maxima fit one tile
COUNTS_HIT, COUNTS_MISS, COUNTS_PLAIN = 1 + 7, 1 + 16, 16
GROUPS = (1, 2, 4, 8, 16, 32, 64)  # the G sweep (secondary table): the key at a fixed group size
RADII = (8, 16, 32, 64, 128, 256, 512)  # the radius sweep: a hit costs 1 + bit_length(2R) counts


def hi16(x: torch.Tensor) -> torch.Tensor:
    """int64: the upper 16 bits of `_ukey(x)` (fp32 -> order-preserving uint32; -0.0 -> +0.0, NaN -> +NaN)."""
    return (monotone_bits(x).long() + (1 << 31)) >> 16


def threshold_keys(logits: torch.Tensor, lengths: torch.Tensor, k: int, group: int) -> torch.Tensor:
    """int64 [R]: the 16-bit key `_threshold_kernel` finds for each row (-1 where n_valid < k: no search)."""
    gm = group_max_ref(logits, lengths, group)
    n_valid = (lengths.long() + group - 1) // group
    top = torch.where(torch.arange(gm.shape[1])[None, :] < n_valid[:, None], hi16(gm), -1)
    kk = min(k, top.shape[1])
    t = torch.topk(top, kk, dim=1).values[:, -1]  # the k-th largest key: largest t with count(>= t) >= k
    return torch.where(n_valid >= k, t, -1)


def key_record(logits, lengths, cols: int, ks) -> dict:
    """{(k, G): int64 [R] keys} for the kernel's G (G = 0 in the key) and the G sweep."""
    out = {}
    for k in ks:
        out[(k, 0)] = threshold_keys(logits, lengths, k, topk_group(cols, k))
        for g in GROUPS:
            out[(k, g)] = threshold_keys(logits, lengths, k, g)
    return out


# -- prompts ---------------------------------------------------------------------------------------------
def prompt_ids(spec: str, context: int, tok) -> tuple[str, list[int], dict]:
    """spec: ruler:<task>:<seed> or file:<path>:<doc id>. returns (name, ids, info)."""
    kind, a, b = spec.split(":", 2)
    if kind == "ruler":
        from spin_indexer.model import ruler
        text, answers = ruler.make_prompt(a, context, int(b), tok)
        ids = tok(text).input_ids
        return f"{a}_s{b}", ids, {"source": "RULER", "task": a, "seed": int(b), "answers": answers}
    from spin_indexer.traces.prompt_file import fit_tokens, read_prompt_file
    doc = next(d for d in read_prompt_file(a) if d.doc_id == b)
    full = tok(doc.text).input_ids
    ids, cut = fit_tokens(full, context, "cut", b)
    return f"{Path(a).stem}_{b}", ids, {"source": a, "doc_id": b, "text_sha256": doc.sha256, "cut": cut}


# -- decoding --------------------------------------------------------------------------------------------
@contextlib.contextmanager
def record_spin_topk(sink: list):
    """Wraps ops.topk_positions (SpinIndexer._topk calls it by attribute) to see SPIN's compact logits."""
    orig = ops.topk_positions

    def wrapped(logits, lengths, k, *args, **kw):
        sink.append((logits.detach().clone(), lengths.detach().clone()))
        return orig(logits, lengths, k, *args, **kw)

    ops.topk_positions = wrapped
    try:
        yield
    finally:
        ops.topk_positions = orig


def decode(model, indexer, ids, steps: int, variant: str, k_attn: int, ks, sparsity: float, seed: int,
           prefilled=None):
    """Greedy decode `steps` steps; returns (keys {(k, G): int64 [steps, L]}, info, prefilled caches)."""
    from spin_indexer.model.decode import Caches, decode_one_step, prefill

    num_layers = model.cfg.num_layers
    prompt = torch.tensor(ids, dtype=torch.int64)
    if prefilled is None:
        caches = Caches.allocate(model, 1, len(ids) + steps, indexer)
        t0 = time.time()
        first = prefill(model, caches, 0, prompt, indexer)
        prefilled = (caches, first, time.time() - t0)
    base, first, _ = prefilled
    caches = Caches([k.clone() for k in base.k], [v.clone() for v in base.v], [c.clone() for c in base.index_kv],
                    base.block_table.clone(), base.lengths.clone(), base.slot_ids.clone())
    cols = caches.block_table.shape[1] * 64  # the logits' width on the GPU (W x T) -> topk_group
    keys = {}
    widths = set()
    sink = []
    selector = None
    if variant == "spin":
        from spin_indexer.indexer import SpinIndexer
        from spin_indexer.predictor.config import SpinConfig
        selector = SpinIndexer(SpinConfig(sparsity=sparsity, topk=k_attn, seed=seed), num_layers=num_layers,
                               max_batch=1, max_blocks=caches.block_table.shape[1], device="cpu")
        caches.slot_ids[0] = selector.state.allocate()
    step = [0]
    lens_seen = []
    sample = {}  # the kernel check's rows: layers 0, L/2, L-1 of the last step

    def store(layer, logits, lengths):
        widths.add(int(logits.shape[1]))
        if step[0] == steps - 1 and layer in (0, num_layers // 2, num_layers - 1):
            sample[layer] = (logits[:1].clone(), lengths[:1].clone())
        for key, val in key_record(logits, lengths, cols, ks).items():
            keys.setdefault(key, torch.full((steps, num_layers, val.shape[0]), -1, dtype=torch.int64))
            keys[key][step[0], layer] = val
        if layer == 0:
            lens_seen.append(int(lengths[0]))

    def observer(layer, scores, topk, _inputs):  # dense (all-keep) scores of every cached position
        store(layer, scores, (caches.lengths + 1).to(torch.int32).expand(scores.shape[0]).contiguous())

    logits = first
    generated = []
    t0 = time.time()
    ctx = record_spin_topk(sink) if selector is not None else contextlib.nullcontext()
    with ctx:
        for s in range(steps):
            step[0] = s
            nxt = int(logits.argmax(-1).reshape(-1)[-1])
            generated.append(nxt)
            tok = torch.tensor([[nxt]], dtype=torch.int64)
            if selector is None:
                out = decode_one_step(model, caches, tok, "lightning", k_attn, indexer, observer=observer)
            else:
                sink.clear()
                out = decode_one_step(model, caches, tok, "lightning", k_attn, indexer, selector=selector)
                assert len(sink) == num_layers, len(sink)
                for layer, (lg, ln) in enumerate(sink):
                    store(layer, lg, ln)
            logits = out[0, -1]
    info = {"decode_s": time.time() - t0, "logits_widths": sorted(widths), "cols": cols,
            "row_len_first": lens_seen[0], "row_len_last": lens_seen[-1], "generated": generated,
            "sample": (torch.cat([sample[l][0] for l in sorted(sample)]).contiguous(),
                       torch.cat([sample[l][1] for l in sorted(sample)]).contiguous())}
    return keys, info, prefilled


# -- hit statistics --------------------------------------------------------------------------------------
def key_value(key: torch.Tensor) -> torch.Tensor:
    """float32: the lower edge of 16-bit key `key` (the threshold value tau = key << 16, as a float)."""
    u = key.long() << 16
    b = torch.where(u >= 0x80000000, u ^ 0x80000000, u ^ 0xFFFFFFFF)
    return torch.where(b >= 2**31, b - 2**32, b).to(torch.int32).view(torch.float32)


def hint_replay(keys: torch.Tensor, n_valid_ok: torch.Tensor | None = None):
    """keys int64 [S, L, R] (-1: no search that step). The kernel's hint per (layer, row): 0 at first, then the
    key of the last search. returns (searches [S, L, R] bool, delta int64 [S, L, R] = |key - hint|, -1 where no
    search; with the sign bit of the key (0x8000: the threshold value >= +0.0) differing from the hint's: -2)."""
    hint = torch.zeros(keys.shape[1:], dtype=torch.int64)
    deltas = torch.full(keys.shape, -1, dtype=torch.int64)
    for s in range(keys.shape[0]):
        searched = keys[s] >= 0
        flip = (keys[s] >> 15) != (hint >> 15)
        deltas[s] = torch.where(searched, (keys[s] - hint).abs(), -1)
        deltas[s] = torch.where(searched & flip, -2 - deltas[s], deltas[s])  # encoded: -2 - |delta|
        hint = torch.where(searched, keys[s], hint)
    return keys >= 0, deltas


def summarize(deltas: torch.Tensor, searched: torch.Tensor) -> dict:
    """Over steps >= 1 (step 0's hint is the workspace's zero or another request's key)."""
    d = deltas[1:][searched[1:]].double()
    flips = d < -1
    d = torch.where(flips, -2 - d, d)
    n = int(searched[1:].numel())
    if d.numel() == 0:
        return {"pairs": n, "searches": 0, "hits": 0, "hit_rate": float("nan"), **{f"p{q}": float("nan") for q in
                (50, 75, 90, 95, 99)}, "max": float("nan"), "zero_share": float("nan"), "sign_flip_share": float("nan"),
                "mean_counts": float("nan")}
    hits = int((d <= TAU_HINT_RADIUS).sum())
    h = hits / d.numel()
    qs = torch.quantile(d, torch.tensor([0.5, 0.75, 0.9, 0.95, 0.99], dtype=torch.float64)).tolist()
    return {"pairs": n, "searches": int(d.numel()), "hits": hits, "hit_rate": h,
            **{f"p{q}": v for q, v in zip((50, 75, 90, 95, 99), qs)}, "max": float(d.max()),
            "zero_share": float((d == 0).double().mean()), "sign_flip_share": float(flips.double().mean()),
            "mean_counts": COUNTS_HIT * h + COUNTS_MISS * (1 - h)}


# -- kernel check ----------------------------------------------------------------------------------------
def verify(samples: list, ks) -> list[str]:
    """The Triton kernel's written hint (interpreter on the CPU) == the torch key, on sampled rows; also a
    hint far off must not change it (a hint never changes the key)."""
    from spin_indexer.ops.topk_triton import TAU_HINT_RADIUS as R, topk_triton
    assert R == TAU_HINT_RADIUS, R
    lines = []
    for name, logits, lengths in samples:
        cols = logits.shape[1]
        for k in ks:
            want = threshold_keys(logits, lengths, k, topk_group(cols, k))
            starts = {"hint = key": want.clamp_min(0).to(torch.int32), "hint = 123": torch.full_like(lengths, 123),
                      "hint = key + 40": want.clamp_min(0).to(torch.int32) + 40}
            for label, start in starts.items():
                hint = start.clone().contiguous()
                topk_triton(logits, lengths, k, tau_hint=hint, _stages=2)
                got = torch.where(want >= 0, hint.long(), -1)
                ok = bool((got == want).all())
                lines.append(f"{name} k={k} G={topk_group(cols, k)} rows={logits.shape[0]} ({label}): kernel hint "
                             f"{'==' if ok else '!='} torch key ({want.tolist()[:4]}...)")
                if not ok:
                    raise AssertionError(lines[-1] + f" kernel {got.tolist()}")
    return lines


# -- main ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", type=Path, default=Path("benchmarks/results/tau_hint_hits"))
    p.add_argument("--contexts", default="4096,8192")
    p.add_argument("--prompts", default="ruler:niah_single_2:0,ruler:qa_1:0,file:data/prompts/python_stdlib.jsonl:email,"
                                        "file:data/prompts/python_stdlib.jsonl:asyncio",
                   help="comma-separated ruler:<task>:<seed> | file:<jsonl>:<doc id>")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--ks", default="256,512,2048")
    p.add_argument("--k-attn", type=int, default=2048, help="top-k of the decode's sparse attention (and SPIN's topk)")
    p.add_argument("--variants", default="dense,spin")
    p.add_argument("--sparsity", type=float, default=0.5)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--no-verify", action="store_true")
    p.add_argument("--from-keys", action="store_true", help="only rebuild the tables and README from --out's keys.pt")
    args = p.parse_args(argv)
    if args.from_keys:
        return _from_keys(args.out)
    torch.set_num_threads(args.threads)
    ks = [int(x) for x in args.ks.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    specs = [s for s in args.prompts.split(",") if s]
    variants = [v for v in args.variants.split(",") if v]
    args.out.mkdir(parents=True, exist_ok=True)
    from spin_indexer.model.indexer_head import Indexer
    from spin_indexer.model.loader import GGUF_NAME, INDEXER_WEIGHTS, find_gguf, load_model, yarn_factor_for

    t_start = time.time()
    gguf = find_gguf()
    meta = {"command": "PYTHONPATH=src python " + " ".join([sys.argv[0]] + (argv if argv is not None else sys.argv[1:])),
            "gguf": str(gguf.name) if gguf else GGUF_NAME,
            "gguf_sha256": hashlib.sha256(gguf.read_bytes()).hexdigest() if gguf else None,
            "indexer_weights_sha256": hashlib.sha256(Path(INDEXER_WEIGHTS).read_bytes()).hexdigest(),
            "torch": torch.__version__, "python": platform.python_version(), "threads": args.threads,
            "steps": args.steps, "ks": ks, "k_attn": args.k_attn, "sparsity": args.sparsity, "runs": []}
    all_keys = {}  # (variant, context, prompt) -> {(k, G): [S, L, R]}
    samples = []
    for context in contexts:
        factor = yarn_factor_for(context + args.steps)  # as `spin-indexer capture`
        model, tok = load_model("cpu", torch.float32, max_len=context + args.steps, yarn_factor=factor)
        indexer = Indexer.load(INDEXER_WEIGHTS, context + args.steps, factor, "cpu")
        for spec in specs:
            name, ids, info = prompt_ids(spec, context, tok)
            prefilled = None
            for variant in variants:
                t0 = time.time()
                keys, dinfo, prefilled = decode(model, indexer, ids, args.steps, variant, args.k_attn, ks,
                                                args.sparsity, 0, prefilled)
                all_keys[(variant, context, name)] = (keys, dinfo["cols"])
                samples.append((f"{variant}/{name}@{context}", *dinfo.pop("sample")))
                text = tok.decode(dinfo.pop("generated"), skip_special_tokens=True)
                run = {"variant": variant, "context": context, "prompt": name, "prompt_tokens": len(ids),
                       "yarn_factor": factor, "prefill_s": round(prefilled[2], 1), "decode_s": round(dinfo.pop("decode_s"), 1),
                       **dinfo, **info, "generated": text[:120]}
                meta["runs"].append(run)
                print(json.dumps({k: v for k, v in run.items() if k != "answers"}), flush=True)
        del model, indexer
    torch.save({f"{v}|{c}|{n}": {f"k{k}_G{g}": t.to(torch.int32) for (k, g), t in keys.items()} for (v, c, n), (keys, _) in
                all_keys.items()}, args.out / "keys.pt")
    checks = []
    if not args.no_verify:
        checks = verify(samples, ks)
        print("\n".join(checks), flush=True)
    meta["kernel_check"] = checks
    meta["total_s"] = round(time.time() - t_start, 1)
    (args.out / "meta.json").write_text(json.dumps(meta, indent=1, default=str))
    _write_tables(args.out, meta, all_keys, ks)
    print(f"done in {meta['total_s']} s -> {args.out}")
    return 0


def _write_tables(out: Path, meta: dict, all_keys: dict, ks) -> None:
    rows, layer_rows, sweep_rows, radius_rows = _tables(all_keys, ks)
    _write_csv(out / "hits.csv", rows)
    _write_csv(out / "hits_by_layer.csv", layer_rows)
    _write_csv(out / "g_sweep.csv", sweep_rows)
    _write_csv(out / "radius_sweep.csv", radius_rows)
    _readme(out, meta, rows, layer_rows, sweep_rows, radius_rows)


def _from_keys(out: Path) -> int:
    """Rebuild the tables and README from a run's keys.pt + meta.json (no decoding)."""
    meta = json.loads((out / "meta.json").read_text())
    cols = {(r["variant"], r["context"], r["prompt"]): r["cols"] for r in meta["runs"]}
    all_keys = {}
    for name, keys in torch.load(out / "keys.pt").items():
        v, c, n = name.split("|", 2)
        parsed = {}
        for kname, t in keys.items():
            k, g = kname[1:].split("_G")
            parsed[(int(k), int(g))] = t.long()
        all_keys[(v, int(c), n)] = (parsed, cols[(v, int(c), n)])
    _write_tables(out, meta, all_keys, meta["ks"])
    print(f"tables rebuilt from {out / 'keys.pt'}")
    return 0


def _tables(all_keys, ks):
    """hits.csv rows (per run and ALL per variant x context and variant), per-layer rows, G-sweep rows."""
    rows, layer_rows, sweep_rows, radius_rows = [], [], [], []
    groups = {}
    for (variant, context, name), (keys, cols) in all_keys.items():
        for k in ks:
            searched, delta = hint_replay(keys[(k, 0)])
            g = topk_group(cols, k)
            for ctx in (context, "all"):
                groups.setdefault((variant, ctx, k), []).append((searched, delta, g, keys[(k, 0)]))
            rows.append({"variant": variant, "context": context, "prompt": name, "k": k, "G": g,
                         **summarize(delta, searched)})
            for gs in GROUPS:
                s2, d2 = hint_replay(keys[(k, gs)])
                groups.setdefault(("sweep", variant, context, k, gs), []).append((s2, d2, g))
    for key, parts in groups.items():
        searched = torch.cat([p[0] for p in parts], dim=2)  # rows of different runs side by side
        delta = torch.cat([p[1] for p in parts], dim=2)
        kernel_g = "/".join(str(g) for g in sorted({p[2] for p in parts}))
        if key[0] == "sweep":
            _, variant, context, k, gs = key
            sweep_rows.append({"variant": variant, "context": context, "k": k, "G": gs, "kernel_G": kernel_g,
                               **summarize(delta, searched)})
            continue
        variant, context, k = key
        rows.append({"variant": variant, "context": context, "prompt": "ALL", "k": k, "G": kernel_g,
                     **summarize(delta, searched)})
        d = delta[1:][searched[1:]]
        d = torch.where(d < -1, -2 - d, d)
        for r in RADII:
            h = float((d <= r).double().mean())
            c = 1 + (2 * r).bit_length()
            radius_rows.append({"variant": variant, "context": context, "k": k, "radius": r, "counts_per_hit": c,
                                "hit_rate": h, "mean_counts": c * h + COUNTS_MISS * (1 - h)})
        if context == "all":
            continue
        tau = key_value(torch.cat([p[3] for p in parts], dim=2))
        for layer in range(delta.shape[1]):
            sm = summarize(delta[:, layer:layer + 1], searched[:, layer:layer + 1])
            t = tau[1:, layer][searched[1:, layer]]
            layer_rows.append({"variant": variant, "context": context, "k": k, "layer": layer, "searches": sm["searches"],
                               "hit_rate": sm["hit_rate"], "p50": sm["p50"], "p90": sm["p90"], "max": sm["max"],
                               "sign_flip_share": sm["sign_flip_share"],
                               "tau_median": float(t.median()) if t.numel() else float("nan"),
                               "tau_abs_median": float(t.abs().median()) if t.numel() else float("nan")})
    order = {"dense": 0, "spin": 1}
    rows.sort(key=lambda r: (order.get(r["variant"], 9), r["context"] == "all", str(r["context"]), r["k"],
                             r["prompt"] == "ALL"))
    return rows, layer_rows, sweep_rows, radius_rows


def _write_csv(path: Path, rows: list[dict]) -> None:
    if not rows:
        return
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        for r in rows:
            w.writerow({k: (f"{v:.4f}" if isinstance(v, float) else v) for k, v in r.items()})


def _pct(v):
    return "-" if v != v else f"{v * 100:.1f}%"


def _fmt(v, nd=1):
    return "-" if v != v else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def _readme(out: Path, meta: dict, rows: list[dict], layer_rows: list[dict], sweep_rows: list[dict],
            radius_rows: list[dict]) -> None:
    lines = ["# tau_hint hit rate on real decoding (proxy model)", "",
             "```", meta["command"], "```", "",
             f"Model {meta['gguf']} (sha256 {str(meta['gguf_sha256'])[:12]}...), lightning indexer head "
             f"src/spin_indexer/weights/smollm2_indexer.safetensors (sha256 {meta['indexer_weights_sha256'][:12]}...); "
             f"CPU, torch {meta['torch']}, {meta['threads']} threads, {meta['total_s']:.0f} s in all. "
             f"{meta['steps']} greedy decode steps per prompt, attention over each layer's top-{meta['k_attn']}; "
             f"variants: dense = all-keep (every block scored), spin = SpinIndexer(sparsity {meta['sparsity']}, "
             f"topk {meta['k_attn']}) whose top-k sees the compact columns. 30 layers x 1 row per run.", "",
             "Key (as `_threshold_kernel` computes it): upper 16 bits of `_ukey` of the k-th largest group max, "
             "G = topk_group(C, k), C = W x 64 the logits' width; searched only where ceil(len / G) >= k. "
             "Hint replayed as the kernel keeps it (per layer and row, 0 at first, last searched key). "
             "Hit: |key - hint| <= 32. Statistics over steps >= 1 (step 0 is a cold miss). 'sign flip': the threshold value "
             "changed sign since the hint (|delta| ~ 32K). "
             f"mean_counts = {COUNTS_HIT} x hit + {COUNTS_MISS} x miss (vs {COUNTS_PLAIN} without the hint).", "",
             "## Runs", "", "| variant | context | prompt | prompt tokens | YaRN | cols C | row len (first..last) | prefill s | decode s | generated |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in meta["runs"]:
        lines.append(f"| {r['variant']} | {r['context']} | {r['prompt']} | {r['prompt_tokens']} | {r['yarn_factor']:g} | "
                     f"{r['cols']} | {r['row_len_first']}..{r['row_len_last']} | {r['prefill_s']} | {r['decode_s']} | "
                     f"{r['generated'][:50]!r} |")
    lines += ["", "## Hit rates (kernel G)", "",
              "| variant | context | prompt | k | G | searches | hit rate | p50 | p75 | p90 | p95 | p99 | max | delta=0 | sign flip | mean counts |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {r['context']} | {r['prompt']} | {r['k']} | {r['G']} | {r['searches']}/{r['pairs']} | "
                     f"{_fmt(r['hit_rate'] * 100 if r['hit_rate'] == r['hit_rate'] else float('nan'))}% | "
                     + " | ".join(_fmt(r[q], 0) for q in ("p50", "p75", "p90", "p95", "p99", "max"))
                     + f" | {_pct(r['zero_share'])} | {_pct(r['sign_flip_share'])} | "
                       f"{_fmt(r['mean_counts'], 2)} |")
    lines += ["", "## Radius sweep (what TAU_HINT_RADIUS = R would give on the same keys; a hit costs 1 + "
              "bit_length(2R) counts, a miss 17, no hint 16)", "",
              "| variant | context | k | " + " | ".join(f"R={r}" for r in RADII) + " |",
              "|---|---|---|" + "---|" * len(RADII)]
    for key in sorted(dict.fromkeys((r["variant"], r["context"], r["k"]) for r in radius_rows),
                      key=lambda t: (t[0], t[1] == "all", str(t[1]), t[2])):
        cells = [r for r in radius_rows if (r["variant"], r["context"], r["k"]) == key]
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(
            f"{c['hit_rate'] * 100:.0f}% / {c['mean_counts']:.2f}" for c in cells) + " |")
    lines += ["", "(hit rate / mean counts per threshold search)"]
    lines += ["", "## By layer (kernel G, all prompts of the context; layers 0..29)", "",
              "Hit rate % per layer, then the median threshold value tau (float at the key's lower edge) per layer:", ""]
    for r in layer_rows:
        if r["layer"] == 0:
            hits = [x for x in layer_rows if (x["variant"], x["context"], x["k"]) == (r["variant"], r["context"], r["k"])]
            lines.append(f"- {r['variant']} {r['context']} k={r['k']}: hit % " + " ".join(
                "-" if x["hit_rate"] != x["hit_rate"] else f"{x['hit_rate'] * 100:.0f}" for x in hits))
            lines.append(f"  median tau " + " ".join(f"{x['tau_median']:.2g}" for x in hits))
    lines += ["", "## G sweep (the key at a fixed group size, where ceil(len / G) >= k; all prompts)", "",
              "| variant | context | k | G (kernel G) | searches | hit rate | p50 | p90 | p99 |", "|---|---|---|---|---|---|---|---|---|"]
    for r in sweep_rows:
        if r["searches"]:
            lines.append(f"| {r['variant']} | {r['context']} | {r['k']} | {r['G']} ({r['kernel_G']}) | {r['searches']} | "
                         f"{_fmt(r['hit_rate'] * 100)}% | {_fmt(r['p50'], 0)} | {_fmt(r['p90'], 0)} | {_fmt(r['p99'], 0)} |")
    if meta.get("kernel_check"):
        lines += ["", "## Kernel check (Triton `_threshold_kernel` via topk_triton(_stages=2, tau_hint=...), "
                  "interpreter on the CPU: the hint it writes back equals the torch key, from a hint equal / far / +40)", ""]
        lines += [f"- {c}" for c in meta["kernel_check"]]
    lines += ["", "Files: hits.csv (this table), hits_by_layer.csv, g_sweep.csv, radius_sweep.csv, keys.pt (every key: "
              "'variant|context|prompt' -> 'k<k>_G<G>' int32 [steps, layers, rows], G0 = kernel G, -1 = no search), "
              "meta.json (runs, generated text)."]
    (out / "README.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
