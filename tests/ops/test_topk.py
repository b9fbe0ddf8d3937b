"""Top-k with per-row lengths: value sets vs torch.topk on the valid prefix, exact positions vs a
plain-Python stable ordering (ties to the lower position), -1 padding, k > C, empty rows, errors."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, strategies as st

from conftest import ODD_IDS, ODD_SHAPES, make_case_inputs, masked_logits
from spin_indexer.ops import paged_indexer_logits, topk, topk_ref


def expected_positions(row: list[float], length: int, k: int) -> list[int]:
    """Best first, ties to the lower position, then -1 up to k."""
    order = sorted(range(length), key=lambda p: (-row[p], p))[:k]
    return order + [-1] * (k - len(order))


def check_topk(logits, lengths, k, fn=topk):
    got = fn(logits, lengths, k)
    assert got.dtype == torch.int32 and got.shape == (logits.shape[0], k) and got.device == logits.device
    logits, lengths, got = logits.cpu(), lengths.cpu(), got.cpu()
    for r in range(logits.shape[0]):
        length, row = int(lengths[r]), logits[r]
        take = min(k, length)
        # value set equals torch.topk over the valid prefix (whatever order torch picks among ties)
        want_values = torch.topk(row[:length], take).values
        got_values = row[got[r, :take].long()]
        assert torch.equal(got_values.sort(descending=True).values, want_values.sort(descending=True).values)
        assert got[r].tolist() == expected_positions(row.tolist(), length, k), f"row {r}"
    return got


@given(seed=st.integers(0, 2**31 - 1), rows=st.integers(0, 6), cols=st.integers(0, 300),
       k=st.integers(1, 320), ties=st.booleans())
def test_random_rows(seed, rows, cols, k, ties):
    gen = torch.Generator().manual_seed(seed)
    logits, lengths = masked_logits(rows, cols, gen, ties=ties)
    check_topk(logits, lengths, k)


@pytest.mark.parametrize("case", ODD_SHAPES, ids=ODD_IDS)
def test_odd_shapes_on_indexer_logits(case, gen):
    """The decode pipeline's own input: -inf tails, contexts shorter than k, next_n rows, empty batch."""
    inputs = make_case_inputs(case, gen)
    logits = paged_indexer_logits(*inputs.args())
    got = check_topk(logits, inputs.seq_lens.reshape(-1), case.k)
    lens = inputs.seq_lens.reshape(-1, 1)
    assert ((got >= 0).sum(1, keepdim=True) == lens.clamp(max=case.k)).all()


def test_public_op_on_every_device(device, gen):
    logits, lengths = masked_logits(7, 513, gen, ties=True)
    check_topk(logits.to(device), lengths.to(device), 64)


def test_ties_go_to_the_lower_position():
    logits = torch.tensor([[1.0, 3.0, 3.0, 2.0, 3.0, 1.0]])
    got = topk(logits, torch.tensor([6], dtype=torch.int32), 4)
    assert got.tolist() == [[1, 2, 4, 3]]
    got = topk(torch.zeros(1, 10), torch.tensor([10], dtype=torch.int32), 3)
    assert got.tolist() == [[0, 1, 2]]


def test_valid_minus_inf_is_still_selected_before_padding():
    logits = torch.tensor([[float("-inf"), 2.0, float("-inf"), 5.0]])
    assert topk(logits, torch.tensor([3], dtype=torch.int32), 4).tolist() == [[1, 0, 2, -1]]


def test_masked_columns_are_ignored_whatever_they_hold():
    row = [0.5, 0.1, float("inf"), float("nan"), 1e30]
    got = topk(torch.tensor([row]), torch.tensor([2], dtype=torch.int32), 3)
    assert got.tolist() == [[0, 1, -1]]


def test_k_larger_than_columns_and_context_shorter_than_k():
    logits = torch.tensor([[0.0, 2.0, 1.0], [5.0, 4.0, 3.0]])
    got = topk(logits, torch.tensor([3, 1], dtype=torch.int32), 5)
    assert got.tolist() == [[1, 2, 0, -1, -1], [0, -1, -1, -1, -1]]


def test_zero_lengths_and_empty_shapes():
    assert topk(torch.randn(3, 8), torch.zeros(3, dtype=torch.int32), 4).tolist() == [[-1] * 4] * 3
    assert topk(torch.zeros(0, 8), torch.zeros(0, dtype=torch.int32), 4).shape == (0, 4)
    assert topk(torch.zeros(2, 0), torch.zeros(2, dtype=torch.int32), 2).tolist() == [[-1, -1]] * 2


def test_does_not_modify_its_inputs(gen):
    logits, lengths = masked_logits(4, 100, gen)
    before = logits.clone(), lengths.clone()
    topk_ref(logits, lengths, 10)
    assert torch.equal(logits.nan_to_num(), before[0].nan_to_num()) and torch.equal(lengths, before[1])


