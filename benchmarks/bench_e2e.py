"""End-to-end batched greedy decoding of the proxy model (SmolLM2-135M + the distilled lightning indexer) with
every decode step captured in one CUDA graph: output tokens/s and inter-token latency, all-keep vs SPIN.

What one step is: 30 layers of DSA-style sparse decoding (model/decode.py): FP8 indexer keys written to the
paged cache, the indexer scoring, Triton top-k, attention over the top-k tokens only, then the greedy token fed
back on the device. Prefill is dense and untimed. The scoring by config: `dense` (the default baseline) is the
library's dense step (DenseIndexer: every cached token, block maxima fused into the logits kernel, the top-k set
in no particular order, as the engines take it); `spin-<s>` SpinIndexer's step with SpinConfig's defaults (plan +
predict + select + logits over the kept blocks + EMA update, the same unordered top-k); `all-keep` the model's own
path before `dense` existed (logits, then ops.topk best first; `spin-<s>-slot-sorted` is SPIN's step in the same
form: the e2e runs up to run 125 compared those two).

Batches are filled from a few distinct prefilled prompts (RULER niah, from the prompt cache) whose caches
are copied to the other requests: prefilling 96 x 32K tokens one by one would cost minutes of device time
and does not change the decode cost (same lengths, same kept budget). SPIN's first step after prefill scores
every block (no history); we run warm-up steps eagerly first, so the timed steps are steady-state.

    PYTHONPATH=src:benchmarks SPIN_INDEXER_PROMPT_CACHE=runs/prompts python3 benchmarks/bench_e2e.py --out DIR
Without the GGUF (the GPU box: it does not fit a device call), `--random-weights` times the same shapes with
random weights and the shipped indexer head (random prompts; the agreement column then means nothing).
`--indexer-shape 64x128` (with --random-weights or --tiny) swaps the head for a random one of that many heads x
dims: the shipped head is 4 x 64 (68 bytes a cached token), the DSA models' indexer 64 x 128 (132 bytes), so the
indexer's share of a step, which bounds what SPIN can save end to end, is that of the models SPIN is for. Its
cache adds 64 bytes a token a layer: at 96 x 32K the model's and the indexer's caches then take ~85 GB (an H200's
point; an H100 holds 64 requests). Its projections run in the model's dtype (bf16 on CUDA, as the DSA models';
`--indexer-dtype float32`: the form runs 165-168 timed, whose float32 GEMMs cost ~29 us a layer at 64 requests).
Dry run of the code paths on a CPU (tiny random model, no graphs, nothing timed):
    SPIN_BENCH_DEVICE=cpu TRITON_INTERPRET=1 python3 benchmarks/bench_e2e.py --tiny --points 2x256 --steps 2

Writes DIR/h200_e2e.csv (model,config,batch,context,tokens_per_s,median_itl_ms), DIR/h200_e2e_detail.csv
(+ p20/p80 ITL, realized sparsity, agreement of the greedy tokens with the first config's: column
agree_all_keep, named from when all-keep was always first) and DIR/h200_e2e_env.json.
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from harness import DEVICE, environment, quantile

from spin_indexer.model.decode import Caches, decode_one_step, prefill

COLUMNS = ("model", "config", "batch", "context", "tokens_per_s", "median_itl_ms")
DETAIL = COLUMNS + ("p20_itl_ms", "p80_itl_ms", "steps", "realized_sparsity", "agree_all_keep", "topk",
                    "distinct_prompts")


def log(*a):
    print(*a, flush=True)


def parse_points(text: str) -> list[tuple[int, int]]:
    """'32x16384,96x32768' -> [(32, 16384), (96, 32768)]"""
    points = []
    for part in text.split(","):
        b, _, c = part.strip().partition("x")
        if not (b.isdigit() and c.isdigit()):
            raise SystemExit(f"--points: expected BATCHxCONTEXT[,...], got {part!r}")
        points.append((int(b), int(c)))
    return points


def load(args, max_len: int, context: int):
    """(model, indexer, tokenizer or None, model name); YaRN from the nominal context, as the quality runs."""
    dev = torch.device(DEVICE)
    shape = getattr(args, "indexer_shape", None)  # profile_e2e's and the tests' namespaces may not carry it
    if args.tiny:
        from spin_indexer.model.indexer_head import Indexer, IndexerConfig
        from spin_indexer.model.llama import Llama, LlamaConfig

        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=97, dim=64, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16,
                          ffn_dim=96, rope_theta=1e4, max_position=max_len)
        model = Llama(cfg, max_len=max_len).to(dev).eval().requires_grad_(False)
        icfg = IndexerConfig(dim=64, num_layers=2, num_heads=2, head_dim=16, q_rank=16, rope_dim=8,
                             rope_theta=1e4, max_position=max_len)
        if shape:
            head = random_indexer(icfg, shape, max_len, 1.0, dev, indexer_dtype(args, dev))
            return model, head, None, "tiny-random"
        return model, Indexer(icfg, max_len=max_len).to(dev).eval().requires_grad_(False), None, "tiny-random"
    from spin_indexer.model import loader
    from spin_indexer.model.indexer_head import Indexer

    if args.random_weights:
        # The proxy's shapes (LlamaConfig's defaults are SmolLM2-135M's) with random weights, and the shipped
        # indexer head: a decode step's cost does not depend on the weights' values (the SPIN budget is fixed),
        # while the 94 MiB GGUF does not fit a device call (64 MiB with the tree): speed only, no tokens to trust.
        from spin_indexer.model.llama import Llama, LlamaConfig

        torch.manual_seed(0)
        factor = loader.yarn_factor_for(context)
        model = Llama(LlamaConfig(yarn_factor=factor), max_len=max_len)
        model = model.to(device=dev, dtype=torch.bfloat16 if dev.type == "cuda" else torch.float32)
        indexer = Indexer.load(loader.INDEXER_WEIGHTS, max_len, factor, dev)
        if shape:
            heads, dim = shape
            dtype = indexer_dtype(args, dev)
            indexer = random_indexer(indexer.cfg, shape, max_len, factor, dev, dtype)
            return (model.eval().requires_grad_(False), indexer, None,
                    f"SmolLM2-135M-shape-random+indexer-{heads}x{dim}-random-{str(dtype).removeprefix('torch.')}")
        return model.eval().requires_grad_(False), indexer, None, "SmolLM2-135M-shape-random+lightning"

    reason = loader.missing_reason()
    if reason:
        raise SystemExit(reason)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    model, tok = loader.load_model(dev, dtype, max_len=max_len, yarn_factor=loader.yarn_factor_for(context))
    indexer = Indexer.load(loader.INDEXER_WEIGHTS, max_len, model.cfg.yarn_factor, dev)
    return model, indexer, tok, "SmolLM2-135M-Instruct+lightning"


def indexer_dtype(args, dev: torch.device) -> torch.dtype:
    """The random head's projection dtype: --indexer-dtype, else the model's (bfloat16 on CUDA): the DSA models
    run their indexer's projections in bf16 / FP8 as the rest of the model, never in float32 (the shipped head,
    distilled in float32, keeps float32)."""
    name = getattr(args, "indexer_dtype", None)  # profile_e2e's and the tests' namespaces may not carry it
    if name:
        return getattr(torch, name)
    return torch.bfloat16 if dev.type == "cuda" else torch.float32


def random_indexer(cfg, shape: tuple[int, int], max_len: int, yarn_factor: float, dev: torch.device,
                   dtype: torch.dtype = torch.float32):
    """A random indexer head like `cfg` (its layers, projections' input, rank and RoPE) with shape = (heads,
    dims): the decode step's indexer cost at that shape (speed only: its scores mean nothing). dtype: its
    projections' (the rotary tables stay float32)."""
    from spin_indexer.model.indexer_head import Indexer

    heads, dim = shape
    torch.manual_seed(1)
    icfg = dataclasses.replace(cfg, num_heads=heads, head_dim=dim, rope_dim=min(cfg.rope_dim, dim))
    indexer = Indexer(icfg, max_len, yarn_factor).to(dev).eval().requires_grad_(False)
    indexer.layers.to(dtype)
    return indexer


