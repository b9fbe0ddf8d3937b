"""Sparse MLA decode attention over the indexer's top-k tokens (DeepSeek-V3.2 shapes), in plain torch.

This is a plain torch gather + batched-matmul implementation, NOT a tuned kernel: it materializes the
gathered keys in bf16 and the [R, H, K] scores in fp32. FlashMLA's sparse decode kernel streams the same
bytes once and would be faster; the benchmark uses this one so the attention side of a step has a
reproducible, dependency-free cost next to the indexer.

Shapes (MLA with absorbed projections): H = 128 query heads share one latent KV per token of
576 = 512 latent + 64 rope dims; the output is 512 latent dims per head. The cache stores the 576 dims in
fp8 e4m3 plus one float32 scale per token (580 B/token; the engines' V3.2 FP8 layout is 656 B/token), which
keeps a 1M-token context at batch 96 within one H200. The scale is applied in bf16 after the gather (exact
for power-of-two scales, which the benchmark and test use).

Bytes moved per query row (the floor): K * (576 + 4) B gathered (1.19 MB at K = 2048) + q 128 * 576 * 2 B
+ out 128 * 512 * 2 B; at batch 96 one layer gathers 114 MB -> ~27 us at 4.2 TB/s. This implementation also
writes and re-reads the bf16 keys (2x), the scores and probabilities, so it runs well above that floor.
"""
from __future__ import annotations

import torch

from spin_indexer.checks import check_tensor

T = 64  # tokens per block
LATENT_DIM = 512  # value dims (the compressed KV); the first 512 of the 576 key dims
QK_DIM = 576  # latent + rope
MLA_HEADS = 128
DEFAULT_SM_SCALE = 192 ** -0.5  # 1 / sqrt(qk_nope 128 + qk_rope 64), as in DeepSeek-V3.2 (before mscale)


def physical_slots(block_table: torch.Tensor, topk_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logical positions -> physical cache slots. Row r belongs to request r // next_n; position p maps to
    block_table[b, p // 64] * 64 + p % 64 (p = 130, table row [7, 3, 9]: block 9, slot 9 * 64 + 2 = 578).

    returns (slots int64 [R, K], 0 where padded; valid bool [R, K]: position >= 0).
    """
    rows = topk_indices.shape[0]
    batch, width = block_table.shape
    tables = block_table.repeat_interleave(rows // max(1, batch), dim=0).long()  # [R, W]
    pos = topk_indices.long()
    valid = pos >= 0
    p = pos.clamp_min(0)
    block = torch.gather(tables, 1, (p // T).clamp_max(width - 1))
    return torch.where(valid, block * T + p % T, 0), valid


def sparse_mla_decode(q: torch.Tensor, kv_latent: torch.Tensor, kv_scale: torch.Tensor, block_table: torch.Tensor,
                      topk_indices: torch.Tensor, sm_scale: float = DEFAULT_SM_SCALE) -> torch.Tensor:
    """Attention of each query row over its top-k tokens.

    q: bfloat16 [R, H, 576], R = B * next_n; kv_latent: float8_e4m3fn [num_blocks * 64, 576];
    kv_scale: float32 [num_blocks * 64]; block_table: int32 [B, W]; topk_indices: int32 [R, K] logical
    positions, -1 = padding (a row with no valid position returns zeros).
    returns bfloat16 [R, H, 512].
    """
    check_tensor("q", q, dtype=torch.bfloat16, ndim=3)
    rows, heads, dim = q.shape
    check_tensor("kv_latent", kv_latent, dtype=torch.float8_e4m3fn, shape=(None, dim), shape_names="[slots, 576]",
                 device=q.device, device_of="q")
    check_tensor("kv_scale", kv_scale, dtype=torch.float32, shape=(kv_latent.shape[0],), shape_names="[slots]",
                 device=q.device, device_of="q")
    check_tensor("block_table", block_table, dtype=torch.int32, ndim=2, device=q.device, device_of="q")
    check_tensor("topk_indices", topk_indices, dtype=torch.int32, shape=(rows, None), shape_names="[R, K]",
                 device=q.device, device_of="q")
    batch = block_table.shape[0]
    if batch == 0 or rows % batch:
        raise ValueError(f"q: expected R = B * next_n rows with B = {batch} (block_table), got R = {rows}")
    k = topk_indices.shape[1]
    slots, valid = physical_slots(block_table, topk_indices)
    flat = slots.view(-1)
    # index_select on the raw bytes: fp8 gathers are not implemented for every backend.
    keys = kv_latent.view(torch.uint8).index_select(0, flat).view(torch.float8_e4m3fn).to(torch.bfloat16)
    keys = (keys * kv_scale.index_select(0, flat).to(torch.bfloat16)[:, None]).view(rows, k, dim)
    scores = torch.bmm(q, keys.transpose(1, 2)).float() * sm_scale  # [R, H, K], fp32 softmax
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(torch.bfloat16)  # NaN on rows without any valid position
    out = torch.bmm(probs, keys[:, :, :LATENT_DIM])  # [R, H, 512]
    return torch.where(valid.any(dim=1)[:, None, None], out, 0.0).to(torch.bfloat16)


def sparse_mla_dense_ref(q, kv_latent, kv_scale, block_table, topk_indices, sm_scale: float = DEFAULT_SM_SCALE):
    """Test reference: float64 attention over each request's whole logical context, masked to the listed
    positions (a mask, not a gather). Same arguments; returns float64 [R, H, 512]."""
    rows, heads, dim = q.shape
    batch, width = block_table.shape
    next_n = rows // batch
    deq = kv_latent.double() * kv_scale.double()[:, None]  # [slots, 576]
    out = torch.zeros(rows, heads, LATENT_DIM, dtype=torch.float64)
    for r in range(rows):
        b = r // next_n
        listed = topk_indices[r][topk_indices[r] >= 0].long()
        if listed.numel() == 0:
            continue
        logical = torch.arange(width * T)
        keys = deq[block_table[b].long()[logical // T] * T + logical % T]  # [W*T, 576], logical order
        mask = torch.zeros(width * T, dtype=torch.bool)
        mask[listed] = True
        s = (q[r].double() @ keys.T) * sm_scale  # [H, W*T]
        p = torch.softmax(s.masked_fill(~mask, float("-inf")), dim=-1)
        out[r] = p @ keys[:, :LATENT_DIM]
    return out
