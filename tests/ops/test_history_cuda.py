"""The CUDA update pass (ops/history_cuda.py, csrc/update_pass.cu) against the torch reference, bit for bit: random
plans with garbage past the kept blocks, ids outside the cache, NaN past each row's compact length, scores past
fp16's range, rows gated by update_rows, a diagonal window shorter than the context, strided block max / last_seen
columns, CTAs that loop over several rounds of blocks. On the CPU: the source builds where nvcc is, and the
Python mirror of the argument struct has the C layout."""
from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from conftest import T
from spin_indexer import ops
from spin_indexer.ops import history_cuda
from spin_indexer.ops.cuda_build import nvcc_path
from spin_indexer.ops.history import update_history_ref
from test_history import CASE_IDS, CASES, clone_history, history_on, make_history, make_logits, make_plan


def _gpu_or_skip():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA GPU")
    if history_cuda.load_library() is None:
        pytest.skip("the CUDA update pass does not build here")


def _assert_state_equal(got, want):
    """Every state tensor equal, bits included, outside the trash block / each slot's trash offset."""
    for name in ("vertical", "block_max", "diagonal", "last_seen"):
        g, w = getattr(got, name), getattr(want, name)
        if w is None:
            assert g is None
            continue
        g, w = g.cpu(), w.cpu()
        g, w = (g[..., :-1], w[..., :-1]) if name == "diagonal" else (g[:-1], w[:-1])
        assert torch.equal(g.view(torch.int16) if g.dtype == torch.float16 else g,
                           w.view(torch.int16) if w.dtype == torch.float16 else w), name


def test_source_builds_and_the_struct_mirror_has_its_layout(tmp_path):
    """nvcc builds the source (no GPU needed; skipped without nvcc), the entry point is exported, and UpdateArgs
    has the C struct's size and every field's offset."""
    if nvcc_path() is None:
        pytest.skip("no nvcc")
    lib = ctypes.CDLL(str(history_cuda.build(tmp_path)))
    assert hasattr(lib, "spin_update_pass")
    layout = lib.spin_update_args_layout
    layout.restype, layout.argtypes = ctypes.c_int64, [ctypes.c_int]
    fields = history_cuda.UpdateArgs._fields_
    assert layout(-1) == ctypes.sizeof(history_cuda.UpdateArgs)
    assert [layout(i) for i in range(len(fields))] == [getattr(history_cuda.UpdateArgs, n).offset for n, _ in fields]
    assert layout(len(fields)) == -1