def add_indexer_dtype(p: argparse.ArgumentParser) -> None:
    p.add_argument("--indexer-dtype", choices=("bfloat16", "float32"), default=None,
                   help="with --indexer-shape: the random head's projection dtype (default: the model's, bfloat16 "
                        "on CUDA; float32 is the form runs 165-168 timed)")


def parse_indexer_shape(text: str) -> tuple[int, int]:
    """'64x128' -> (64, 128): heads and dims, powers of two (heads >= 4, dims >= 32: the logits kernels' shapes;
    others would time the reference)."""
    try:
        heads, dim = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HEADSxDIMS such as 64x128, got {text!r}") from None
    if heads < 4 or dim < 32 or heads & (heads - 1) or dim & (dim - 1):
        raise argparse.ArgumentTypeError(f"expected powers of two with heads >= 4 and dims >= 32 (the logits "
                                         f"kernels' shapes), got {text!r}")
    return heads, dim


def prompts_for(args, tok, context: int, vocab: int) -> list[torch.Tensor]:
    if tok is None:
        gen = torch.Generator().manual_seed(context)
        return [torch.randint(0, vocab, (context - 8 - i,), generator=gen) for i in range(args.distinct)]
    from spin_indexer.model import ruler

    out = []
    for seed in range(args.distinct):
        text, _ = ruler.make_prompt(args.task, context, seed, tok)
        out.append(torch.tensor(tok(text, add_special_tokens=False).input_ids, dtype=torch.int64))
    return out