# ---------------------------------------------------------------------------------------------- errors
@pytest.mark.parametrize("fn", [topk, topk_ref])
@pytest.mark.parametrize("logits,lengths,k,exc,match", [
    (torch.zeros(2, 8, dtype=torch.float64), torch.zeros(2, dtype=torch.int32), 1, TypeError, "^logits: expected dtype"),
    (torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(2, dtype=torch.int32), 1, TypeError, "^logits: expected dtype"),
    (torch.zeros(8), torch.zeros(1, dtype=torch.int32), 1, ValueError, "^logits: expected 2 dimensions"),
    (torch.zeros(2, 2, 8), torch.zeros(2, dtype=torch.int32), 1, ValueError, "^logits: expected 2 dimensions"),
    ([[0.0]], torch.zeros(1, dtype=torch.int32), 1, TypeError, "^logits: expected a torch.Tensor"),
    (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int64), 1, TypeError, "^lengths: expected dtype torch.int32"),
    (torch.zeros(2, 8), torch.zeros(3, dtype=torch.int32), 1, ValueError, r"^lengths: expected shape \[R\]"),
    (torch.zeros(2, 8), torch.zeros(2, 1, dtype=torch.int32), 1, ValueError, "^lengths: expected 1 dimensions"),
    (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32, device="meta"), 1, ValueError, "^lengths: expected device cpu"),
    (torch.zeros(2, 8), torch.tensor([0, 9], dtype=torch.int32), 1, ValueError, r"^lengths: expected lengths \(at most C\) in \[0, 8\]"),
    (torch.zeros(2, 8), torch.tensor([-1, 3], dtype=torch.int32), 1, ValueError, "^lengths: expected"),
    (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32), 0, ValueError, "^k: expected 1 <= k, got 0"),
    (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32), -3, ValueError, "^k: expected 1 <= k"),
    (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32), 2.0, TypeError, "^k: expected an int"),
    (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32), True, TypeError, "^k: expected an int"),
    (torch.zeros(2, 8), torch.zeros(2, dtype=torch.int32), torch.tensor(2), TypeError, "^k: expected an int"),
])
def test_errors_name_the_argument(fn, logits, lengths, k, exc, match):
    with pytest.raises(exc, match=match):
        fn(logits, lengths, k)


def test_length_check_can_be_skipped():
    """validate=False skips the data check (a host sync); shapes and dtypes are still checked."""
    out = topk(torch.zeros(1, 4), torch.tensor([4], dtype=torch.int32), 2, validate=False)
    assert out.tolist() == [[0, 1]]
    with pytest.raises(TypeError, match="^lengths"):
        topk(torch.zeros(1, 4), torch.tensor([4]), 2, validate=False)


def test_every_nan_is_the_largest_value_as_in_torch_topk():
    """+NaN, -NaN and NaNs with other payloads all rank above +inf, as torch.topk ranks NaN, and tie among
    themselves (to the lower position)."""
    nan_bits = [0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x7FC00123]
    nans = torch.tensor(nan_bits, dtype=torch.int64).to(torch.int32).view(torch.float32)
    row = torch.tensor([1.0, 0.0, float("inf"), -2.0, float("-inf"), 3.0, -0.0, 5.0])
    logits = torch.cat([row, nans])[torch.tensor([0, 9, 1, 2, 8, 3, 4, 11, 5, 10, 6, 12, 7])][None]
    cols = logits.shape[1]
    for k in (3, 6, cols):
        got = topk_ref(logits, torch.tensor([cols], dtype=torch.int32), k)[0]
        want = torch.topk(logits[0], k)
        assert torch.equal(logits[0, got.long()].isnan(), want.values.isnan())
        assert torch.equal(logits[0, got.long()].nan_to_num(), want.values.nan_to_num())
        nan_cols = logits[0].isnan().nonzero().flatten().tolist()  # ascending positions
        assert got.tolist()[:min(k, 5)] == nan_cols[:min(k, 5)]
    both = torch.tensor([[float("nan"), -float("nan")], [-float("nan"), float("nan")]])
    assert topk_ref(both, torch.tensor([2, 2], dtype=torch.int32), 2).tolist() == [[0, 1], [0, 1]]


@pytest.mark.parametrize("cols, k, cap", [(40, 8, None), (256, 4, None), (256, 4, 16)],
                         ids=["all-candidates", "threshold", "small-cap"])
def test_triton_twin_orders_every_nan_as_the_reference(cols, k, cap, gen, triton_device):
    """topk_triton's key (_ukey) folds every NaN into +NaN too: same picks as topk_ref on rows mixing
    +NaN, -NaN and other payloads with ordinary values."""
    from spin_indexer.ops.topk_triton import topk_triton
    nan_bits = torch.tensor([0x7FC00000, 0xFFC00000, 0x7F800001, 0xFFFFFFFF], dtype=torch.int64)
    nans = nan_bits.to(torch.int32).view(torch.float32)
    rows = 4
    logits = torch.randn(rows, cols, generator=gen)
    where = torch.randint(0, cols, (rows, 3), generator=gen)
    for r in range(rows):
        logits[r, where[r]] = nans[torch.randint(0, 4, (3,), generator=gen)]
    logits[0, :k + 2] = nans[1]  # more -NaNs than k: ties among NaNs go to the lower position
    lengths = torch.full((rows,), cols, dtype=torch.int32)
    want = topk_ref(logits, lengths, k)
    got = topk_triton(logits.to(triton_device), lengths.to(triton_device), k, cap=cap).cpu()
    assert torch.equal(got, want)


def test_topk_positions_reference_leaves_the_tau_hint_and_checks_it(gen):
    from spin_indexer import ops
    logits = torch.randn(2, 300, generator=gen)
    lengths = torch.tensor([300, 17], dtype=torch.int32)
    hint = torch.tensor([5, -9], dtype=torch.int32)
    got = ops.topk_positions_ref(logits, lengths, 8)
    assert torch.equal(ops.topk_positions(logits, lengths, 8, tau_hint=hint), got)
    assert hint.tolist() == [5, -9]
    with pytest.raises(TypeError, match="tau_hint: expected dtype torch.int32"):
        ops.topk_positions(logits, lengths, 8, tau_hint=hint.long())
