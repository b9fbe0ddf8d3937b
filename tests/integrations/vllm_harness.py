"""Hand-built vLLM decode steps on the CPU, and vLLM's own sparse_attn_indexer path as the reference.

vLLM's decode path runs on the CPU once its DeepGEMM logits call is replaced by vLLM's torch fallback
`fp8_paged_mqa_logits_torch` and the top-k backend is "torch". That fallback misreads the cache when a
request has next_n >= 2 rows, so the replacement flattens rows to one row per request (block table
repeated, each row its own length) before calling it: vLLM's reshapes, row lengths and top-k still run
with next_n rows. Imported by the test_vllm_*.py modules after pytest.importorskip("vllm").
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")

import torch  # noqa: E402
import vllm.model_executor.layers.sparse_attn_indexer as sai  # noqa: E402
from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.forward_context import get_forward_context, set_forward_context  # noqa: E402,F401
from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer  # noqa: E402
from vllm.v1.attention.backends.mla.indexer import (DeepSeekV32IndexerDecodeMetadata,  # noqa: E402
                                                    DeepseekV32IndexerMetadata)
from vllm.v1.attention.ops.rocm_aiter_mla_sparse import fp8_paged_mqa_logits_torch  # noqa: E402

H, D, T = 64, 128, 64
ROW = D + 4


SPIN_ENV = ("SPIN_ENABLE", "SPIN_SPARSITY", "SPIN_EXPLORATION", "SPIN_POLICY", "SPIN_GAMMA", "SPIN_SEED", "SPIN_MTP", "SPIN_SHADOW",
            "SPIN_VERTICAL_GRAIN")


def isolate(monkeypatch) -> None:
    """Per test: no SPIN_* settings from the environment, vLLM's logits call on the flattened torch
    fallback, and the plugin registered."""
    for name in SPIN_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sai, "fp8_fp4_paged_mqa_logits", flattened_paged_logits)
    from spin_indexer.integrations.vllm import register
    assert register()


def flattened_paged_logits(q, kv_cache, weights, context_lens, block_tables, schedule_metadata, max_model_len,
                           indices=None):
    """Stand-in for DeepGEMM's fp8_fp4_paged_mqa_logits: vLLM's torch fallback, one row per request."""
    q_values = q[0]
    batch, next_n = q_values.shape[:2]
    lens = context_lens.reshape(batch, -1)
    if lens.shape[1] == 1 and next_n > 1:
        lens = lens - next_n + 1 + torch.arange(next_n, dtype=lens.dtype)
    flat_q = q_values.reshape(batch * next_n, 1, *q_values.shape[2:])
    flat_table = block_tables.repeat_interleave(next_n, dim=0)
    return fp8_paged_mqa_logits_torch(flat_q, kv_cache, weights, lens.reshape(-1, 1), flat_table, max_model_len)


def vllm_path(layer, hidden_states, q_quant, k, weights):
    """vLLM's own sparse_attn_indexer (the CUDA-path Python body) with the layer's arguments, torch top-k."""
    return sai.sparse_attn_indexer(
        hidden_states, layer.k_cache.prefix, layer.k_cache.kv_cache, q_quant, None, k, weights,
        layer.quant_block_size, layer.scale_fmt, layer.topk_tokens, layer.head_dim, layer.max_model_len,
        layer.max_total_seq_len, layer.topk_indices_buffer, True, False, False, "", topk_backend="torch")


class KCache:
    """What SparseAttnIndexer reads from the model's indexer cache module: prefix and kv_cache."""

    def __init__(self, prefix: str, kv_cache: torch.Tensor):
        self.prefix, self.kv_cache = prefix, kv_cache


