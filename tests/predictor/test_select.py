import pytest
import torch
from hypothesis import given, strategies as st

from spin_indexer.predictor.config import Exploration
from spin_indexer.predictor.select import budget_blocks, budget_of, rank_of, select_blocks, uniform_hash


def test_uniform_hash_is_reproducible_and_spread():
    slots, steps = torch.tensor([0, 1, 5]), torch.tensor([3, 3, 9])
    a = uniform_hash(7, 2, slots, steps, 1000)
    assert torch.equal(a, uniform_hash(7, 2, slots, steps, 1000))
    assert not torch.equal(a, uniform_hash(8, 2, slots, steps, 1000))
    assert not torch.equal(a, uniform_hash(7, 2, slots, steps + 1, 1000))
    assert (a >= 0).all() and (a < 1).all()
    assert abs(a.mean().item() - 0.5) < 0.03 and not torch.equal(a[0], a[1])


def test_rank_of_ties_go_to_the_lower_index():
    assert rank_of(torch.tensor([1.0, 3.0, 3.0, 0.0])).tolist() == [2, 0, 1, 3]


@given(width=st.integers(1, 40), seed=st.integers(0, 10**6), sparsity=st.floats(0.0, 0.9),
       gamma=st.sampled_from([0.0, 0.05, 0.3]),
       policy=st.sampled_from(list(Exploration)), rows=st.integers(1, 3))
def test_counts_hold_for_random_shapes(width, seed, sparsity, gamma, policy, rows):
    g = torch.Generator().manual_seed(seed)
    batch = 3
    n = torch.randint(0, width + 1, (batch,), generator=g)
    blocks = torch.arange(width)[None, :]
    valid = blocks < n[:, None]
    forced = valid & (torch.rand(batch, width, generator=g) < 0.1)
    budget = torch.minimum(n, torch.clamp(n - torch.floor(n * sparsity).long(), min=0))
    explore = torch.floor(budget * gamma + 0.5).long()
    scores = torch.randn(batch, rows, width, generator=g)
    u = torch.rand(batch, width, generator=g)
    age = torch.randint(0, 9, (batch, width), generator=g)
    keep = select_blocks(scores, valid, forced, budget, explore, policy, u, age)
    kept = keep.sum(1)
    assert not (keep & ~valid).any(), "an invalid block was kept"
    assert (keep | ~forced).all(), "a forced block was dropped"
    nf = forced.sum(1)
    if rows == 1:
        expected = torch.maximum(nf, budget) if policy is not Exploration.NONE else torch.maximum(nf, budget - explore)
        assert torch.equal(kept, expected)
    else:
        assert (kept >= torch.minimum(budget, n) - (explore if policy is Exploration.NONE else 0)).all()
        assert (kept <= n).all()


def test_stage_one_takes_the_best_blocks_and_exploration_the_rest():
    scores = torch.tensor([[[5.0, 1.0, 4.0, 3.0, 2.0, 0.0]]])
    valid = torch.ones(1, 6, dtype=torch.bool)
    forced = torch.zeros(1, 6, dtype=torch.bool)
    forced[0, 5] = True  # newest block
    u = torch.tensor([[0.0, 0.9, 0.0, 0.0, 0.1, 0.0]])
    keep = select_blocks(scores, valid, forced, torch.tensor([4]), torch.tensor([1]), Exploration.RANDOM, u,
                         torch.zeros(1, 6, dtype=torch.long))
    # stage 1: forced 5 then best (0, 2) = 3 blocks; exploration: highest uniform among {1, 3, 4} -> 1
    assert keep[0].nonzero().flatten().tolist() == [0, 1, 2, 5]
    age = torch.tensor([[0, 1, 0, 7, 2, 0]])
    keep = select_blocks(scores, valid, forced, torch.tensor([4]), torch.tensor([1]), Exploration.BLOCK_AGE, u, age)
    assert keep[0].nonzero().flatten().tolist() == [0, 2, 3, 5]
    keep = select_blocks(scores, valid, forced, torch.tensor([4]), torch.tensor([1]), Exploration.STALENESS, u,
                         torch.tensor([[0, 3, 0, 3, 3, 0]]))
    # equal ages among candidates 1, 3, 4: the best predicted (block 3, score 3) wins
    assert keep[0].nonzero().flatten().tolist() == [0, 2, 3, 5]


@pytest.mark.parametrize("seed", range(6))
def test_random_exploration_by_top_k_equals_the_sort(seed):
    g = torch.Generator().manual_seed(seed)
    batch, width = 4, 48
    n = torch.randint(1, width + 1, (batch,), generator=g)
    valid = torch.arange(width)[None, :] < n[:, None]
    forced = valid & (torch.arange(width)[None, :] == (n - 1)[:, None])
    budget = torch.clamp(n - n // 2, min=1)
    explore = torch.floor(budget * 0.25 + 0.5).long()
    scores = torch.randn(batch, 1, width, generator=g)
    hashes = torch.randint(0, 2**31, (batch, width), generator=g)
    u = hashes.float() / 2**31
    age = torch.zeros(batch, width, dtype=torch.long)
    by_sort = select_blocks(scores, valid, forced, budget, explore, Exploration.RANDOM, u, age, return_explored=True)
    by_topk = select_blocks(scores, valid, forced, budget, explore, Exploration.RANDOM, u, age, return_explored=True,
                            hashes=hashes, max_explore=int(0.25 * width + 0.5))
    assert torch.equal(by_sort[0], by_topk[0]) and torch.equal(by_sort[1], by_topk[1])
    assert (by_topk[1].sum(1) <= explore).all() and by_topk[1].any()


@given(st.integers(1, 20000), st.sampled_from([0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 0.99]),
       st.sampled_from([64, 512, 2048]))
def test_budget_of_is_budget_blocks_for_one_request(num_blocks, sparsity, topk):
    """The host-int budget (a launch-size hint) is the device rule's, for a request past keep-all."""
    want = budget_blocks(torch.tensor([num_blocks]), sparsity, topk, 64, torch.tensor([False]))
    assert budget_of(num_blocks, sparsity, topk, 64) == int(want[0])
