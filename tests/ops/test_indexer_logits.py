"""Paged indexer logits and block max against an independent float64 recomputation from the raw cache
bytes (tests/conftest.py: logits_f64), on the odd-shape list and on random shapes; every error path."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from conftest import (GARBAGE_IDS, ODD_IDS, ODD_SHAPES, T, assert_logits_close, logits_f64, make_case_inputs,
                      make_paged_inputs, random_cache)
from spin_indexer.ops import block_max, block_max_ref, paged_indexer_logits, paged_indexer_logits_ref


def check_against_f64(inputs, fn=paged_indexer_logits):
    got = fn(*inputs.args())
    rows = inputs.q_fp8.shape[0] * inputs.q_fp8.shape[1]
    assert got.dtype == torch.float32 and got.device == inputs.q_fp8.device
    assert got.shape == (rows, inputs.block_table.shape[1] * T)
    want, mag = logits_f64(*inputs.args())
    assert_logits_close(got, want, mag)
    return got


# ------------------------------------------------------------------------------------------ correctness
@pytest.mark.parametrize("case", ODD_SHAPES, ids=ODD_IDS)
def test_odd_shapes_match_float64(case, gen, device):
    inputs = make_case_inputs(case, gen).to(device)
    check_against_f64(inputs, paged_indexer_logits)
    if device == "cpu":
        return
    check_against_f64(inputs, paged_indexer_logits_ref)  # on cuda the public op ran the Triton twin


@given(seed=st.integers(0, 2**31 - 1),
       lengths=st.lists(st.integers(0, 260), min_size=0, max_size=3),
       next_n=st.sampled_from([1, 2, 4]), heads=st.sampled_from([8, 64]), dim=st.sampled_from([16, 128]),
       extra_width=st.integers(0, 2))
def test_random_shapes_match_float64(seed, lengths, next_n, heads, dim, extra_width):
    gen = torch.Generator().manual_seed(seed)
    inputs = make_paged_inputs(lengths, next_n, heads, dim, gen, extra_width=extra_width)
    check_against_f64(inputs)


def test_columns_at_or_past_each_row_length_are_minus_inf(gen):
    inputs = make_paged_inputs((130, 1, 64, 0), 4, 8, 32, gen, extra_width=2)  # row lengths floored at 0
    got = paged_indexer_logits(*inputs.args())
    lens = inputs.seq_lens.reshape(-1, 1).long()
    cols = torch.arange(got.shape[1])[None, :]
    assert torch.isneginf(got[cols >= lens]).all()
    assert torch.isfinite(got[cols < lens]).all()


def test_garbage_past_used_blocks_is_ignored(gen):
    """Columns of the block table past a request's last used block may hold anything (-1, huge, another
    request's block): the logits do not change and nothing is read out of bounds."""
    inputs = make_paged_inputs((70, 200, 3), 2, 8, 16, gen, extra_width=3, garbage=False)
    clean = paged_indexer_logits(*inputs.args())
    for value in GARBAGE_IDS + (0, inputs.kv_cache.shape[0] - 1):
        table = inputs.block_table.clone()
        for b, length in enumerate((70, 200, 3)):
            table[b, -(-length // T):] = value
        out = paged_indexer_logits(inputs.q_fp8, inputs.kv_cache, inputs.weights, inputs.seq_lens, table)
        assert torch.equal(out, clean), f"garbage id {value} changed the logits"


def test_rows_are_independent_of_next_n(gen):
    """Row j of a next_n = 4 step equals a next_n = 1 step whose only row has row j's length."""
    inputs = make_paged_inputs((150, 90), 4, 8, 16, gen)
    full = paged_indexer_logits(*inputs.args())
    for j in range(4):
        one = paged_indexer_logits(inputs.q_fp8[:, j:j + 1].contiguous(), inputs.kv_cache,
                                   inputs.weights.view(2, 4, 8)[:, j].contiguous(),
                                   inputs.seq_lens[:, j:j + 1].contiguous(), inputs.block_table)
        assert torch.equal(one, full.view(2, 4, -1)[:, j])


def test_seq_lens_follow_the_mtp_rule():
    from conftest import row_lengths
    assert row_lengths((10, 3), 4).tolist() == [[7, 8, 9, 10], [0, 1, 2, 3]]  # row j: L - 4 + j + 1


def test_compacted_table_scores_only_the_listed_blocks(gen):
    """Listing a subset of a request's blocks (the SPIN compaction) gives exactly those blocks' columns."""
    inputs = make_paged_inputs((320,), 1, 8, 16, gen, extra_width=0)
    full = paged_indexer_logits(*inputs.args())
    keep = [0, 2, 4]  # logical blocks of a 5-block request
    table = inputs.block_table[:, keep].contiguous()
    lens = torch.tensor([[len(keep) * T]], dtype=torch.int32)
    compact = paged_indexer_logits(inputs.q_fp8, inputs.kv_cache, inputs.weights, lens, table)
    cols = torch.tensor([b * T + c for b in keep for c in range(T)])
    assert torch.equal(compact[0], full[0, cols])


def test_negative_weights_and_relu(gen):
    """Scores are a ReLU per head then a signed weighted sum: flipping a head's query can change them
    only through the ReLU, and negative weights give negative scores."""
    inputs = make_paged_inputs((64,), 1, 8, 16, gen)
    inputs.weights.copy_(-inputs.weights.abs())
    got = paged_indexer_logits(*inputs.args())
    assert (got[0] <= 0).all()
    want, mag = logits_f64(*inputs.args())
    assert_logits_close(got, want, mag)


# -------------------------------------------------------------------------------------------- block max
def block_max_np(x: np.ndarray, tokens: int) -> np.ndarray:
    rows, cols = x.shape
    nblk = -(-cols // tokens)
    out = np.full((rows, nblk), -np.inf)
    for r in range(rows):
        for b in range(nblk):
            seg = x[r, b * tokens:(b + 1) * tokens]
            out[r, b] = max(seg.tolist(), default=-np.inf)
    return out


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(0, 5), cols=st.integers(0, 300),
       tokens=st.sampled_from([64, 1, 7]), inf_frac=st.floats(0, 1))
def test_block_max_matches_numpy(seed, rows, cols, tokens, inf_frac):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, cols, generator=gen)
    x[torch.rand(rows, cols, generator=gen) < inf_frac] = float("-inf")
    got = block_max(x, tokens)
    assert got.dtype == torch.float32 and got.shape == (rows, -(-cols // tokens))
    np.testing.assert_array_equal(got.numpy(), block_max_np(x.numpy(), tokens))


def test_block_max_of_logits_all_minus_inf_blocks(gen):
    inputs = make_paged_inputs((70,), 1, 8, 16, gen, extra_width=2)  # blocks: full, 6 valid, none, none
    logits = paged_indexer_logits(*inputs.args())
    bm = block_max_ref(logits)
    assert bm.shape == (1, 4)
    assert torch.isfinite(bm[0, :2]).all() and torch.isneginf(bm[0, 2:]).all()
    assert bm[0, 1] == logits[0, 64:70].max()


def test_block_max_non_contiguous_input():
    x = torch.randn(128, 3).t()  # [3, 128] with strides (1, 3)
    np.testing.assert_array_equal(block_max(x).numpy(), block_max_np(x.numpy(), 64))


# ---------------------------------------------------------------------------------------------- errors
def _good(gen, batch=2, next_n=2, heads=8, dim=16):
    return make_paged_inputs((100, 30)[:batch] if batch <= 2 else (100,) * batch, next_n, heads, dim, gen)


def _replace(inputs, **kw):
    args = dict(zip(["q_fp8", "kv_cache", "weights", "seq_lens", "block_table"], inputs.args()))
    args.update(kw)
    return args


def _bad_table(inputs, value):
    table = inputs.block_table.clone()
    table[0, 1] = value  # request 0 (length 100) uses blocks 0 and 1
    return table


ERRORS = [  # (argument, builder(inputs) -> replacement, exception, message fragment)
    ("q_fp8", lambda i: i.q_fp8.float(), TypeError, "dtype torch.float8_e4m3fn"),
    ("q_fp8", lambda i: i.q_fp8[0], ValueError, "4 dimensions"),
    ("q_fp8", lambda i: i.q_fp8[:, :0], ValueError, "next_n >= 1"),
    ("q_fp8", lambda i: [1.0], TypeError, "torch.Tensor"),
    ("kv_cache", lambda i: i.kv_cache.view(torch.int8), TypeError, "dtype torch.uint8"),
    ("kv_cache", lambda i: i.kv_cache[..., :-1].contiguous(), ValueError, "[num_blocks, T, 1, D + 4]"),
    ("kv_cache", lambda i: i.kv_cache[:, :, 0], ValueError, "4 dimensions"),
    ("kv_cache", lambda i: i.kv_cache[:, ::2], ValueError, "contiguous"),
    ("kv_cache", lambda i: i.kv_cache[:, :0], ValueError, "T >= 1"),
    ("kv_cache", lambda i: i.kv_cache.to("meta"), ValueError, "got meta"),
    ("weights", lambda i: i.weights.double(), TypeError, "dtype torch.float32"),
    ("weights", lambda i: i.weights[:, :4].contiguous(), ValueError, "[B*next_n, H]"),
    ("weights", lambda i: i.weights[:2].contiguous(), ValueError, "[B*next_n, H]"),
    ("weights", lambda i: i.weights.to("meta"), ValueError, "device"),
    ("seq_lens", lambda i: i.seq_lens.long(), TypeError, "dtype torch.int32"),
    ("seq_lens", lambda i: i.seq_lens[:, 0].contiguous(), ValueError, "[B, next_n]"),
    ("seq_lens", lambda i: i.seq_lens[:, :1].contiguous(), ValueError, "[B, next_n]"),  # next_n mismatch
    ("seq_lens", lambda i: torch.cat([i.seq_lens, i.seq_lens], 1), ValueError, "[B, next_n]"),
    ("seq_lens", lambda i: i.seq_lens.to("meta"), ValueError, "device"),
    ("seq_lens", lambda i: i.seq_lens + i.block_table.shape[1] * T, ValueError, "at most W*T"),
    ("seq_lens", lambda i: i.seq_lens - 1000, ValueError, "lengths"),
    ("block_table", lambda i: i.block_table.long(), TypeError, "dtype torch.int32"),
    ("block_table", lambda i: i.block_table[:1].contiguous(), ValueError, "[B, W]"),
    ("block_table", lambda i: i.block_table[0].contiguous(), ValueError, "dimensions"),
    ("block_table", lambda i: i.block_table.to("meta"), ValueError, "device"),
    ("block_table", lambda i: _bad_table(i, i.kv_cache.shape[0]), ValueError, "block ids"),
    ("block_table", lambda i: _bad_table(i, -1), ValueError, "block ids"),
    ("block_table", lambda i: _bad_table(i, 2**31 - 1), ValueError, "block ids"),
]


@pytest.mark.parametrize("fn", [paged_indexer_logits, paged_indexer_logits_ref])
@pytest.mark.parametrize("name,build,exc,fragment", ERRORS, ids=[f"{e[0]}-{i}" for i, e in enumerate(ERRORS)])
def test_errors_name_the_argument(fn, name, build, exc, fragment, gen):
    inputs = _good(gen)
    args = _replace(inputs, **{name: build(inputs)})
    with pytest.raises(exc) as info:
        fn(*args.values())
    msg = str(info.value)
    assert msg.startswith(f"{name}: expected") and fragment in msg, msg


def test_data_checks_can_be_skipped_but_shape_checks_cannot(gen):
    """validate=False skips only the checks that read tensor data (host syncs)."""
    inputs = _good(gen)
    paged_indexer_logits(*_replace(inputs, block_table=_bad_table(inputs, 0)).values(), validate=False)
    with pytest.raises(TypeError, match="^seq_lens: expected"):
        paged_indexer_logits(*_replace(inputs, seq_lens=inputs.seq_lens.long()).values(), validate=False)


@pytest.mark.parametrize("bad,exc,match", [
    (torch.zeros(3, 4, dtype=torch.float64), TypeError, "^logits: expected dtype"),
    (torch.zeros(3), ValueError, "^logits: expected 2 dimensions"),
    ("x", TypeError, "^logits: expected a torch.Tensor"),
])
def test_block_max_errors(bad, exc, match):
    with pytest.raises(exc, match=match):
        block_max(bad)


@pytest.mark.parametrize("tokens,exc", [(0, ValueError), (-64, ValueError), (64.0, TypeError), (True, TypeError)])
def test_block_max_tokens_per_block_errors(tokens, exc):
    with pytest.raises(exc, match="^tokens_per_block: expected"):
        block_max(torch.zeros(2, 64), tokens)


def test_random_cache_helper_is_finite():
    from conftest import dequantize_f64
    assert np.isfinite(dequantize_f64(random_cache(3, 16, torch.Generator().manual_seed(1)))).all()


def test_out_and_block_max_out_are_filled_in_place(gen, device):
    inputs = make_paged_inputs((130, 64), 2, 8, 16, gen).to(device)
    rows, width = 4, inputs.block_table.shape[1]
    out = torch.full((rows, width * T), float("nan"), device=device)  # poisoned: every element must be written
    bmax = torch.full((rows, width), float("nan"), device=device)
    got = paged_indexer_logits(*inputs.args(), out=out, block_max_out=bmax)
    assert got.data_ptr() == out.data_ptr()
    want, mag = logits_f64(*inputs.args())
    assert_logits_close(out, want, mag)
    assert torch.equal(bmax, block_max_ref(out, T))
