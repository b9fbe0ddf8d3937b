"""The fused select + compact + mark-seen kernel against the torch path (select_blocks, BlockPlan,
mark_seen), under TRITON_INTERPRET=1 on the CPU or on CUDA: ties, -inf scores, never-seen and newest
blocks, short contexts, exploration on/off, several chunks per row."""
import pytest
import torch

from spin_indexer.indexer.block_plan import BlockPlan
from spin_indexer.predictor.config import Exploration
from spin_indexer.predictor.select import explore_blocks, budget_blocks, layer_hash, select_blocks, step_hash
from spin_indexer.predictor.update import mark_seen

pytestmark = pytest.mark.interpreter
T = 64


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("explore", [True, False])
def test_fused_select_matches_torch(seed, explore, triton_device):
    from spin_indexer.predictor.select_triton import select_compact_triton
    g = torch.Generator().manual_seed(seed)
    batch, width, next_n, slots, layer = 5, 37, 2, 7, 3
    n = torch.randint(0, width + 1, (batch,), generator=g)
    n[0] = width
    lens_last = torch.where(n > 0, (n - 1) * T + torch.randint(1, T + 1, (batch,), generator=g), 0)
    seq_lens = torch.where(lens_last[:, None] > 0, lens_last[:, None] - next_n + 1 + torch.arange(next_n)[None, :],
                           0).clamp_min(0).to(torch.int32)
    keep_all = lens_last <= 3 * T  # topk = 192
    blocks = torch.arange(width)[None, :]
    valid = blocks < n[:, None]
    first_new = (seq_lens.long().amin(dim=1) - 1).clamp_min(0) // T
    newest = valid & (blocks >= first_new[:, None])
    scores = torch.randint(-3, 4, (batch, width), generator=g).float()  # many ties
    scores[torch.rand(batch, width, generator=g) < 0.1] = float("-inf")
    slot_ids = torch.randperm(slots, generator=g)[:batch]
    last_seen = torch.randint(-1, 5, (slots, width + 1), generator=g).to(torch.int32)
    step = torch.randint(5, 9, (batch,), generator=g).to(torch.int32)
    policy = Exploration.RANDOM if explore else Exploration.NONE
    budget = budget_blocks(n, 0.45, 192, T, keep_all)
    explore_n = explore_blocks(budget, 0.2, policy, keep_all)
    update_any = torch.tensor([True, False, True, True, True])
    table = torch.randint(0, 1000, (batch, width), generator=g).to(torch.int32)
    hashes = step_hash(11, slot_ids, step, width)

    # torch path
    last = last_seen[slot_ids, :width]
    forced = newest | (valid & (last < 0)) | (valid & keep_all[:, None])
    h = layer_hash(hashes, layer)
    keep = select_blocks(scores[:, None, :], valid, forced, budget, explore_n, policy, h.float() / 2**31,
                         torch.zeros(batch, width, dtype=torch.long), hashes=h,
                         max_explore=int(0.2 * width + 0.5))
    plan = BlockPlan.from_keep_mask(keep, table, seq_lens, n, T)
    seen_ref = last_seen.clone()
    mark_seen(seen_ref, slot_ids, step, plan.kept_blocks.long(), update_any[:, None])

    dev = triton_device
    seen = last_seen.clone().to(dev)
    out = select_compact_triton(scores.to(dev), seen, slot_ids.to(dev), step.to(dev), hashes.to(dev), layer,
                                n.to(dev), first_new.to(dev), keep_all.to(dev), budget.to(dev),
                                explore_n.to(dev), table.to(dev), seq_lens.to(dev), update_any.to(dev),
                                explore, T, chunk=16)
    keep_k, kept_k, table_k, clen_k, nkept_k = (t.cpu() for t in out)
    assert torch.equal(keep_k, keep)
    assert torch.equal(kept_k, plan.kept_blocks)
    assert torch.equal(table_k, plan.compact_block_table)
    assert torch.equal(clen_k, plan.compact_seq_lens)
    assert torch.equal(nkept_k, plan.num_kept)
    assert torch.equal(seen.cpu()[:, :width], seen_ref[:, :width])
