"""The memory SPIN adds to a vLLM server, from the tensors it allocates (docs/vllm.md's table).

    python benchmarks/vllm_memory.py [--layers 61] [--topk 2048] [--next-n 1] [--vertical-grain auto|slot|block]

Per row (max_model_len x max_num_seqs, the cache holding every sequence at max_model_len: the worst case):
  per-server state   build_state(...) on the meta device, the very call the runtime makes at vLLM's profile
                     run; meta tensors have the real shapes and dtypes, so the bytes are exact, not
                     extrapolated: per-slot tables, step workspace, tracker (vllm_memory.state_bytes)
  per-block history  (L + ceil(L / 63)) SpinHistoryCache pages per block: the page size is read from the
                     spec vLLM sizes (SpinHistoryCache.get_kv_cache_spec(...).page_size_bytes) when vLLM
                     imports, else computed as T x 2 B (fp16) and marked "formula"
                     under slot grain (--vertical-grain slot); under block grain (the default "auto" with
                     spin-default) no pages: the block maxima, L x 2 B a block, allocated by the runtime outside
                     the KV-cache spec
  indexer keys       L x 64 x 132 B per block, what the history serves
  vLLM's own logits  fp32 [max_num_seqs x next_n, max_model_len]: what vLLM's decode path allocates per
                     indexer call (DeepGEMM's output), for comparison with SPIN's logits workspace
"""
from __future__ import annotations

import argparse
import sys

from spin_indexer.integrations.settings import SpinVllmSettings
from spin_indexer.integrations.vllm_memory import build_state, state_bytes
from spin_indexer.layout import BYTES_PER_TOKEN, TOKENS_PER_BLOCK as T

ROWS = [(128 * 1024, 256), (128 * 1024, 1024), (1024 * 1024, 256), (1024 * 1024, 1024)]
GIB = 2**30


def history_page_bytes() -> tuple[int, int, str]:
    """(bytes of one SpinHistoryCache page, layers per spare region, "vLLM spec" or "formula")."""
    try:
        from vllm.config import VllmConfig, set_current_vllm_config

        from spin_indexer.integrations.vllm_history import SPARE_EVERY, SpinHistoryCache
    except Exception:  # noqa: BLE001 - no vLLM here: the same numbers from the spec's definition
        return T * 2, 63, "formula (T x 2 B; vLLM not importable)"
    cfg = VllmConfig()
    cfg.cache_config.block_size = T
    with set_current_vllm_config(cfg):
        import torch
        spec = SpinHistoryCache("memory.table.spin_history", torch.float16).get_kv_cache_spec(cfg)
    return spec.page_size_bytes, SPARE_EVERY, "vLLM spec"


def rows(layers: int, topk: int, next_n: int, policy: str = "spin-default",
         vertical_grain: str = "auto") -> tuple[list[dict], str]:
    page, spare_every, source = history_page_bytes()
    settings = SpinVllmSettings(enable=True, sparsity=0.4, policy=policy, vertical_grain=vertical_grain)
    block_grain = settings.spin_config(topk).grain.value == "block"
    out = []
    for max_model_len, seqs in ROWS:
        indexer, tracker = build_state(settings, topk, layers, seqs, max_model_len, next_n, T, "meta")
        sizes = state_bytes(indexer, tracker)
        blocks = seqs * -(-max_model_len // T)
        history = (blocks + 1) * layers * 2 if block_grain else blocks * (layers + -(-layers // spare_every)) * page
        keys = blocks * layers * T * BYTES_PER_TOKEN
        ws = indexer.workspace
        out.append({"max_model_len": max_model_len, "seqs": seqs, "tokens": blocks * T, "per_slot": sizes["per_slot"],
                    "plan_scratch": 4 * (ws.kept_blocks.numel() + ws.compact_table.numel()),
                    "logits": 4 * ws.logits.numel(), "workspace": sizes["workspace"], "tracker": sizes["tracker"],
                    "history": history, "keys": keys, "vllm_logits": 4 * seqs * next_n * max_model_len})
    return out, source


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=61)
    ap.add_argument("--topk", type=int, default=2048)
    ap.add_argument("--next-n", type=int, default=1)
    ap.add_argument("--policy", default="spin-default", help="SPIN_POLICY")
    ap.add_argument("--vertical-grain", default="auto", choices=("auto", "slot", "block"),
                    help="SPIN_VERTICAL_GRAIN (auto, the plugin's default: block grain for spin-default)")
    args = ap.parse_args(argv)
    table, source = rows(args.layers, args.topk, args.next_n, args.policy, args.vertical_grain)
    print(f"DeepSeek-V3.2-like: {args.layers} layers, top-k {args.topk}, next_n {args.next_n}, policy {args.policy}, "
          f"vertical grain {args.vertical_grain}; history page: {source}")
    print("| max_model_len | seqs | cached tokens | per-slot tables | step workspace (plan scratch / logits) | tracker "
          "| per-server total (profiled) | block history (KV-cache spec) | B / cached token / layer | indexer keys "
          "| vLLM's decode logits per call |")
    print("|" + "---|" * 11)
    for r in table:
        label = f"{r['max_model_len'] // 1024}K" if r["max_model_len"] < 2**20 else f"{r['max_model_len'] // 2**20}M"
        server = r["per_slot"] + r["workspace"] + r["tracker"]
        per_token = r["history"] / (r["tokens"] * args.layers)
        print(f"| {label} | {r['seqs']} | {r['tokens'] / 2**20:.0f} Mi | {r['per_slot'] / GIB:.2f} GiB "
              f"| {r['workspace'] / GIB:.2f} GiB ({r['plan_scratch'] / GIB:.2f} / {r['logits'] / GIB:.2f}) "
              f"| {r['tracker'] / 2**10:.0f} KiB | {server / GIB:.2f} GiB | {r['history'] / GIB:.2f} GiB "
              f"| {per_token:.2f} B | {r['keys'] / GIB:.0f} GiB | {r['vllm_logits'] / GIB:.2f} GiB |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
