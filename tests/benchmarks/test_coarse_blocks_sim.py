"""benchmarks/coarse_blocks_sim.py: block key summaries and the closed-loop simulation, on random q / k (no model)."""
from __future__ import annotations

import torch

from conftest import import_benchmark

sim = import_benchmark("coarse_blocks_sim")
T = sim.T


def _inputs(rows=6, context=5 * T + 9, heads=4, dim=16, repeat=1, seed=0):
    """q [rows, H, D], w [rows, H], keys [context + rows, D]; each run of `repeat` keys identical."""
    gen = torch.Generator().manual_seed(seed)
    n = context + rows
    keys = torch.randn(-(-n // repeat), dim, generator=gen).repeat_interleave(repeat, dim=0)[:n]
    return torch.randn(rows, heads, dim, generator=gen), torch.rand(rows, heads, generator=gen), keys


def test_summaries_of_constant_sub_blocks_are_exact():
    """Keys constant over each 8-token run: the sub8 summary of a block is its exact best token score."""
    q, w, keys = _inputs(repeat=8)
    length = keys.shape[0] - 3  # a partial last block
    exact = torch.einsum("hd,nd->hn", q[0], keys[:length]).relu().mul(w[0][:, None]).sum(0)
    nb = -(-length // T)
    padded = torch.full((nb * T,), float("-inf"))
    padded[:length] = exact
    got = sim.summary_scores(q[0], w[0], torch.nn.functional.pad(keys, (0, 0, 0, T)), length, "sub8")
    torch.testing.assert_close(got, padded.view(nb, T).amax(1))


def test_nothing_skipped_misses_nothing_and_the_warm_rows_are_not_scored():
    q, w, keys = _inputs()
    context = keys.shape[0] - q.shape[0]
    for config in ("hist", "mix-sub4-0.5", "coarse-mean"):
        misses, _ = sim.simulate(q, w, keys, context, 32, 0.0, config, warm=2, gamma=0.05,
                              gen=torch.Generator().manual_seed(0))
        assert misses == [0.0] * (q.shape[0] - 2)


def test_exact_summaries_choose_as_the_current_scores_do():
    """With exact summaries and no exploration, coarse-sub8 keeps the blocks of the highest current block maxima
    (the newest forced): its misses equal that choice's, computed here directly."""
    q, w, keys = _inputs(rows=5, repeat=8, seed=3)
    context, k, sparsity = keys.shape[0] - q.shape[0], 48, 0.5
    got, _ = sim.simulate(q, w, keys, context, k, sparsity, "coarse-sub8", warm=0, gamma=0.0,
                       gen=torch.Generator().manual_seed(0))
    want = []
    for r in range(q.shape[0]):
        length = context + r + 1
        nb = -(-length // T)
        row = torch.einsum("hd,nd->hn", q[r], keys[:length]).relu().mul(w[r][:, None]).sum(0)
        padded = torch.full((nb * T,), float("-inf"))
        padded[:length] = row
        keep = sim.choose(padded.view(nb, T).amax(1), sim.budget_of(nb, sparsity, k, T))
        topk = row.topk(k).indices.int()
        want.append(float(sim.miss_per_row(keep, topk[None], 1, T)[0]))
    assert len(got) == q.shape[0] and got == want


def test_standardized_puts_unseen_blocks_last_and_zmix_runs():
    z = sim.standardized(torch.tensor([1.0, 3.0, -1e30, 5.0]))
    torch.testing.assert_close(z[[0, 1, 3]], torch.tensor([-1.0, 0.0, 1.0]))
    assert z[2] == z.min()
    q, w, keys = _inputs()
    context = keys.shape[0] - q.shape[0]
    misses, _ = sim.simulate(q, w, keys, context, 32, 0.4, "zmix-sub4-0.5", warm=2, gamma=0.0,
                          gen=torch.Generator().manual_seed(0))
    assert len(misses) == q.shape[0] - 2 and all(0.0 <= m <= 1.0 for m in misses)


def _block_max(q, w, keys, length):
    """float32 [nb] the exact best token score of each block (w may be negative)."""
    exact = torch.einsum("hd,nd->hn", q, keys[:length]).relu().mul(w[:, None]).sum(0)
    nb = -(-length // T)
    padded = torch.full((nb * T,), float("-inf"))
    padded[:length] = exact
    return padded.view(nb, T).amax(1)


def test_bound_summaries_are_upper_bounds_and_tighten_with_sub_blocks():
    """Signed head weights, a partial last block: bound<S> >= every token's score in the block; bound1 >= bound2 >=
    bound4; keys constant over each 16-token run: bound4 is the exact block max."""
    for repeat in (1, 16):
        q, _, keys = _inputs(repeat=repeat, seed=1)
        w = torch.randn(q.shape[:2], generator=torch.Generator().manual_seed(2))
        length = keys.shape[0] - 3
        padded = torch.nn.functional.pad(keys, (0, 0, 0, T))
        want = _block_max(q[0], w[0], keys, length)
        got = {s: sim.summary_scores(q[0], w[0], padded, length, f"bound{s}") for s in (1, 2, 4)}
        for s in (1, 2, 4):
            assert (got[s] >= want - 1e-4).all()
        assert (got[1] >= got[2] - 1e-4).all() and (got[2] >= got[4] - 1e-4).all()
        if repeat == 16:
            torch.testing.assert_close(got[4], want)


def test_top1_with_a_fixed_query_chooses_as_the_current_scores_do():
    """The same query every row: the remembered best token of each (complete) block is its argmax, so coarse-top1
    keeps what the exact block maxima keep (here missing less than the mean keys do)."""
    q, w, keys = _inputs(rows=5, context=9 * T + 9, seed=4)
    q, w = q[:1].expand_as(q), w[:1].expand_as(w)
    context, k, sparsity = keys.shape[0] - q.shape[0], 8, 0.5
    got, _ = sim.simulate(q, w, keys, context, k, sparsity, "coarse-top1", warm=1, gamma=0.0,
                       gen=torch.Generator().manual_seed(0))
    want = []
    for r in range(1, q.shape[0]):
        length = context + r + 1
        keep = sim.choose(_block_max(q[r], w[r], keys, length), sim.budget_of(-(-length // T), sparsity, k, T))
        topk = torch.einsum("hd,nd->hn", q[r], keys[:length]).relu().mul(w[r][:, None]).sum(0).topk(k).indices
        want.append(float(sim.miss_per_row(keep, topk.int()[None], 1, T)[0]))
    assert got == want
    mean, _ = sim.simulate(q, w, keys, context, k, sparsity, "coarse-mean", warm=1, gamma=0.0,
                        gen=torch.Generator().manual_seed(0))
    assert sum(got) < sum(mean)


def test_bound_and_top_configs_parse_and_run():
    q, w, keys = _inputs()
    context = keys.shape[0] - q.shape[0]
    for config in ("coarse-bound2", "mix-bound4-0.7", "zmix-bound1-0.5", "coarse-top2", "mix-top1-0.5",
                   "zmix-top1+sub4-0.7"):
        for sparsity in (0.0, 0.4):
            misses, _ = sim.simulate(q, w, keys, context, 32, sparsity, config, warm=2, gamma=0.05,
                                  gen=torch.Generator().manual_seed(0))
            assert len(misses) == q.shape[0] - 2 and all(0.0 <= m <= 1.0 for m in misses)
            assert sparsity or misses == [0.0] * len(misses)


def test_xmix_with_this_rows_exact_block_maxima_chooses_as_the_current_scores_do():
    """xmix reads the previous layer's signals of the same rows; handed this layer's own exact block maxima ("all")
    at weight 1, it keeps what the exact current scores keep (test_exact_summaries' choice)."""
    q, w, keys = _inputs(rows=5, repeat=8, seed=3)
    context, k, sparsity = keys.shape[0] - q.shape[0], 48, 0.5
    exact, signals = sim.simulate(q, w, keys, context, k, sparsity, "coarse-sub8", warm=0, gamma=0.0,
                                  gen=torch.Generator().manual_seed(0))
    got, _ = sim.simulate(q, w, keys, context, k, sparsity, "xmix-all-1.0", warm=0, gamma=0.0,
                          gen=torch.Generator().manual_seed(0), prev=signals)
    assert got == exact
    # the kept signal is exact on the kept blocks and the history's prediction elsewhere; without prev, hist
    alone, _ = sim.simulate(q, w, keys, context, k, sparsity, "hist", warm=0, gamma=0.0,
                            gen=torch.Generator().manual_seed(0))
    first, _ = sim.simulate(q, w, keys, context, k, sparsity, "xmix-kept-0.5", warm=0, gamma=0.0,
                            gen=torch.Generator().manual_seed(0))
    assert first == alone


def test_layer_allocation_is_the_calibrators():
    """`layers`' allocation (means over documents) is eval.calibrate.allocate's on the same means."""
    from spin_indexer.eval.calibrate import allocate

    gen = torch.Generator().manual_seed(5)
    menu = [0.2, 0.3, 0.4, 0.5, 0.6]
    miss = {d: [[torch.rand(3, generator=gen).tolist() for _ in menu] for _ in range(4)] for d in ("a", "b")}
    mean = torch.tensor([[sum(sum(miss[d][layer][i]) for d in miss) / 6 for layer in range(4)]
                         for i in range(len(menu))], dtype=torch.float64)
    assert sim.allocate(miss, ["a", "b"], menu, 0.4) == allocate(mean, menu, 0.4)
