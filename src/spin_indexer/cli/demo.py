"""`spin-indexer demo`: a synthetic decode run through the engines' FP8 paged cache (temporary: until the
proxy model lands, the cache and the queries are synthetic, everything else is the real code path).

1. Build an FP8 paged key cache (B = 2 requests of 16K tokens, H = 64, D = 128) with
   quantize_and_write through shuffled block tables. Keys carry block-level topics, so a few blocks
   matter more than the rest, as in real attention.
2. Each decode step appends one key per request, lets the query's topic mix drift a little, and computes
   the dense indexer logits and top-k (k = 2048): the ground truth.
3. If SpinIndexer is importable, SPIN at target sparsity 0.3 and 0.4 runs the same steps on the same
   cache (plan + run: it scores only the blocks it keeps) and the table shows its realized block
   sparsity and its miss (dense top-k tokens that fell in skipped blocks). Otherwise the dense result.
"""
from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

CONTEXT = 16384
BATCH, HEADS, DIM, TOPK = 2, 64, 128, 2048
NUM_TOPICS = 16


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--context", type=int, default=CONTEXT, help=f"tokens per request at step 0 ({CONTEXT})")
    parser.add_argument("--steps", type=int, default=16, help="decode steps (default 16)")
    parser.add_argument("--sparsity", type=float, nargs="+", default=[0.3, 0.4], help="SPIN targets (0.3 0.4)")
    parser.add_argument("--drift", type=float, default=0.1, help="query topic drift per step (default 0.1)")


def _spin_available():
    try:
        from ..indexer import SpinIndexer  # noqa: F401  (written in parallel; optional until it lands)
        from ..predictor import PRESETS  # noqa: F401
        return True
    except ImportError:
        return False


class SyntheticDecode:
    """Random FP8 cache + drifting queries; step() appends a token and returns this step's tensors."""

    def __init__(self, context: int, steps: int, device: str, gen: torch.Generator):
        from .. import ops
        from ..layout import TOKENS_PER_BLOCK as T, new_kv_cache, num_blocks_for

        self.ops, self.T, self.gen, self.device = ops, T, gen, device
        self.width = num_blocks_for(context + steps)
        self.cache = new_kv_cache(BATCH * self.width, DIM, device)
        # Physical blocks shuffled across requests, as an engine's allocator leaves them.
        perm = torch.randperm(BATCH * self.width, generator=gen)
        self.block_table = perm.view(BATCH, self.width).to(torch.int32).to(device)
        self.topics = torch.nn.functional.normalize(torch.randn(NUM_TOPICS, DIM, generator=gen), dim=1)
        self.block_topic = torch.randint(0, NUM_TOPICS, (BATCH, self.width), generator=gen)
        self.block_gain = torch.exp(0.5 * torch.randn(BATCH, self.width, generator=gen))
        self.mix = torch.randn(BATCH, NUM_TOPICS, generator=gen)
        self.head_noise = torch.randn(BATCH, HEADS, DIM, generator=gen) * 0.5
        self.weights = (torch.rand(BATCH, HEADS, generator=gen) / math.sqrt(HEADS * DIM)).to(device)
        self.lengths = torch.zeros(BATCH, dtype=torch.int64)
        self._append(context)

    def _keys(self, positions: torch.Tensor) -> torch.Tensor:
        """Keys [B, n, D] for logical positions [n]: topic of their block * gain + noise."""
        blk = positions // self.T
        topic = self.topics[self.block_topic[:, blk]]  # [B, n, D]
        gain = self.block_gain[:, blk, None]
        return 2.0 * gain * topic + torch.randn(BATCH, len(positions), DIM, generator=self.gen) / math.sqrt(DIM)

    def _append(self, count: int) -> None:
        """Write `count` new tokens per request through the slot mapping."""
        start = int(self.lengths[0])
        pos = torch.arange(start, start + count)
        keys = self._keys(pos).reshape(BATCH * count, DIM)
        phys = self.block_table.cpu().long()[:, pos // self.T]  # [B, n]
        slots = (phys * self.T + pos % self.T).reshape(-1)  # slot = block * T + row
        self.ops.quantize_and_write(self.cache, keys.to(self.device), slots.to(self.device))
        self.lengths += count

    def step(self, drift: float):
        """Append one token, drift the query topics; returns (q_fp8, weights, seq_lens)."""
        self._append(1)
        self.mix = math.sqrt(1 - drift**2) * self.mix + drift * torch.randn(BATCH, NUM_TOPICS, generator=self.gen)
        focus = torch.softmax(2.0 * self.mix, dim=1) @ self.topics  # [B, D]
        q = 4.0 * focus[:, None, :] + self.head_noise  # [B, H, D]
        q_fp8 = q[:, None].to(torch.float8_e4m3fn).to(self.device)  # [B, 1, H, D]
        seq_lens = self.lengths.view(BATCH, 1).to(torch.int32).to(self.device)
        return q_fp8, self.weights, seq_lens


def run(args) -> int:
    from tqdm import tqdm

    from ..checks import check_int, check_range
    from .main import device_of

    check_int("--context", args.context, low=1)
    check_int("--steps", args.steps, low=1)
    for s in args.sparsity:
        check_range("--sparsity", s, low=0.0, high=1.0, high_open=True)
    device = device_of(args)
    gen = torch.Generator().manual_seed(args.seed)
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    sim = SyntheticDecode(args.context, args.steps, device, gen)
    build_s = time.perf_counter() - t0

    spin = _spin_available()
    indexers = {}
    if spin:
        import dataclasses

        from ..indexer import SpinIndexer
        from ..predictor import PRESETS

        for s in args.sparsity:
            cfg = dataclasses.replace(PRESETS["paper"], sparsity=s, topk=TOPK, seed=args.seed)
            idx = SpinIndexer(cfg, num_layers=1, max_batch=BATCH, max_blocks=sim.width, next_n=1, device=device)
            slots = torch.tensor([idx.state.allocate() for _ in range(BATCH)], dtype=torch.int32, device=device)
            indexers[s] = (idx, slots)

    rows = {"dense": _Acc()} | {s: _Acc() for s in indexers}
    for step in tqdm(range(args.steps), desc="decode steps", disable=args.quiet, unit="step"):
        q_fp8, weights, seq_lens = sim.step(args.drift)
        t = time.perf_counter()
        logits = sim.ops.paged_indexer_logits(q_fp8, sim.cache, weights, seq_lens, sim.block_table)
        dense = sim.ops.topk(logits, seq_lens.view(-1), TOPK)
        rows["dense"].add(time.perf_counter() - t, None, None)
        for s, (idx, slots) in indexers.items():
            t = time.perf_counter()
            idx.plan(sim.block_table, seq_lens, slots)
            idx.run(0, q_fp8, sim.cache, weights)
            elapsed = time.perf_counter() - t
            plan = idx.block_plan
            if step == 0:  # no history yet: every block is new and scored (a dense warm-up step)
                continue
            rows[s].add(elapsed, _miss(plan.keep_mask, dense, sim.T), plan.sparsity())
    table = _table(rows, args, sim, device, build_s, spin)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "demo.json").write_text(json.dumps(table, indent=2) + "\n")
    _print(table, args.quiet)
    return 0