def random_tables(lens, num_blocks: int, gen: torch.Generator) -> list[list[int]]:
    """Distinct random physical blocks for each request (ceil(L / T) each)."""
    need = [-(-L // T) for L in lens]
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    out, at = [], 0
    for n in need:
        out.append(perm[at:at + n])
        at += n
    return out


def make_cache(num_blocks: int, gen: torch.Generator, stride_blocks: int = 1) -> torch.Tensor:
    """uint8 [num_blocks, T, D + 4] as vLLM binds it (block = T*D fp8 values, then T fp32 scales), random
    keys and power-of-two scales; stride_blocks > 1 makes it a strided view into a larger allocation."""
    store = torch.zeros(num_blocks, stride_blocks, T * ROW, dtype=torch.uint8)
    fill_blocks(store[:, 0], torch.arange(num_blocks), gen)
    return store[:, 0].view(num_blocks, T, ROW) if stride_blocks == 1 else \
        torch.as_strided(store, (num_blocks, T, ROW), (stride_blocks * T * ROW, ROW, 1))


def fill_blocks(pages: torch.Tensor, ids: torch.Tensor, gen: torch.Generator) -> None:
    """Write fresh random keys into pages[ids] (pages: uint8 [num_blocks, T*ROW])."""
    n = ids.numel()
    values = (torch.randn(n, T, D, generator=gen) * 2).to(torch.float8_e4m3fn)
    scales = torch.exp2(torch.randint(-4, 2, (n, T), generator=gen).float())
    page = torch.cat([values.view(torch.uint8).reshape(n, -1), scales.view(torch.uint8).reshape(n, -1)], dim=1)
    pages[ids] = page


@dataclass
class Step:
    """One decode step: B requests with lengths L (after this step's tokens), next_n rows each."""

    meta: DeepseekV32IndexerMetadata
    q: torch.Tensor  # fp8 [B*N, H, D]
    weights: torch.Tensor  # float32 [B*N, H]
    seq_lens: torch.Tensor  # int32 [B, N]
    block_table: torch.Tensor  # int32 [B, W]


def make_step(lens, tables, next_n: int, width: int, gen: torch.Generator, extra_written=None,
              seq_lens_2d: bool = True) -> Step:
    """Decode metadata as DeepseekV32IndexerMetadataBuilder produces it for a uniform decode batch.

    lens: context length L_b of each request (including this step's next_n tokens); tables: list of
    physical block-id lists; extra_written: KV slots also written this step (e.g. another request's
    prefill), appended to slot_mapping.
    """
    batch = len(lens)
    L = torch.tensor(lens, dtype=torch.int32)
    block_table = torch.zeros(batch, width, dtype=torch.int32)
    for b, ids in enumerate(tables):
        ids = ids[:width]
        block_table[b, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
    rows = L[:, None] - next_n + 1 + torch.arange(next_n, dtype=torch.int32)  # [B, N]
    pos = (rows - 1).long()
    slots = torch.gather(block_table.long(), 1, pos.clamp_min(0) // T) * T + pos % T
    slots = torch.where(pos >= 0, slots, -1)  # length-0 rows: CUDA-graph padding, nothing written
    slot_mapping = slots.reshape(-1)
    if extra_written is not None:
        slot_mapping = torch.cat([slot_mapping, torch.as_tensor(extra_written, dtype=torch.int64)])
    seq_lens = rows if seq_lens_2d else L[:, None]
    dec = DeepSeekV32IndexerDecodeMetadata(block_table=block_table, seq_lens=seq_lens,
                                           decode_lens=torch.full((batch,), next_n, dtype=torch.int32),
                                           requires_padding=False, schedule_metadata=torch.empty(0))
    meta = DeepseekV32IndexerMetadata(seq_lens=L, max_seq_len=int(L.max()), slot_mapping=slot_mapping,
                                      num_decodes=batch, num_decode_tokens=batch * next_n, num_prefills=0,
                                      num_prefill_tokens=0, decode=dec)
    q = (torch.randn(batch * next_n, H, D, generator=gen) * 2).to(torch.float8_e4m3fn)
    weights = torch.randn(batch * next_n, H, generator=gen)
    return Step(meta, q, weights, rows.contiguous(), block_table)


def vllm_config(spin: dict | None = None, max_num_seqs: int = 16) -> VllmConfig:
    cfg = VllmConfig(additional_config={"spin": spin} if spin is not None else {})
    cfg.scheduler_config.max_num_seqs = max_num_seqs
    return cfg


def build_layers(cfg: VllmConfig, kv_caches, topk: int, max_model_len: int, rows: int = 64):
    """One model's indexer layers as DeepseekV2 builds them (shared top-k buffer), with vLLM's CUDA-path body
    (vllm_path) standing in for the CPU path that needs vLLM's compiled kernels."""
    buffer = torch.full((rows, topk), 7, dtype=torch.int32)  # 7: poison, rows nobody wrote keep it
    layers = []
    with set_current_vllm_config(cfg):
        for i, kv in enumerate(kv_caches):
            kc = KCache(f"model.layers.{i}.self_attn.indexer.k_cache", kv)
            layer = SparseAttnIndexer(kc, 128, "ue8m0", topk, D, max_model_len, 8 * max_model_len, buffer)
            layer.skip_k_cache_insert = True  # keys are written by the test
            layer._vllm_forward = (lambda lyr: lambda h, q, k, w: vllm_path(lyr, h, q, k, w))(layer)
            layers.append(layer)
    return layers, buffer


def run_layer(cfg: VllmConfig, layers, layer, step: Step, mode=None) -> torch.Tensor:
    """layer.forward under a forward context holding `step` for every layer; returns a copy of the buffer.
    mode: the forward context's CUDAGraphMode (FULL: what vLLM sets while it captures a full graph)."""
    from vllm.config import CUDAGraphMode
    attn = {lyr.k_cache.prefix: step.meta for lyr in layers}
    hidden = torch.empty(step.q.shape[0], 8)
    with set_current_vllm_config(cfg), set_forward_context(attn, cfg, cudagraph_runtime_mode=mode or CUDAGraphMode.NONE):
        out = layer(hidden, step.q, None, step.weights)
    return out.clone()


def reference(cfg: VllmConfig, layer, step: Step, buffer: torch.Tensor) -> torch.Tensor:
    """vLLM's own path for `layer` on `step`, into a copy of the poisoned buffer."""
    saved = layer.topk_indices_buffer
    layer.topk_indices_buffer = torch.full_like(buffer, 7)
    try:
        with set_current_vllm_config(cfg), set_forward_context({layer.k_cache.prefix: step.meta}, cfg):
            return vllm_path(layer, torch.empty(step.q.shape[0], 8), step.q, None, step.weights).clone()
    finally:
        layer.topk_indices_buffer = saved


def dense_logits(layer, step: Step) -> torch.Tensor:
    """float64 [B*N, W*T] indexer scores computed here (an independent recomputation), -inf past row length."""
    kv = layer.k_cache.kv_cache
    nb = kv.shape[0]
    pages = torch.stack([kv[i].reshape(-1) for i in range(nb)])  # [nb, T*ROW] (handles strided views)
    values = pages[:, : T * D].contiguous().view(torch.float8_e4m3fn).view(nb, T, D).double()
    scales = pages[:, T * D:].contiguous().view(torch.float32).view(nb, T).double()
    batch, next_n = step.seq_lens.shape
    width = step.block_table.shape[1]
    ids = step.block_table.long()
    keys = values[ids].reshape(batch, width * T, D)
    ks = scales[ids].reshape(batch, width * T)
    q = step.q.double().view(batch, next_n, H, D)
    w = step.weights.double().view(batch, next_n, H)
    s = torch.einsum("bnhd,bcd->bnhc", q, keys).relu()
    logits = torch.einsum("bnhc,bnh->bnc", s, w) * ks[:, None, :]
    cols = torch.arange(width * T)
    logits = torch.where(cols[None, None, :] < step.seq_lens.long()[:, :, None], logits, float("-inf"))
    return logits.reshape(batch * next_n, width * T)


def finite_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """int64 [rows, k]: each row's top-k positions among its finite logits (all of them when fewer), -1 after."""
    want = torch.full((logits.shape[0], k), -1, dtype=torch.int64)
    for r in range(logits.shape[0]):
        n = min(k, int((logits[r] > float("-inf")).sum()))
        want[r, :n] = logits[r].topk(n).indices
    return want


def assert_same_topk(got: torch.Tensor, want: torch.Tensor, logits: torch.Tensor, k: int, rel: float = 1e-5):
    """Row by row: same number of -1, same set of positions, except swaps between exact-or-near ties at the
    k-th value (fp32 summation order differs between implementations)."""
    for r in range(got.shape[0]):
        g, w = got[r, :k], want[r, :k]
        assert int((g < 0).sum()) == int((w < 0).sum()), f"row {r}: -1 padding differs"
        assert bool((g[g < 0] == -1).all()), f"row {r}: negative values other than -1"
        gs, ws = set(g[g >= 0].tolist()), set(w[w >= 0].tolist())
        assert len(gs) == int((g >= 0).sum()), f"row {r}: duplicate positions"
        diff = gs ^ ws
        if diff:
            kth = logits[r, list(ws)].min()
            for p in diff:
                assert abs(float(logits[r, p] - kth)) <= rel * max(1.0, abs(float(kth))), \
                    f"row {r}: position {p} differs and is not a tie at the k-th value"


def vllm_available_reason() -> str:
    return f"vllm importable at {sys.modules['vllm'].__file__}"