@pytest.mark.parametrize("lengths,next_n,window", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("seen", [True, False], ids=["last_seen", "no-last_seen"])
@pytest.mark.parametrize("programs", [None, 1], ids=["default-grid", "one-cta"])
def test_cuda_pass_matches_the_reference_bit_for_bit(lengths, next_n, window, seen, programs, gen):
    _gpu_or_skip()
    blocks = 24
    plan = make_plan(lengths, next_n, blocks, gen, width=max(-(-L // T) for L in lengths) + 1)
    logits = make_logits(plan, int(plan.num_kept.max()) * T, gen)  # compact columns cut short of W*T
    update_rows = torch.rand(len(lengths), next_n, generator=gen) < 0.7
    update_rows[0, 0], update_rows[-1, :] = True, False  # one request updates, one does not at all
    h = make_history(plan, blocks, 4, window, gen, seen=seen, update_rows=update_rows)
    ref = clone_history(h)
    update_history_ref(ref, logits, plan.table, plan.lens)
    dev = torch.device("cuda")
    moved = history_on(h, dev)
    assert history_cuda.runs(moved, logits.to(dev), plan.table.to(dev), plan.lens.to(dev))
    history_cuda.update_history_cuda(moved, logits.to(dev), plan.table.to(dev), plan.lens.to(dev), programs=programs)
    _assert_state_equal(moved, ref)
    assert (moved.vertical.cpu() != h.vertical).any()


@pytest.mark.parametrize("next_n,rows", [(1, 1), (2, 1), (3, 3), (4, 4)])
def test_cuda_pass_on_a_large_random_plan(next_n, rows, gen, monkeypatch):
    """Many requests over a cache of many blocks: the default grid (several CTAs a request, each looping), a
    diagonal window that covers a few blocks of each request, rows past `rows` never updating; through the op,
    which gives it to the CUDA pass under SPIN_INDEXER_UPDATE=cuda."""
    _gpu_or_skip()
    monkeypatch.setenv("SPIN_INDEXER_UPDATE", "cuda")
    lengths = [int(x) for x in torch.randint(1, 300 * T, (12,), generator=gen)]
    blocks = sum(-(-L // T) for L in lengths) + 50
    plan = make_plan(lengths, next_n, blocks, gen, keep_prob=0.5)
    logits = make_logits(plan, plan.kept.shape[1] * T, gen)
    h = make_history(plan, blocks, 16, 5 * T + 7, gen, rows=rows)
    ref = clone_history(h)
    gated = h.update_rows.clone()
    gated[:, rows:] = False  # what history.rows promises the kernels: later rows never update
    update_history_ref(dataclasses.replace(ref, update_rows=gated), logits, plan.table, plan.lens)
    dev = torch.device("cuda")
    moved = history_on(h, dev)
    ops.update_history(moved, logits.to(dev), plan.table.to(dev), plan.lens.to(dev))  # the op dispatches here
    _assert_state_equal(moved, ref)


def test_misaligned_logits_go_to_the_triton_pass_with_the_same_state(gen, monkeypatch):
    """Logits whose rows are not 16-byte aligned (a view one column in) are not the CUDA pass's: `runs` says no,
    the op keeps the Triton pass even under SPIN_INDEXER_UPDATE=cuda and the state is still the reference's (up to
    the GPU's FMA); the CUDA entry rejects them with a ValueError that changes nothing."""
    _gpu_or_skip()
    monkeypatch.setenv("SPIN_INDEXER_UPDATE", "cuda")
    lengths, next_n = (5 * T + 17, 3 * T, 1), 1
    blocks = 24
    plan = make_plan(lengths, next_n, blocks, gen)
    cols = plan.kept.shape[1] * T
    wide = torch.full((len(lengths), next_n, cols + 1), float("nan"))
    wide[..., 1:] = make_logits(plan, cols, gen)
    h = make_history(plan, blocks, 4, 100, gen)
    dev = torch.device("cuda")
    logits = wide.to(dev)[..., 1:]
    moved = history_on(h, dev)
    args = (moved, logits, plan.table.to(dev), plan.lens.to(dev))
    assert not history_cuda.runs(*args) and not history_cuda.takes(*args)
    before = moved.vertical.clone()
    with pytest.raises(ValueError, match="CUDA update pass"):
        history_cuda.update_history_cuda(*args)
    assert torch.equal(moved.vertical, before)
    ops.update_history(*args)
    ref = clone_history(h)
    update_history_ref(ref, wide[..., 1:], plan.table, plan.lens)
    torch.testing.assert_close(moved.vertical.cpu()[:-1].float(), ref.vertical[:-1].float(), rtol=1e-3, atol=1e-3)


def test_empty_batch_and_zero_width_write_nothing(gen):
    _gpu_or_skip()
    plan = make_plan((3 * T,), 1, 8, gen)
    h = history_on(make_history(plan, 8, 2, 64, gen), torch.device("cuda"))
    before = h.vertical.clone()
    empty = dataclasses.replace(h, slot_ids=h.slot_ids[:0], kept_blocks=h.kept_blocks[:0], seq_lens=h.seq_lens[:0],
                                update_rows=h.update_rows[:0])
    history_cuda.update_history_cuda(empty, torch.zeros(0, 1, 3 * T, device="cuda"),
                                     torch.zeros(0, 3, dtype=torch.int32, device="cuda"),
                                     torch.zeros(0, 1, dtype=torch.int32, device="cuda"))
    history_cuda.update_history_cuda(h, torch.zeros(1, 1, 0, device="cuda"), plan.table.cuda(), plan.lens.cuda())
    torch.cuda.synchronize()
    assert torch.equal(h.vertical, before)



def test_the_op_takes_the_cuda_pass_only_where_asked(monkeypatch):
    """SPIN_INDEXER_UPDATE=triton keeps the Triton pass, =cuda asks for the CUDA pass where it runs; unset,
    STEP_USES decides (the CUDA side of `takes` is `runs`, checked on the GPU above)."""
    asked = []
    monkeypatch.setattr(history_cuda, "runs", lambda *args: asked.append(args) or True)
    monkeypatch.setenv("SPIN_INDEXER_UPDATE", "triton")
    assert not history_cuda.takes(None, None, None, None) and not asked
    monkeypatch.setenv("SPIN_INDEXER_UPDATE", "cuda")
    assert history_cuda.takes(None, None, None, None) and len(asked) == 1
    monkeypatch.delenv("SPIN_INDEXER_UPDATE")
    for default in (False, True):
        monkeypatch.setattr(history_cuda, "STEP_USES", default)
        assert history_cuda.takes(None, None, None, None) is default
