import math

import pytest
import torch

from spin_indexer.predictor.config import Combine, Pooling, Reduce
from spin_indexer.predictor.score import block_scores, combine, gather_diagonal, pool_blocks

INF = math.inf


def test_gather_diagonal_aligns_offsets_to_the_query():
    diag = torch.tensor([[10.0, 11.0, 12.0, 13.0, 14.0, -1.0]])
    out = gather_diagonal(diag, torch.tensor([[3]]), num_cols=5)
    # position i reads offset 3 - i; position 4 is in the future
    assert out.tolist() == [[[13.0, 12.0, 11.0, 10.0, -INF]]]


def test_combine_rules_with_missing_values():
    v = torch.tensor([1.0, -INF, 3.0, -INF])
    d = torch.tensor([2.0, 5.0, -INF, -INF])
    assert combine(v, d, Combine.MAX).tolist() == [2.0, 5.0, 3.0, -INF]
    assert combine(v, d, Combine.SUM).tolist() == [3.0, 10.0, 6.0, -INF]
    assert combine(v, d, Combine.VERTICAL).tolist() == v.tolist()
    assert combine(v, d, Combine.DIAGONAL).tolist() == d.tolist()


def test_pool_blocks_max_mean_top4_ignore_missing_slots():
    x = torch.tensor([[1.0, 2.0, 3.0, 10.0, 5.0, -INF, -INF, -INF, -INF, -INF, -INF, -INF]])
    assert pool_blocks(x, 6, Reduce.MAX).tolist() == [[10.0, -INF]]
    assert pool_blocks(x, 6, Reduce.MEAN)[0].tolist() == pytest.approx([4.2, -INF])
    assert pool_blocks(x, 6, Reduce.TOP4).tolist() == [[5.0, -INF]]  # (10 + 5 + 3 + 2) / 4


def _history(T=4):
    # 3 blocks of 4 slots; V peaks in block 0, D peaks at offset 1 (the slot just before the query)
    v = torch.tensor([[9.0, 0, 0, 0, 1, 1, 1, 1, 0, 0, 0, 0]])
    d = torch.full((1, 12), 0.0)
    d[0, 1] = 8.0
    return v, d


def test_a1_and_a2_differ_only_where_v_and_d_peak_on_different_slots():
    v, d = _history()
    q, lens = torch.tensor([[10]]), torch.tensor([[11]])
    budget = torch.tensor([8])
    a1 = block_scores(v, d, q, lens, budget, Pooling.A1, Reduce.MAX, Combine.SUM, 4)
    a2 = block_scores(v, d, q, lens, budget, Pooling.A2, Reduce.MAX, Combine.SUM, 4)
    # slot 9 = offset 1 -> block 2 gets D's 8. A1-sum: block 0 = 9 + d[10..7]=0 -> 9; block 2 = max(0+8)=8
    assert a1.tolist() == [[[9.0, 1.0, 8.0]]]
    # A2 pools first: block 0 = max V 9 + max D over offsets 10..7 = 0 -> 9; block 2: 0 + 8
    assert a2.tolist() == [[[9.0, 1.0, 8.0]]]
    v2 = v.clone()
    v2[0, 8] = 5.0  # V peak in block 2 on another slot than D's peak (slot 9)
    a1b = block_scores(v2, d, q, lens, budget, Pooling.A1, Reduce.MAX, Combine.SUM, 4)
    a2b = block_scores(v2, d, q, lens, budget, Pooling.A2, Reduce.MAX, Combine.SUM, 4)
    assert a1b[0, 0, 2] == 8.0 and a2b[0, 0, 2] == 13.0  # A2 adds peaks that never coincide


def test_a0_keeps_only_blocks_holding_a_top_slot():
    v, d = _history()
    q, lens = torch.tensor([[11]]), torch.tensor([[12]])
    out = block_scores(v, torch.full_like(d, -INF), q, lens, torch.tensor([1]), Pooling.A0, Reduce.MAX,
                       Combine.MAX, 4)
    assert out.tolist() == [[[9.0, -INF, -INF]]]  # one slot of budget: only block 0's slot 0
