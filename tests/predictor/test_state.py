"""SpinState: slot pool (allocate / free / reset), per-block vertical history reset, and its memory, which
follows the cache (blocks) and a bounded per-request diagonal window, never the maximum context."""
import functools

import pytest
import torch

from spin_indexer.predictor import SpinConfig, SpinState

Slot = functools.partial(SpinConfig, vertical_grain="slot")  # the paper's per-slot V, which these tests read


def _state(cfg=None, layers=2, requests=2, blocks=3, context=3 * 64):
    return SpinState(cfg or Slot(), num_layers=layers, max_requests=requests, num_cache_blocks=blocks,
                     max_context=context)


def test_layout_has_a_trash_block_and_a_trash_offset():
    st = _state(Slot(exploration="block_age", diagonal_window=100), layers=2, requests=3, blocks=5,
                context=1000)
    assert st.vertical.shape == (2, 6, 64) and st.block_max.shape == (6, 2) and st.last_seen.shape == (6, 2)
    assert st.diagonal.shape == (2, 3, 101) and st.window == 100 and st.trash_block == 5
    assert torch.isneginf(st.vertical).all() and torch.isneginf(st.block_max).all()
    assert torch.isneginf(st.diagonal).all() and (st.last_seen == -1).all()
    assert st.step.shape == st.seen_len.shape == (3,) and st.clock.shape == (1,)
    assert _state(Slot(), context=1000).last_seen is None  # random exploration needs no ages
    assert _state(Slot(diagonal_window=4096), context=1000).window == 1000  # never past the context
    assert _state(Slot(diagonal_window=None), context=1000).window == 1000


def test_allocate_free_reset_and_reuse_is_clean():
    st = _state(Slot(exploration="staleness"))
    a = st.allocate()
    st.vertical[:, 1].fill_(1.0)  # physical block 1: a property of the cache, not of the slot
    st.diagonal[:, a].fill_(2.0)
    st.step[a], st.seen_len[a] = 9, 150
    b = st.allocate()
    st.diagonal[:, b].fill_(3.0)
    st.step[b] = 4
    with pytest.raises(RuntimeError, match="all 2 request slots"):
        st.allocate()
    st.free(a)
    assert (st.diagonal[:, a] == 2.0).all()  # free() does not clear (allocate() does)
    c = st.allocate()
    assert c == a  # reused, and its per-request history is clean
    assert torch.isneginf(st.diagonal[:, c]).all() and st.step[c] == 0 and st.seen_len[c] == 0
    assert (st.diagonal[:, b] == 3.0).all() and st.step[b] == 4  # the other slot is untouched
    assert (st.vertical[:, 1] == 1.0).all()  # block history waits for the block to enter a request
    assert st.is_allocated(b) and st.allocated_mask().tolist() == [True, True]


def test_reset_blocks_forgets_only_those_blocks():
    st = _state(Slot(exploration="block_age"), blocks=4)
    st.vertical.fill_(1.0)
    st.block_max.fill_(1.0)
    st.last_seen.fill_(7)
    st.reset_blocks_(torch.tensor([2, 0, 2]))
    for p in range(5):
        gone = p in (0, 2)
        assert torch.isneginf(st.vertical[:, p]).all() == gone and (st.vertical[:, p] == 1.0).all() != gone
        assert torch.isneginf(st.block_max[p]).all() == gone and (st.last_seen[p] == -1).all() == gone


def test_reset_rows_forgets_only_those_slots():
    st = _state(requests=3)
    st.diagonal.fill_(1.0)
    st.step.fill_(5)
    st.seen_len.fill_(64)
    st.reset_rows_(torch.tensor([1, 1]))
    assert torch.isneginf(st.diagonal[:, 1]).all() and st.step.tolist() == [5, 0, 5]
    assert st.seen_len.tolist() == [64, 0, 64] and (st.diagonal[:, [0, 2]] == 1.0).all()


def test_free_errors_name_the_slot():
    st = _state(layers=1, blocks=1)
    with pytest.raises(ValueError, match="slot"):
        st.free(1)
    with pytest.raises(ValueError, match="slot"):
        st.free(7)
    with pytest.raises(TypeError, match="slot"):
        st.free(1.0)
    with pytest.raises(ValueError, match="num_cache_blocks"):
        SpinState(SpinConfig(), 1, 1, 0, 64)
    with pytest.raises(TypeError, match="config"):
        SpinState({}, 1, 1, 1, 64)