def _miss(keep_mask: torch.Tensor, topk: torch.Tensor, tokens: int) -> torch.Tensor:
    """Per row: fraction of its dense top-k positions whose block was skipped."""
    valid = topk >= 0
    kept = torch.gather(keep_mask, 1, torch.where(valid, topk.long() // tokens, 0))
    return ((valid & ~kept).sum(1) / valid.sum(1).clamp_min(1)).float()


class _Acc:
    """Per-step numbers of one policy."""

    def __init__(self):
        self.seconds, self.miss, self.sparsity = [], [], []

    def add(self, seconds, miss, sparsity):
        self.seconds.append(seconds)
        if miss is not None:
            self.miss.append(miss.cpu())
            self.sparsity.append(sparsity.cpu())


def _table(rows, args, sim, device, build_s, spin) -> dict:
    out = {"config": {"batch": BATCH, "context": args.context, "heads": HEADS, "dim": DIM, "topk": TOPK,
                      "steps": args.steps, "drift": args.drift, "seed": args.seed, "device": device},
           "cache_bytes": sim.cache.numel(), "build_s": build_s, "spin_available": spin, "rows": []}
    for name, acc in rows.items():
        row = {"policy": "dense" if name == "dense" else "spin", "target_sparsity": 0.0 if name == "dense" else name,
               "ms_per_step": 1e3 * sorted(acc.seconds)[len(acc.seconds) // 2]}
        if acc.miss:
            miss = torch.cat(acc.miss)
            row |= {"realized_sparsity": float(torch.cat(acc.sparsity).mean()), "miss_mean": float(miss.mean()),
                    "miss_max": float(miss.max()), "rows": miss.numel()}
        out["rows"].append(row)
    return out


def _print(table, quiet: bool) -> None:
    c = table["config"]
    lines = [f"spin-indexer demo: B={c['batch']} requests x {c['context']} + {c['steps']} tokens, H={c['heads']}, "
             f"D={c['dim']}, top-k {c['topk']}, FP8 paged cache {table['cache_bytes'] / 2**20:.1f} MiB "
             f"({table['build_s']:.1f} s to build), device {c['device']}"]
    if not table["spin_available"]:
        lines.append("SPIN indexer not available in this build: dense reference only.")
    head = f"{'policy':<8} {'target s':>8} {'realized s':>10} {'miss mean':>9} {'miss max':>8} {'ms/step':>8}"
    lines += ["", head, "-" * len(head)]
    for r in table["rows"]:
        if "miss_mean" in r:
            lines.append(f"{r['policy']:<8} {r['target_sparsity']:>8.2f} {r['realized_sparsity']:>10.1%} "
                         f"{r['miss_mean']:>9.2%} {r['miss_max']:>8.2%} {r['ms_per_step']:>8.1f}")
        else:
            lines.append(f"{r['policy']:<8} {r['target_sparsity']:>8.2f} {'0.0%':>10} {'0.00%':>9} {'0.00%':>8} "
                         f"{r['ms_per_step']:>8.1f}")
    if table["spin_available"]:
        lines.append("miss = dense top-k tokens in blocks SPIN skipped (rows after the first, dense warm-up step);"
                     " synthetic data: not a result")
    print("\n".join(lines))
