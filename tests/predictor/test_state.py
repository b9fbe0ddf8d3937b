import pytest
import torch

from spin_indexer.predictor import SpinConfig, SpinState


def test_allocate_free_reset_and_reuse_is_clean():
    st = SpinState(SpinConfig(), num_layers=2, max_requests=2, max_blocks=3)
    a = st.allocate()
    st.vertical[:, a].fill_(1.0)
    st.diagonal[:, a].fill_(2.0)
    st.last_seen[:, a].fill_(5)
    st.step[a] = 9
    b = st.allocate()
    with pytest.raises(RuntimeError, match="all 2 request slots"):
        st.allocate()
    st.free(a)
    c = st.allocate()
    assert c == a  # reused, and clean
    assert torch.isneginf(st.vertical[:, c]).all() and torch.isneginf(st.diagonal[:, c]).all()
    assert (st.last_seen[:, c] == -1).all() and st.step[c] == 0
    assert st.is_allocated(b) and st.allocated_mask().tolist() == [True, True]


def test_free_errors_name_the_slot():
    st = SpinState(SpinConfig(), num_layers=1, max_requests=2, max_blocks=1)
    with pytest.raises(ValueError, match="slot"):
        st.free(1)
    with pytest.raises(ValueError, match="slot"):
        st.free(7)
    with pytest.raises(TypeError, match="slot"):
        st.free(1.0)


def test_memory_per_token_is_a_few_bytes():
    st = SpinState(SpinConfig(), num_layers=3, max_requests=2, max_blocks=4)
    assert st.bytes_per_token() == pytest.approx(4 + 4 / 64)
    per_token_layer = st.nbytes() / (3 * 2 * 4 * 64)
    assert per_token_layer < 5.0 < 132 / 20