def fill_batch(model, indexer, batch: int, capacity: int, prompts: list[torch.Tensor]):
    """Caches of `batch` requests: the distinct prompts prefilled once, then copied round-robin.
    returns (caches, prefill lengths int64 [B], first greedy tokens int64 [B, 1])."""
    dev = torch.device(DEVICE)
    caches = Caches.allocate(model, batch, capacity, indexer)
    width = caches.block_table.shape[1]
    firsts = []
    for r, ids in enumerate(prompts[:batch]):
        firsts.append(prefill(model, caches, r, ids.to(dev), indexer).argmax(-1))
    n = len(firsts)
    for r in range(n, batch):
        src = r % n
        for layer in range(model.cfg.num_layers):
            caches.k[layer][r].copy_(caches.k[layer][src])
            caches.v[layer][r].copy_(caches.v[layer][src])
            kv = caches.index_kv[layer]  # request r owns blocks r*W .. r*W + W - 1 (Caches.allocate)
            kv[r * width:(r + 1) * width].copy_(kv[src * width:(src + 1) * width])
        caches.lengths[r] = caches.lengths[src]
    first = torch.stack([firsts[r % n] for r in range(batch)]).view(batch, 1)
    return caches, caches.lengths.clone(), first


def parse_config(config: str) -> tuple[float, bool, str, bool] | str | None:
    """'all-keep' -> None (the model's own dense path: logits, then ops.topk best first); 'dense' -> "dense"
    (DenseIndexer: the library's dense step, block maxima fused, the top-k set in no particular order, as engines
    take it); 'spin-<s>[-block|-slot][-sorted][-serial]' -> (sparsity s, overlap_update, vertical grain,
    sorted). SpinConfig's default grain ("auto": block grain for this rule) unless -block / -slot names one;
    -sorted returns each row best first (all-keep's order, the top-k's sort and rank launches instead of its
    set select); -serial runs SPIN's EMA update in series (no side stream, no fork and join per layer)."""
    if config in ("all-keep", "dense"):
        return None if config == "all-keep" else "dense"
    body = config.removeprefix("spin-")
    serial = body.endswith("-serial")
    body = body.removesuffix("-serial")
    ordered = body.endswith("-sorted")
    body = body.removesuffix("-sorted")
    grain = "auto"
    for name in ("block", "slot"):
        if body.endswith(f"-{name}"):
            grain, body = name, body.removesuffix(f"-{name}")
    try:
        sparsity = float(body)
    except ValueError:
        sparsity = -1.0
    if not config.startswith("spin-") or not 0.0 <= sparsity < 1.0:
        raise SystemExit(f"--configs: expected all-keep, dense or spin-<sparsity in [0, 1)>[-block|-slot][-sorted]"
                         f"[-serial], got {config!r}")
    return sparsity, not serial, grain, ordered