def test_memory_per_token_is_a_few_bytes():
    st = _state(layers=3, requests=2, blocks=4, context=4 * 64)
    assert st.bytes_per_token() == pytest.approx(2 + 2 / 64)
    aged = _state(Slot(exploration="block_age"), layers=3, requests=2, blocks=4, context=4 * 64)
    assert aged.bytes_per_token() == pytest.approx(2 + 2 / 64 + 4 / 64)
    full = _state(layers=3, requests=2, blocks=8, context=4 * 64)  # the default: each request owns 4 blocks
    per_token_layer = full.nbytes() / (3 * 8 * 64)  # cache tokens x layers
    assert per_token_layer < 5.0 < 132 / 20


def test_memory_follows_the_cache_not_the_context():
    """For a fixed cache, nbytes() stops growing with max_context once it exceeds the diagonal window: the
    vertical history lives per cached block, the diagonal one in a window per request."""
    cfg = SpinConfig(diagonal_window=1024)
    sizes = [_state(cfg, layers=2, requests=4, blocks=16, context=c).nbytes() for c in (1024, 8192, 1 << 20)]
    assert sizes[0] == sizes[1] == sizes[2]
    assert _state(cfg, blocks=32).nbytes() > _state(cfg, blocks=16).nbytes()  # but it follows the cache
    st = _state(cfg, layers=2, requests=4, blocks=16, context=1 << 20)
    assert st.bytes_per_request() == 2 * 1024 * 2 + 8


def test_generation_counts_every_change_of_owner():
    """allocate() and free() bump the slot's generation and the pool's epoch; a refused free() bumps neither;
    reset() (same owner) bumps nothing."""
    st = _state()
    a = st.allocate()
    assert st.generation(a) == 1 and st.epoch == 1
    b = st.allocate()
    st.reset(a)
    assert st.generations() == [1, 1] and st.epoch == 2
    st.free(a)
    with pytest.raises(ValueError, match="free"):
        st.free(a)
    assert st.generation(a) == 2 and st.generation(b) == 1 and st.epoch == 3
    assert st.allocate() == a and st.generation(a) == 3 and st.epoch == 4
    copy = st.generations()
    copy[a] = 99  # a host copy: editing it changes nothing
    assert st.generation(a) == 3
    with pytest.raises(ValueError, match="slot"):
        st.generation(2)


def test_bind_history_uses_caller_memory_and_keeps_the_step_identical():
    """An engine's allocation (one flat buffer: layer regions of n blocks x T, block max after them) serves
    as the vertical history; a plan + run over it equals one over the state's own tensors, bit for bit."""
    from spin_indexer.indexer import SpinIndexer
    cfg = Slot(sparsity=0.5, topk=64, exploration="block_age")
    layers, n, t = 2, 12, 64
    flat = torch.zeros(layers * n * t + t + layers * (n + 1), dtype=torch.float16)
    vertical = flat.as_strided((layers, n + 1, t), (n * t, t, 1))  # layer l's trash row = layer l+1's row 0
    block_max = flat.as_strided((n + 1, layers), (1, n + 1), layers * n * t + t)
    own = SpinIndexer(cfg, num_layers=layers, max_batch=2, max_blocks=6, device="cpu", num_cache_blocks=n)
    bound = SpinIndexer(cfg, num_layers=layers, max_batch=2, max_blocks=6, device="cpu", num_cache_blocks=1)
    bound.state.bind_history_(vertical, block_max)
    assert bound.state.vertical.data_ptr() == flat.data_ptr() and bound.state.num_cache_blocks == n
    assert bound.state.trash_block == n and bound.state.last_seen.shape == (n + 1, layers)
    assert torch.isneginf(flat[: layers * n * t]).all() and torch.isneginf(block_max).all()
    _steps_equal(own, bound, n, t, layers, torch.Generator().manual_seed(3))
    # Row 0 (never in a table here) of layer l + 1 is layer l's trash in the bound layout; the rest is equal.
    assert torch.equal(own.state.vertical[:, 1:n], bound.state.vertical[:, 1:n])
    assert torch.equal(own.state.block_max[1:n], bound.state.block_max[1:n])
    assert torch.isfinite(own.state.block_max[1:n]).any()  # the steps did record history


