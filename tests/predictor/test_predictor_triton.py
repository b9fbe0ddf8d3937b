"""The predictor's Triton twins (fused block scores, fused EMA update) against the torch path, under
TRITON_INTERPRET=1 on the CPU (tiny shapes) or on CUDA."""
import pytest
import torch

from spin_indexer.indexer.block_plan import BlockPlan
from spin_indexer.predictor.config import Combine, Pooling, Reduce
from spin_indexer.predictor.score import block_scores
from spin_indexer.predictor.update import update_history

pytestmark = pytest.mark.interpreter
T = 64


def _tables(slots, cols, dtype, gen, missing=0.3):
    v = torch.randn(slots, cols + 1, generator=gen) * 3
    d = torch.randn(slots, cols + 1, generator=gen) * 3
    v[torch.rand(v.shape, generator=gen) < missing] = float("-inf")
    d[torch.rand(d.shape, generator=gen) < missing] = float("-inf")
    return v.to(dtype), d.to(dtype)


@pytest.mark.parametrize("combine", list(Combine))
@pytest.mark.parametrize("reduce", [Reduce.MAX, Reduce.MEAN])
def test_block_scores_twin_matches_torch(combine, reduce, triton_device, gen):
    from spin_indexer.predictor.score_triton import block_scores_triton
    width, slots = 5, 4
    v, d = _tables(slots, width * T, torch.float16, gen)
    slot_ids = torch.tensor([3, 0, 2])
    lens = torch.tensor([[300, 301], [1, 2], [64 * 5 - 1, 64 * 5]])
    expected = block_scores(v[slot_ids, :width * T], d[slot_ids, :width * T], lens - 1, lens,
                            torch.zeros(3, dtype=torch.long), Pooling.A1, reduce, combine, T)
    dev = triton_device
    out = block_scores_triton(v.to(dev), d.to(dev), slot_ids.to(dev), (lens - 1).to(dev), lens.to(dev), width,
                              combine, reduce, T, blocks_per_program=2)
    torch.testing.assert_close(out.cpu(), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("next_n", [1, 2])
def test_ema_update_twin_matches_torch(next_n, triton_device, gen):
    from spin_indexer.predictor.update_triton import ema_update_triton
    width, slots, batch = 6, 3, 2
    v, d = _tables(slots, width * T, torch.float16, gen)
    keep = torch.rand(batch, width, generator=gen) < 0.6
    lengths = torch.tensor([64 * 5 + 10, 64 * 2 + 1])
    keep[0, 5] = keep[1, 2] = True  # newest blocks
    keep[1, 3:] = False
    seq_lens = (lengths[:, None] - next_n + torch.arange(next_n)[None, :] + 1).to(torch.int32)
    plan = BlockPlan.from_keep_mask(keep, torch.arange(batch * width, dtype=torch.int32).view(batch, width), seq_lens,
                                    torch.tensor([6, 3]), T)
    logits = torch.randn(batch, next_n, width * T, generator=gen) * 4
    logits[:, :, 7] = float("-inf")  # a masked column must not be observed
    slot_ids = torch.tensor([2, 0])
    rows = torch.tensor([[True] * next_n, [True] + [False] * (next_n - 1)])
    v_ref, d_ref = v.clone(), d.clone()
    update_history(v_ref, d_ref, slot_ids, logits, plan.positions(), plan.compact_seq_lens.long(),
                   seq_lens.long() - 1, rows, 0.5)
    dev = triton_device
    v_out, d_out = v.clone().to(dev), d.clone().to(dev)
    v_out[:, -1] = d_out[:, -1] = 123.0  # trash cells: the twin never needs them
    ema_update_triton(v_out, d_out, slot_ids.to(dev), logits.to(dev), plan.kept_blocks.to(dev),
                      plan.compact_seq_lens.to(dev), (seq_lens - 1).to(dev), rows.to(dev), 0.5, T,
                      blocks_per_program=2)
    torch.testing.assert_close(v_out[:, :-1].cpu().float(), v_ref[:, :-1].float(), rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(d_out[:, :-1].cpu().float(), d_ref[:, :-1].float(), rtol=1e-3, atol=1e-3)
    assert not torch.equal(v_out[:, :-1].cpu(), v[:, :-1])  # something was updated