def make_selector(config: str, model, caches, k: int):
    parsed = parse_config(config)
    if parsed is None:
        return None
    batch, width = caches.block_table.shape
    if parsed == "dense":
        from spin_indexer.indexer import DenseIndexer
        return DenseIndexer(k, device=caches.block_table.device)
    from spin_indexer.indexer import SpinIndexer
    from spin_indexer.predictor import SpinConfig

    sparsity, overlap, grain, ordered = parsed
    spin = SpinIndexer(SpinConfig(sparsity=sparsity, topk=k, vertical_grain=grain), num_layers=model.cfg.num_layers,
                       max_batch=batch, max_blocks=width, device=caches.block_table.device, overlap_update=overlap,
                       topk_sorted=ordered)
    caches.slot_ids.copy_(torch.tensor([spin.state.allocate() for _ in range(batch)], dtype=torch.int32))
    return spin


def each_config(args, model, indexer, tok, points, steps: int):
    """For the per-step tools (profile_e2e.py, topk_candidates.py): (batch, context, config, caches, selector,
    token) for every point and configuration, the batch prefilled once a point (room for `steps` more tokens)
    and reset to the prefill before each configuration; token int64 [B, 1], the prefill's next tokens."""
    for batch, context in points:
        prompts = prompts_for(args, tok, context, model.cfg.vocab_size)
        caches, lengths0, first = fill_batch(model, indexer, batch, context + steps + 8, prompts)
        for config in args.configs:
            caches.lengths.copy_(lengths0)
            yield batch, context, config, caches, make_selector(config, model, caches, args.k), first.clone()
        del caches
        torch.cuda.empty_cache() if torch.cuda.is_available() else None