def _steps_equal(own, bound, n, t, layers, gen) -> None:
    """Four plan + run steps of two requests over an n-block cache of finite fp8 keys: the two indexers (one on
    its own history, one on caller memory) return the same top-k at every layer."""
    kv = torch.randint(0, 255, (n, t, 1, 132), dtype=torch.uint8, generator=gen)
    kv.view(n, t * 132)[:, t * 128:] = torch.ones(n, t, dtype=torch.float32).view(torch.uint8).view(n, -1)
    kv.view(n, t * 132)[:, : t * 128] &= 0x77  # finite fp8 values
    table = torch.tensor([[1, 3, 5, 7, 9, 11], [2, 4, 6, 8, 10, 0]], dtype=torch.int32)  # 0: padding past the 2nd request's 4 blocks
    slots = torch.tensor([own.state.allocate(), own.state.allocate()])
    assert slots.tolist() == [bound.state.allocate(), bound.state.allocate()]
    for step in range(4):
        lens = torch.tensor([[300 + step], [250 + step]], dtype=torch.int32)
        q = (torch.randn(2, 1, 64, 128, generator=gen)).to(torch.float8_e4m3fn)
        w = torch.randn(2, 64, generator=gen)
        for ix in (own, bound):
            ix.plan(table, lens, slots)
        for layer in range(layers):
            assert torch.equal(own.run(layer, q, kv, w), bound.run(layer, q, kv, w)), (step, layer)


def test_bind_history_errors_name_the_argument():
    st = _state(layers=2)
    good_v, good_b = torch.empty(2, 5, 64, dtype=torch.float16), torch.empty(5, 2, dtype=torch.float16)
    with pytest.raises(TypeError, match="vertical: expected dtype"):
        st.bind_history_(good_v.float(), good_b)
    with pytest.raises(ValueError, match="vertical: expected shape"):
        st.bind_history_(good_v[:1], good_b)
    with pytest.raises(ValueError, match="vertical: expected each layer's rows contiguous"):
        st.bind_history_(torch.empty(2, 5, 128, dtype=torch.float16)[:, :, :64], good_b)
    with pytest.raises(ValueError, match="block_max: expected shape"):
        st.bind_history_(good_v, good_b[:4])
    assert st.num_cache_blocks == 3  # nothing changed


def test_block_grain_keeps_no_vertical_table_and_binds_the_block_maxima_alone():
    """vertical_grain="block": no V (2/T B a token a layer), bind_history_ takes None for it (and refuses a
    tensor, as slot grain refuses None), and a step over caller memory equals one over the state's own."""
    from spin_indexer.indexer import SpinIndexer
    cfg = SpinConfig(sparsity=0.5, topk=64, vertical_grain="block")
    layers, n, t = 2, 12, 64
    own = SpinIndexer(cfg, num_layers=layers, max_batch=2, max_blocks=6, device="cpu", num_cache_blocks=n)
    assert own.state.vertical is None and own.state.bytes_per_token() == 2 / t
    slot_grain = SpinIndexer(Slot(sparsity=0.5, topk=64), num_layers=layers, max_batch=2, max_blocks=6,
                             device="cpu", num_cache_blocks=n)
    assert own.state.nbytes() == slot_grain.state.nbytes() - slot_grain.state.vertical.numel() * 2
    bound = SpinIndexer(cfg, num_layers=layers, max_batch=2, max_blocks=6, device="cpu", num_cache_blocks=1)
    with pytest.raises(ValueError, match="vertical: expected None"):
        bound.state.bind_history_(torch.empty(layers, n + 1, t, dtype=torch.float16),
                                  torch.empty(n + 1, layers, dtype=torch.float16))
    with pytest.raises(ValueError, match="vertical: expected a tensor"):
        slot_grain.state.bind_history_(None, torch.empty(n + 1, layers, dtype=torch.float16))
    block_max = torch.zeros(layers, n + 1, dtype=torch.float16).t()  # strided, as an engine's region may be
    bound.state.bind_history_(None, block_max)
    assert bound.state.num_cache_blocks == n and torch.isneginf(block_max).all()
    _steps_equal(own, bound, n, t, layers, torch.Generator().manual_seed(4))
    assert torch.equal(own.state.block_max[1:n], block_max[1:n])
    assert torch.isfinite(block_max[1:n]).any()  # the steps did record history


@pytest.mark.parametrize("changes", [{"reduce": "mean"}, {"reduce": "top4"}, {"combine": "sum"}, {"summary": 0.5}])
def test_block_grain_refuses_rules_that_read_v_slot_by_slot(changes):
    with pytest.raises(ValueError, match="SpinConfig.vertical_grain"):
        SpinConfig(vertical_grain="block", **changes)
    with pytest.raises(ValueError, match="SpinConfig.vertical_grain"):
        SpinConfig(vertical_grain="cell")
