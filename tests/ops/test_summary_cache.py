"""The summary cache (ops.write_block_summaries, ops.paged_summary_scores): the references against an independent
float64 recomputation from the cache bytes, the Triton twins against the references (under TRITON_INTERPRET=1 off
the GPU) into poisoned outputs; partial ranges, shared prefix blocks, one block, next_n 1-4, an empty batch,
garbage past the used blocks, bad arguments refused before anything is written."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import E4M3FN, FP8_MMA_RTOL, T, decode_fp8, make_paged_inputs, split_cache_bytes
from spin_indexer import ops
from spin_indexer.ops.block_summary import paged_summary_scores_ref, write_block_summaries_ref

HEADS, DIM = 4, 32
POISON = 0xAB  # summary bytes no write touched must keep


def poisoned_summaries(kv_cache: torch.Tensor, parts: int) -> torch.Tensor:
    return torch.full((kv_cache.shape[0], parts, 1, kv_cache.shape[3]), POISON, dtype=torch.uint8,
                      device=kv_cache.device)


def ranges(inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """(first, stop) int32 [B]: every full block of row 0 but the first of request 0 (a range not from 0)."""
    stop = (inputs.seq_lens[:, 0] // T).to(torch.int32)
    first = torch.zeros_like(stop)
    if len(first):
        first[0] = min(1, int(stop[0]))
    return first, stop


def expected_means(inputs, first, stop, parts) -> dict[int, np.ndarray]:
    """physical block -> float64 [S, D] sub-block means of its dequantized keys, for every written block."""
    values, scales = split_cache_bytes(inputs.kv_cache)
    keys = E4M3FN[values] * scales[..., None]  # [num_blocks, T, D]
    out = {}
    for b in range(len(first)):
        for j in range(int(first[b]), int(stop[b])):
            blk = int(inputs.block_table[b, j])
            out[blk] = keys[blk].reshape(parts, T // parts, -1).mean(axis=1)
    return out


@pytest.mark.parametrize("parts", [1, 4, 16, 64])
def test_write_reference_stores_quantized_means(parts, gen):
    inputs = make_paged_inputs((5 * T + 7, 2 * T, T - 3, 3 * T), 1, HEADS, DIM, gen)
    first, stop = ranges(inputs)
    summaries = poisoned_summaries(inputs.kv_cache, parts)
    write_block_summaries_ref(inputs.kv_cache, summaries, inputs.block_table, first, stop)
    want = expected_means(inputs, first, stop, parts)
    values, scales = split_cache_bytes(summaries)
    for blk in range(summaries.shape[0]):
        if blk not in want:  # never written: the poison is intact
            assert (summaries[blk].numpy() == POISON).all()
            continue
        scale = scales[blk].astype(np.float64)  # [S]
        amax = np.abs(want[blk]).max(axis=1)
        assert np.all(np.log2(scale) == np.round(np.log2(scale)))  # powers of two
        assert np.all(amax / scale <= 448) and np.all(amax / scale > 224 - 1e-9)  # the tightest such scale
        got = E4M3FN[values[blk]] * scale[:, None]
        # e4m3 keeps 3 mantissa bits: half a unit is 2^-4 of the value (2^-10 of the scale in subnormals)
        assert np.all(np.abs(got - want[blk]) <= np.abs(want[blk]) * 2.0 ** -4 + scale[:, None] * 2.0 ** -10)


def test_write_twin_matches_reference(triton_device, gen):
    inputs = make_paged_inputs((5 * T + 7, 2 * T, T - 3, 3 * T), 1, HEADS, DIM, gen)
    first, stop = ranges(inputs)
    for parts in (4, 16):
        want = poisoned_summaries(inputs.kv_cache, parts)
        write_block_summaries_ref(inputs.kv_cache, want, inputs.block_table, first, stop)
        got = poisoned_summaries(inputs.kv_cache, parts).to(triton_device)
        from spin_indexer.ops.block_summary_triton import write_block_summaries_triton
        write_block_summaries_triton(inputs.kv_cache.to(triton_device), got, inputs.block_table.to(triton_device),
                                     first.to(triton_device), stop.to(triton_device))
        got = got.cpu()
        gv, gs = split_cache_bytes(got)
        wv, ws = split_cache_bytes(want)
        assert np.array_equal(gs, ws)  # the same power-of-two scales (poison where nothing was written)
        # the means may differ in their last float bit (summation order): at most one fp8 step apart, rarely
        diff = np.abs(E4M3FN[gv].astype(np.float64) - E4M3FN[wv])
        step = np.maximum(np.abs(E4M3FN[wv]) * 2.0 ** -3, 2.0 ** -9)
        assert np.all(np.isnan(diff) | (diff <= step + 1e-12)) and np.mean(gv == wv) > 0.99
        assert np.array_equal(np.isnan(E4M3FN[gv]), np.isnan(E4M3FN[wv]))


def test_write_shared_prefix_and_empty_ranges(gen):
    """Two requests sharing their first two physical blocks write identical bytes there (a summary is the block's
    own property); first == stop writes nothing; an empty batch is a no-op."""
    inputs = make_paged_inputs((3 * T, 3 * T), 1, HEADS, DIM, gen, extra_width=0)
    table = inputs.block_table.clone()
    table[1, :2] = table[0, :2]
    alone = poisoned_summaries(inputs.kv_cache, 4)
    write_block_summaries_ref(inputs.kv_cache, alone, table[:1], torch.tensor([0], dtype=torch.int32),
                              torch.tensor([2], dtype=torch.int32))
    both = poisoned_summaries(inputs.kv_cache, 4)
    write_block_summaries_ref(inputs.kv_cache, both, table, torch.zeros(2, dtype=torch.int32),
                              torch.full((2,), 2, dtype=torch.int32))
    assert torch.equal(both, alone)
    same = both.clone()
    write_block_summaries_ref(inputs.kv_cache, both, table, torch.full((2,), 1, dtype=torch.int32),
                              torch.full((2,), 1, dtype=torch.int32))
    assert torch.equal(both, same)
    # a summary cache with more rows than the key cache has blocks (SpinState sizes it for num_cache_blocks)
    bigger = torch.full((both.shape[0] + 3, *both.shape[1:]), POISON, dtype=torch.uint8)
    ops.write_block_summaries(inputs.kv_cache, bigger, table, torch.zeros(2, dtype=torch.int32),
                              torch.full((2,), 2, dtype=torch.int32))
    assert torch.equal(bigger[:both.shape[0]], both) and (bigger[both.shape[0]:] == POISON).all()
    empty = make_paged_inputs((), 1, HEADS, DIM, gen)
    none = torch.zeros(0, dtype=torch.int32)
    write_block_summaries_ref(empty.kv_cache, poisoned_summaries(empty.kv_cache, 4), empty.block_table, none, none)


def test_write_refuses_bad_arguments_without_writing(gen):
    inputs = make_paged_inputs((3 * T,), 1, HEADS, DIM, gen)
    summaries = poisoned_summaries(inputs.kv_cache, 4)
    first, stop = torch.zeros(1, dtype=torch.int32), torch.full((1,), 3, dtype=torch.int32)
    bad_table = inputs.block_table.clone()
    bad_table[0, 1] = inputs.kv_cache.shape[0]  # one past the cache
    cases = [
        (dict(summaries=poisoned_summaries(inputs.kv_cache, 3)), ValueError, "summaries: expected shape"),
        (dict(summaries=summaries[:-1]), ValueError, "summaries: expected shape"),
        (dict(summaries=summaries.view(torch.int8)), TypeError, "summaries"),
        (dict(stop=torch.full((1,), inputs.block_table.shape[1] + 1, dtype=torch.int32)), ValueError, "stop"),
        (dict(first=torch.full((1,), -1, dtype=torch.int32)), ValueError, "first"),
        (dict(first=first.long()), TypeError, "first"),
        (dict(block_table=bad_table), ValueError, "block_table"),
    ]
    for change, exc, needle in cases:
        args = dict(kv_cache=inputs.kv_cache, summaries=summaries, block_table=inputs.block_table, first=first,
                    stop=stop)
        args.update(change)
        with pytest.raises(exc, match=needle):
            ops.write_block_summaries(**args)
        assert (summaries.numpy() == POISON).all()


def written_cache(inputs, parts):
    first, stop = torch.zeros(len(inputs.seq_lens), dtype=torch.int32), (inputs.seq_lens[:, 0] // T).to(torch.int32)
    summaries = poisoned_summaries(inputs.kv_cache, parts)
    write_block_summaries_ref(inputs.kv_cache, summaries, inputs.block_table, first, stop)
    return summaries, stop


def scores_f64(inputs, summaries, count) -> np.ndarray:
    q = decode_fp8(inputs.q_fp8)  # [B, N, H, D]
    batch, next_n = q.shape[:2]
    w = inputs.weights.double().numpy().reshape(batch, next_n, -1)
    values, scales = split_cache_bytes(summaries)
    means = E4M3FN[values] * scales[..., None]  # [num_blocks, S, D]
    out = np.full(inputs.block_table.shape, -np.inf)
    for b in range(batch):
        for j in range(min(int(count[b]), out.shape[1])):
            blk = int(inputs.block_table[b, j])
            per_head = np.maximum(np.einsum("nhd,sd->nhs", q[b], means[blk]), 0.0)  # [N, H, S]
            out[b, j] = float(np.max(np.einsum("nh,nhs->ns", w[b], per_head)))
    return out


@pytest.mark.parametrize("next_n", [1, 2, 4])
@pytest.mark.parametrize("parts", [1, 8, 64])
def test_scores_reference_matches_float64(next_n, parts, gen):
    inputs = make_paged_inputs((4 * T + 9, T, 30, 2 * T), next_n, HEADS, DIM, gen, extra_width=2)
    summaries, count = written_cache(inputs, parts)
    count[1] = 0  # a request with nothing summarized yet scores -inf everywhere
    got = ops.paged_summary_scores(inputs.q_fp8, summaries, inputs.weights, inputs.block_table, count)
    want = scores_f64(inputs, summaries, count)
    assert np.array_equal(np.isneginf(got.numpy()), np.isneginf(want))
    live = np.isfinite(want)
    assert live.sum() >= 5
    np.testing.assert_allclose(got.numpy()[live], want[live], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("next_n", [1, 3, 4])
@pytest.mark.parametrize("parts", [1, 4, 16])
@pytest.mark.parametrize("tiles", [1, 3, 4])
def test_scores_twin_matches_reference(triton_device, next_n, parts, tiles, gen):
    from spin_indexer.ops.block_summary_triton import paged_summary_scores_triton

    # 20 blocks: more than one tile's J blocks at S = 4 (16) and S = 16 (4), and with 1 or 3 tiles a program more
    # than one program a request, the last one partly past W; a count past W reads as W
    inputs = make_paged_inputs((20 * T + 3, 7 * T, T), next_n, HEADS, DIM, gen, extra_width=3)
    summaries, count = written_cache(inputs, parts)
    count[2] = inputs.block_table.shape[1] + 5
    want = paged_summary_scores_ref(inputs.q_fp8, summaries, inputs.weights, inputs.block_table, count,
                                    validate=False)
    dev = triton_device
    batch, width = inputs.block_table.shape
    wider = torch.full((batch, width + 3), float("nan"), device=dev)  # out: a wider buffer's leading columns
    out = wider[:, :width]
    got = paged_summary_scores_triton(inputs.q_fp8.to(dev), summaries.to(dev), inputs.weights.to(dev),
                                      inputs.block_table.to(dev), count.to(dev), validate=False, out=out,
                                      score_tiles=tiles)
    assert got is out and bool(wider[:, width:].isnan().all())
    got = got.cpu()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and not got.isnan().any()
    live = torch.isfinite(want)
    if dev == "cuda":  # the fp8 MMA's ~14-bit accumulator: bounded by the magnitude of the terms, as the logits
        err = (got - want).abs()[live].double()
        bound = FP8_MMA_RTOL * score_magnitude(inputs, summaries)[live] + 1e-6
        assert bool((err <= bound).all()), f"scores off by {float((err - bound).max()):.3e} past the bound"
    else:
        torch.testing.assert_close(got[live], want[live], rtol=1e-4, atol=1e-5)


def score_magnitude(inputs, summaries) -> torch.Tensor:
    """float64 [B, W]: each block's largest sum of |terms| over its rows and sub-blocks, sum_h |w_h| |q_h| . |mean|
    (what an accumulator's relative rounding scales with)."""
    values, scales = split_cache_bytes(summaries)
    means = torch.from_numpy(np.abs(E4M3FN[values] * scales[..., None]))  # [num_blocks, S, D]
    q = torch.from_numpy(np.abs(decode_fp8(inputs.q_fp8)))  # [B, N, H, D]
    w = inputs.weights.double().abs().view(*q.shape[:3])
    ids = inputs.block_table.long().clamp(0, means.shape[0] - 1)
    per = torch.einsum("bnhd,bwsd->bnhws", q, means[ids])  # [B, N, H, W, S]
    return (per * w[..., None, None]).sum(dim=2).amax(dim=3).amax(dim=1)


def test_scores_follow_the_float_means(gen):
    """Scored from the cache the write filled, a full block's score is block_summary_scores_ref's (float means)
    within what the means' fp8 rounding allows (ReLU is 1-Lipschitz: |d score| <= max over rows and sub-blocks of
    sum_h |w_h| sum_d |q_hd| |d mean_d|, with |d mean_d| <= 2^-4 |mean_d| + 2^-10 scale): the two forms agree."""
    inputs = make_paged_inputs((6 * T, 3 * T + 1), 2, HEADS, DIM, gen, extra_width=0)
    summaries, count = written_cache(inputs, 4)
    cached = ops.paged_summary_scores(inputs.q_fp8, summaries, inputs.weights, inputs.block_table, count)
    direct = ops.block_summary_scores(*inputs.args(), parts=4)
    full = torch.isfinite(cached)
    assert int(full.sum()) == int(count.sum()) and int(full.sum()) >= 8
    means = expected_means(inputs, torch.zeros_like(count), count, 4)  # physical block -> float64 [S, D]
    _, scales = split_cache_bytes(summaries)
    q = np.abs(decode_fp8(inputs.q_fp8))  # [B, N, H, D]
    w = np.abs(inputs.weights.double().numpy()).reshape(q.shape[:3])
    for b in range(len(count)):
        for j in range(int(count[b])):
            blk = int(inputs.block_table[b, j])
            dmean = np.abs(means[blk]) * 2.0 ** -4 + scales[blk][:, None] * 2.0 ** -10  # [S, D]
            bound = np.max(np.einsum("nh,nhd,sd->ns", w[b], q[b], dmean))
            assert abs(float(cached[b, j]) - float(direct[b, j])) <= bound * (1 + 1e-6) + 1e-7


def test_scores_refuse_bad_arguments(gen):
    inputs = make_paged_inputs((3 * T,), 1, HEADS, DIM, gen)
    summaries, count = written_cache(inputs, 4)
    args = (inputs.q_fp8, summaries, inputs.weights, inputs.block_table, count)
    with pytest.raises(TypeError, match="num_summarized"):
        ops.paged_summary_scores(*args[:4], count.long())
    with pytest.raises(ValueError, match="summaries"):
        ops.paged_summary_scores(args[0], summaries[..., :-1], *args[2:])
    bad = inputs.block_table.clone()
    bad[0, 0] = -1
    with pytest.raises(ValueError, match="block_table"):
        ops.paged_summary_scores(*args[:3], bad, count)
    empty = make_paged_inputs((), 2, HEADS, DIM, gen)
    none = torch.zeros(0, dtype=torch.int32)
    assert ops.paged_summary_scores(empty.q_fp8, poisoned_summaries(empty.kv_cache, 4), empty.weights,
                                    empty.block_table, none).shape == (0, empty.block_table.shape[1])


@pytest.mark.parametrize("next_n,parts,tiles", [(1, 1, 1), (1, 4, 1), (1, 4, 4), (3, 16, 2)])
def test_update_and_score_twin_matches_write_then_score(triton_device, next_n, parts, tiles, gen):
    """ops.update_and_score_summaries (the decode step's one launch: each scoring program first writes its own
    blocks that filled) equals the reference's write then score: the written rows (scales exact, values within an
    fp8 step, poison elsewhere) and the scores. The ranges: most of a 20-block request from block 3 (several
    programs write), nothing to write (first == stop), a request sharing request 0's first blocks whose range
    covers them too (both write the same bytes), an empty range at 0."""
    from spin_indexer.ops.block_summary import update_and_score_summaries_ref
    from spin_indexer.ops.block_summary_triton import update_and_score_summaries_triton

    inputs = make_paged_inputs((20 * T + 3, 7 * T, 6 * T + 1, T - 1), next_n, HEADS, DIM, gen, extra_width=2)
    table = inputs.block_table.clone()
    table[2, :4] = table[0, :4]
    stop = (inputs.seq_lens[:, 0] // T).to(torch.int32)
    first = torch.tensor([3, int(stop[1]), 0, 0], dtype=torch.int32)
    base = poisoned_summaries(inputs.kv_cache, parts)
    write_block_summaries_ref(inputs.kv_cache, base, table, torch.zeros_like(first), first)  # written before
    want_cache = base.clone()
    want = update_and_score_summaries_ref(inputs.q_fp8, inputs.kv_cache, want_cache, inputs.weights, table, first,
                                          stop)
    dev = triton_device
    got_cache = base.clone().to(dev)
    out = torch.full(table.shape, float("nan"), device=dev)
    got = update_and_score_summaries_triton(inputs.q_fp8.to(dev), inputs.kv_cache.to(dev), got_cache,
                                            inputs.weights.to(dev), table.to(dev), first.to(dev), stop.to(dev),
                                            out=out, score_tiles=tiles)
    assert got is out
    gv, gs = split_cache_bytes(got_cache.cpu())
    wv, ws = split_cache_bytes(want_cache)
    assert np.array_equal(gs, ws)  # the same blocks written, with the same power-of-two scales
    step = np.maximum(np.abs(E4M3FN[wv]) * 2.0 ** -3, 2.0 ** -9)
    diff = np.abs(E4M3FN[gv].astype(np.float64) - E4M3FN[wv])
    assert np.all(np.isnan(diff) | (diff <= step + 1e-12)) and np.mean(gv == wv) > 0.99
    assert not np.array_equal(ws, split_cache_bytes(base)[1])  # something was written
    got = got.cpu()
    assert torch.equal(torch.isneginf(got), torch.isneginf(want)) and not got.isnan().any()
    live = torch.isfinite(want)
    assert int(live.sum()) == int(stop.sum())
    torch.testing.assert_close(got[live], want[live], rtol=1e-3, atol=1e-4)  # rows an fp8 step apart, rarely


def test_update_and_score_refuses_bad_arguments_without_writing(gen):
    inputs = make_paged_inputs((3 * T,), 1, HEADS, DIM, gen)
    summaries = poisoned_summaries(inputs.kv_cache, 4)
    first, stop = torch.zeros(1, dtype=torch.int32), torch.full((1,), 3, dtype=torch.int32)
    args = dict(q_fp8=inputs.q_fp8, kv_cache=inputs.kv_cache, summaries=summaries, weights=inputs.weights,
                block_table=inputs.block_table, first=first, stop=stop)
    cases = [(dict(stop=torch.full((1,), inputs.block_table.shape[1] + 1, dtype=torch.int32)), ValueError, "stop"),
             (dict(weights=inputs.weights[:, :2]), ValueError, "weights"),
             (dict(out=torch.empty(2, 2)), ValueError, "out")]
    for change, exc, needle in cases:
        with pytest.raises(exc, match=needle):
            ops.update_and_score_summaries(**{**args, **change})
        assert (summaries.numpy() == POISON).all()