def decode_config(model, indexer, caches, lengths0, first, config: str, k: int, warmup: int, steps: int):
    """Greedy decoding of the whole batch from the prefilled state: `warmup` eager steps, then `steps`
    replays of one captured step. returns (per-step ms list, wall seconds, tokens int64 [steps, B], sparsity)."""
    caches.lengths.copy_(lengths0)  # positions past the prefill are rewritten by this config's own steps
    selector = make_selector(config, model, caches, k)
    token = first.clone()

    def step():
        logits = decode_one_step(model, caches, token, "lightning", k, indexer, selector, validate=False)
        token.copy_(logits[:, -1].argmax(-1, keepdim=True))

    for _ in range(warmup):
        step()
    tokens, times = [], []
    if DEVICE == "cpu":  # dry run: eager steps, nothing timed
        for _ in range(steps):
            step()
            tokens.append(token.view(-1).clone())
            times.append(float("nan"))
        wall = float("nan")
    else:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            step()  # one more eager step on the capture stream (allocator warm-up)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
        torch.cuda.synchronize()
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(steps)]
        t0 = time.perf_counter()
        for a, b in events:
            a.record()
            graph.replay()
            b.record()
            tokens.append(token.view(-1).clone())
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        times = [a.elapsed_time(b) for a, b in events]
        del graph
    sparsity = float("nan") if selector is None else float(selector.block_plan.sparsity().float().mean())
    return times, wall, torch.stack(tokens), sparsity


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--points", default="32x16384,32x32768,64x32768,96x16384,96x32768",
                   help="BATCHxCONTEXT list (context = prompt tokens incl. the RULER answer budget)")
    p.add_argument("--configs", nargs="+", default=["dense", "spin-0.4", "spin-0.5"],
                   help="all-keep, dense, spin-<s>[-block|-slot][-sorted][-serial]; the first is the baseline of the "
                        "table's ratios and of the token agreement")
    p.add_argument("--k", type=int, default=512, help="top-k of the sparse attention (512)")
    p.add_argument("--steps", type=int, default=48, help="timed decode steps per config")
    p.add_argument("--warmup", type=int, default=4, help="eager steps before capture")
    p.add_argument("--distinct", type=int, default=4, help="distinct prompts per batch")
    p.add_argument("--task", default="niah_single_2")
    p.add_argument("--tiny", action="store_true", help="tiny random model (dry runs)")
    p.add_argument("--random-weights", action="store_true",
                   help="SmolLM2-135M's shapes with random weights + the shipped indexer head (speed only; "
                        "where the GGUF is not available, e.g. on the GPU box)")
    p.add_argument("--indexer-shape", type=parse_indexer_shape, default=None, metavar="HEADSxDIMS",
                   help="with --random-weights or --tiny: a random indexer head of this shape instead (64x128: the "
                        "DSA models' indexer; default: the shipped head's 4x64)")
    add_indexer_dtype(p)
    p.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = p.parse_args(argv)
    if args.indexer_shape and not (args.random_weights or args.tiny):
        raise SystemExit("--indexer-shape: only with --random-weights or --tiny (the GGUF model decodes with the "
                         "shipped head, whose tokens the agreement column compares)")
    for c in args.configs:
        parse_config(c)
    points = parse_points(args.points)
    extra = args.warmup + args.steps + 2
    max_len = max(c for _, c in points) + extra
    env = environment()
    log(json.dumps(env))
    t0 = time.perf_counter()
    model, indexer, tok, name = load(args, max_len, max(c for _, c in points))
    log(f"loaded {name} in {time.perf_counter() - t0:.1f}s (YaRN {model.cfg.yarn_factor:g})")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for batch, context in points:
        try:
            prompts = prompts_for(args, tok, context, model.cfg.vocab_size)
            t = time.perf_counter()
            caches, lengths0, first = fill_batch(model, indexer, batch, context + extra, prompts)
            log(f"\n{batch}x{context}: {len(prompts)} prompts of {[int(x.numel()) for x in prompts]} tokens "
                f"prefilled + copied in {time.perf_counter() - t:.1f}s")
            reference = None
            for config in args.configs:
                times, wall, tokens, sparsity = decode_config(model, indexer, caches, lengths0, first, config,
                                                              args.k, args.warmup, args.steps)
                if config == args.configs[0]:
                    reference = tokens
                agree = float("nan") if reference is None else float((tokens == reference).float().mean())
                med = statistics.median(times) if DEVICE != "cpu" else float("nan")
                row = dict(model=name, config=config, batch=batch, context=context,
                           tokens_per_s=batch * args.steps / wall if wall == wall else float("nan"),
                           median_itl_ms=med, p20_itl_ms=quantile(times, 0.2), p80_itl_ms=quantile(times, 0.8),
                           steps=args.steps, realized_sparsity=sparsity, agree_all_keep=agree, topk=args.k,
                           distinct_prompts=len(prompts))
                rows.append(row)
                log(f"  {config:10s} {row['tokens_per_s']:10.0f} tok/s  ITL {med:7.3f} ms  "
                    f"sparsity {sparsity:.3f}  same tokens as all-keep {agree:.3f}")
            del caches
        except torch.cuda.OutOfMemoryError as e:  # a point that does not fit is reported, the rest still run
            log(f"{batch}x{context}: out of memory ({str(e).splitlines()[0]})")
        if DEVICE != "cpu":
            torch.cuda.empty_cache()
        write(args.out, rows, env)
    table(rows)
    return 0


def write(out: Path, rows: list[dict], env: dict) -> None:
    for path, cols in ((out / "h200_e2e.csv", COLUMNS), (out / "h200_e2e_detail.csv", DETAIL)):
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(cols)
            for r in rows:
                w.writerow([f"{r[c]:.4g}" if isinstance(r[c], float) else r[c] for c in cols])
    (out / "h200_e2e_env.json").write_text(json.dumps({**env, "command": " ".join(sys.argv)}, indent=1) + "\n")


def table(rows: list[dict]) -> None:
    first = rows[0]["config"] if rows else ""
    log(f"\n{'batch':>5} {'context':>7} {'config':10} {'tok/s':>9} {'ITL ms':>8} {'vs ' + first:>11} {'sparsity':>8}")
    base = {(r["batch"], r["context"]): r["tokens_per_s"] for r in rows if r["config"] == first}
    for r in rows:
        ref = base.get((r["batch"], r["context"]), float("nan"))
        log(f"{r['batch']:5d} {r['context']:7d} {r['config']:10} {r['tokens_per_s']:9.0f} {r['median_itl_ms']:8.3f} "
            f"{r['tokens_per_s'] / ref:10.2f}x {r['realized_sparsity']:8.3f}")


if __name__ == "__main__":
    raise SystemExit(main())
