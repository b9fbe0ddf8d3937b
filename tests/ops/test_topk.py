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
