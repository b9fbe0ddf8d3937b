"""Property-based fuzzing of every public entry point with one bad argument at a time: a wrong dtype,
rank, size, device, Python type or out-of-range data must raise TypeError or ValueError whose message
starts with that argument's name. Any other exception, or a silent success, fails the test."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from conftest import make_paged_inputs
from spin_indexer.layout import cache_views, new_kv_cache, num_blocks_for
from spin_indexer.ops import (block_max, dequantize_blocks, paged_indexer_logits, quantize_and_write, quantize_keys,
                              read_kv_cache, topk, write_kv_cache)
from spin_indexer.indexer import DenseIndexer, SpinIndexer
from spin_indexer.predictor import SpinConfig, SpinState

FP8 = torch.float8_e4m3fn
ALL_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, FP8, torch.float8_e5m2, torch.uint8,
              torch.int8, torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64]
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
INDEX = (torch.int32, torch.int64)
NOT_TENSORS = [None, 3, 2.5, "x", [1, 2], (0,), np.zeros(3, dtype=np.int32)]
FIXED = "fixed"  # a dim whose size is set by the other arguments: any other size is wrong


@dataclass
class Arg:
    """One tensor argument: its good value, its allowed dtypes, and per dim FIXED, None (any size is
    fine) or an int m (sizes below m are wrong: e.g. a block table narrower than the lengths need)."""
    make: Callable[[], torch.Tensor]
    dtypes: tuple
    dims: tuple
    bad_data: Callable[[torch.Tensor, int], torch.Tensor] | None = None  # (good, draw) -> out-of-range copy
    size_blames: tuple = ()  # where a size is relative to another argument, that one may be named instead
    contiguous: bool = False  # must be contiguous (strided views are rejected)
    keyword: bool = False  # passed by keyword (optional outputs)


@dataclass
class Entry:
    fn: Callable
    tensors: dict[str, Arg]  # positional tensor arguments, in order
    anchor: str | None = None  # the argument whose device the others must share
    scalars: dict = field(default_factory=dict)  # name -> (good value, [bad values]), passed by keyword
    positional_scalars: tuple = ()  # scalar names passed positionally after the tensors
    only: tuple | None = None  # corrupt only these arguments (the others are covered by another entry)


def _paged():
    inputs = make_paged_inputs((100, 30), 2, 8, 16, torch.Generator().manual_seed(0), extra_width=0)
    return dict(zip(["q_fp8", "kv_cache", "weights", "seq_lens", "block_table"], inputs.args()))


PAGED = _paged()  # lengths (100, 30): W = 2 blocks; request 0 uses both, request 1 only block 0


def _bad_lengths(t, draw):
    out = t.clone()
    out.view(-1)[draw % out.numel()] = [-1, 10**6, 129, -(2**31)][draw % 4]
    return out


def _bad_table(t, draw):
    out = t.clone()
    out[0, draw % 2] = [PAGED["kv_cache"].shape[0], -1, 2**31 - 1, -(2**31)][draw % 4]  # used by request 0
    return out


def _bad_ids(limit):
    def corrupt(t, draw):
        out = t.clone()
        out.view(-1)[draw % out.numel()] = [limit, -1, limit + 10**6][draw % 3]
        return out
    return corrupt


def _bad_slots(t, draw):  # negative slots are padding (valid); past the cache is not
    out = t.clone()
    out[draw % out.numel()] = [128, 10**6, 2**40][draw % 3]
    return out


def _clone(name):
    return lambda: PAGED[name].clone()


ENTRIES = {
    "paged_indexer_logits": Entry(paged_indexer_logits, {
        "q_fp8": Arg(_clone("q_fp8"), (FP8,), (FIXED, FIXED, FIXED, FIXED), size_blames=("kv_cache", "weights")),
        "kv_cache": Arg(_clone("kv_cache"), (torch.uint8,), (None, 50, FIXED, FIXED), size_blames=("seq_lens",),
                        contiguous=True),
        "weights": Arg(_clone("weights"), (torch.float32,), (FIXED, FIXED)),
        "seq_lens": Arg(_clone("seq_lens"), (torch.int32,), (FIXED, FIXED), _bad_lengths),
        "block_table": Arg(_clone("block_table"), (torch.int32,), (FIXED, 2), _bad_table, ("seq_lens",)),
    }, anchor="q_fp8"),
    "paged_indexer_logits(out=)": Entry(paged_indexer_logits, {
        **{n: Arg(_clone(n), (PAGED[n].dtype,), (None,) * PAGED[n].dim()) for n in PAGED},
        "out": Arg(lambda: torch.empty(4, 128), (torch.float32,), (FIXED, FIXED), contiguous=True, keyword=True),
        "block_max_out": Arg(lambda: torch.empty(4, 2), (torch.float32,), (FIXED, FIXED), contiguous=True,
                             keyword=True),
    }, anchor="q_fp8", only=("out", "block_max_out")),
    "topk": Entry(topk, {
        "logits": Arg(lambda: torch.randn(3, 40), (torch.float32,), (FIXED, 40), size_blames=("lengths",)),
        "lengths": Arg(lambda: torch.tensor([40, 0, 17], dtype=torch.int32), (torch.int32,), (FIXED,),
                       _bad_ids(41)),
    }, anchor="logits", scalars={"k": (8, [0, -1, 2.0, True, None, "8", torch.tensor(8)])},
        positional_scalars=("k",)),
    "topk(block_max=)": Entry(topk, {
        "logits": Arg(lambda: torch.randn(3, 130), (torch.float32,), (None, None)),
        "lengths": Arg(lambda: torch.tensor([130, 0, 17], dtype=torch.int32), (torch.int32,), (None,)),
        "block_max": Arg(lambda: torch.randn(3, 3), (torch.float32,), (FIXED, FIXED), keyword=True),
    }, anchor="logits", scalars={"k": (8, [])}, positional_scalars=("k",), only=("block_max",)),
    "block_max": Entry(block_max, {"logits": Arg(lambda: torch.randn(3, 130), (torch.float32,), (None, None))},
                       scalars={"tokens_per_block": (64, [0, -64, 64.0, None, False])}),
    "quantize_keys": Entry(quantize_keys, {"keys": Arg(lambda: torch.randn(5, 16), FLOATS, (None, 1))}),
    "write_kv_cache": Entry(write_kv_cache, {
        "kv_cache": Arg(lambda: new_kv_cache(2, 16), (torch.uint8,), (None, 1, FIXED, FIXED), size_blames=("k_fp8",)),
        "k_fp8": Arg(lambda: torch.randn(4, 16).to(FP8), (FP8,), (FIXED, FIXED), size_blames=("k_scale",)),
        "k_scale": Arg(lambda: torch.ones(4), (torch.float32,), (FIXED,)),
        "slot_mapping": Arg(lambda: torch.tensor([0, 5, -1, 127]), INDEX, (FIXED,), _bad_slots),
    }, anchor="kv_cache"),
    "quantize_and_write": Entry(quantize_and_write, {
        "kv_cache": Arg(lambda: new_kv_cache(2, 16), (torch.uint8,), (None, 1, FIXED, FIXED), size_blames=("keys",)),
        "keys": Arg(lambda: torch.randn(4, 16), FLOATS, (FIXED, FIXED), size_blames=("slot_mapping",)),
        "slot_mapping": Arg(lambda: torch.tensor([0, 5, -1, 127]), INDEX, (FIXED,), _bad_slots),
    }, anchor="kv_cache"),
    "read_kv_cache": Entry(read_kv_cache, {
        "kv_cache": Arg(lambda: new_kv_cache(3, 16), (torch.uint8,), (None, 1, FIXED, 5)),
        "block_ids": Arg(lambda: torch.tensor([2, 0, 2]), INDEX, (None,), _bad_ids(3)),
    }, anchor="kv_cache"),
    "dequantize_blocks": Entry(dequantize_blocks, {
        "kv_cache": Arg(lambda: new_kv_cache(3, 16), (torch.uint8,), (None, 1, FIXED, 5)),
        "block_ids": Arg(lambda: torch.tensor([1]), INDEX, (None,), _bad_ids(3)),
    }, anchor="kv_cache"),
    "cache_views": Entry(cache_views, {"kv_cache": Arg(lambda: new_kv_cache(2, 8), (torch.uint8,),
                                                       (None, None, FIXED, 5))}),
    "new_kv_cache": Entry(new_kv_cache, {}, scalars={
        "num_blocks": (2, [-1, 2.0, None, "2", True]), "head_dim": (8, [0, -8, 8.5, None]),
        "tokens_per_block": (16, [0, -1, 16.0, None])}),
    "num_blocks_for": Entry(num_blocks_for, {}, scalars={
        "num_tokens": (100, [-1, 100.0, None, "100"]), "tokens_per_block": (64, [0, -64, 64.0, None])}),
}


# -- the indexers: plan() and run() on their own state; a rejected call must leave every state tensor as it was
T_IDX = 64
LENS = torch.tensor([[130, 131], [64, 65]], dtype=torch.int32)  # B = 2, next_n = 2; W = 3 blocks


def _spin():
    idx = SpinIndexer(SpinConfig(sparsity=0.5, topk=16), num_layers=2, max_batch=8, max_blocks=3, next_n=2,
                      max_requests=4, num_cache_blocks=8)
    slots = [idx.state.allocate() for _ in range(2)]
    return idx, torch.tensor(slots, dtype=torch.int64)


def _state_tensors(idx):
    st = idx.state
    return {k: v.clone() for k, v in vars(st).items() if isinstance(v, torch.Tensor)}


def _unchanged(idx, before):
    after = _state_tensors(idx)
    for k, v in before.items():
        assert torch.equal(v, after[k]), f"a rejected call changed SpinState.{k}"


def spin_plan(block_table, seq_lens, slot_ids):
    idx, _ = _spin()
    before = _state_tensors(idx)
    try:
        idx.plan(block_table, seq_lens, slot_ids)
    except Exception:
        _unchanged(idx, before)
        with pytest.raises(RuntimeError, match="plan"):  # a rejected plan leaves run() unusable
            idx.run(0, PAGED_RUN["q_fp8"], PAGED_RUN["kv_cache"], PAGED_RUN["weights"])
        raise


def _run_inputs():
    x = make_paged_inputs((131, 65), 2, 8, 16, torch.Generator().manual_seed(1), extra_width=0, spare_blocks=2)
    return dict(q_fp8=x.q_fp8, kv_cache=x.kv_cache, weights=x.weights)


PAGED_RUN = _run_inputs()
RUN_TABLE = torch.tensor([[0, 1, 2], [3, 0, 0]], dtype=torch.int32)


def spin_run(q_fp8, kv_cache, weights, layer=0):
    idx, slots = _spin()
    idx.plan(RUN_TABLE, LENS, slots)
    before = _state_tensors(idx)
    try:
        out = idx.run(layer, q_fp8, kv_cache, weights)
    except Exception:
        _unchanged(idx, before)
        raise
    return out


def dense_run(q_fp8, kv_cache, weights, layer=0):
    dense = DenseIndexer(16, next_n=2)
    dense.plan(RUN_TABLE, LENS)
    return dense.run(layer, q_fp8, kv_cache, weights)


def _bad_spin_table(t, draw):
    out = t.clone()
    out[0, draw % 3] = [8, -1, 2**31 - 1][draw % 3]  # request 0 uses all 3 blocks; the cache holds 8
    return out


def _bad_spin_slots(t, draw):
    out = t.clone()
    out[draw % 2] = [2, 3, 4, -1, 2**40][draw % 5]  # 2, 3: free slots; 4: past the pool; -1
    return out


def _dup_or_bad_lens(t, draw):
    out = t.clone()
    kind = draw % 3
    if kind == 0:
        out[0, 0] = 3 * T_IDX + 1  # past W * T
    elif kind == 1:
        out[1, 1] = out[1, 0] + 2  # rows must grow by one
    else:
        out[0, 1] = -5
    return out


INDEXER_ENTRIES = {
    "SpinIndexer.plan": Entry(spin_plan, {
        "block_table": Arg(lambda: RUN_TABLE.clone(), (torch.int32,), (FIXED, None), _bad_spin_table,
                           ("seq_lens", "slot_ids")),
        "seq_lens": Arg(lambda: LENS.clone(), (torch.int32,), (FIXED, FIXED), _dup_or_bad_lens),
        "slot_ids": Arg(lambda: torch.tensor([0, 1]), INDEX, (FIXED,), _bad_spin_slots),
    }, anchor="block_table"),
    "SpinIndexer.run": Entry(spin_run, {
        "q_fp8": Arg(lambda: PAGED_RUN["q_fp8"].clone(), (FP8,), (FIXED, FIXED, FIXED, FIXED),
                     size_blames=("kv_cache", "weights")),
        "kv_cache": Arg(lambda: PAGED_RUN["kv_cache"].clone(), (torch.uint8,), (None, FIXED, FIXED, FIXED),
                        size_blames=("q_fp8", "block_table"), contiguous=True),
        "weights": Arg(lambda: PAGED_RUN["weights"].clone(), (torch.float32,), (FIXED, FIXED)),
    }, anchor="q_fp8", scalars={"layer": (0, [-1, 2, 0.5, None, "0", True])}),
    "DenseIndexer.run": Entry(dense_run, {
        "q_fp8": Arg(lambda: PAGED_RUN["q_fp8"].clone(), (FP8,), (FIXED, FIXED, FIXED, FIXED),
                     size_blames=("kv_cache", "weights")),
        "kv_cache": Arg(lambda: PAGED_RUN["kv_cache"].clone(), (torch.uint8,), (None, FIXED, FIXED, FIXED),
                        size_blames=("q_fp8", "block_table"), contiguous=True),
        "weights": Arg(lambda: PAGED_RUN["weights"].clone(), (torch.float32,), (FIXED, FIXED)),
    }, anchor="q_fp8"),
}
ENTRIES.update(INDEXER_ENTRIES)


@st.composite
def corruption(draw, entry: Entry):
    """(tensor args, scalar kwargs, names the error may start with: the corrupted argument first)."""
    tensors = {name: arg.make() for name, arg in entry.tensors.items()}
    scalars = {name: good for name, (good, _) in entry.scalars.items()}
    names = entry.only or tuple(entry.tensors)
    kinds = [(n, k) for n in names for k in ("dtype", "rank", "size", "device", "type", "data", "strided")]
    kinds += [(n, "scalar") for n in entry.scalars if entry.scalars[n][1]]
    name, kind = draw(st.sampled_from(kinds))
    if kind == "scalar":
        scalars[name] = draw(st.sampled_from(entry.scalars[name][1]))
        return tensors, scalars, (name,)
    arg, good = entry.tensors[name], tensors[name]
    if kind == "dtype":
        dtype = draw(st.sampled_from([d for d in ALL_DTYPES if d not in arg.dtypes]))
        bad = torch.zeros(good.shape, dtype=dtype)
    elif kind == "rank":
        if good.dim() > 0 and draw(st.booleans()):
            bad = good.select(draw(st.integers(0, good.dim() - 1)), 0) if good.numel() else good.sum(0)
        else:
            bad = good.unsqueeze(draw(st.integers(0, good.dim())))
    elif kind == "size":
        choices = [i for i, d in enumerate(arg.dims) if d is not None]
        if not choices:
            return draw(corruption(entry))
        dim = draw(st.sampled_from(choices))
        size = good.shape[dim]
        if arg.dims[dim] == FIXED:
            new = draw(st.integers(0, size + 3).filter(lambda s: s != size))
        else:
            new = draw(st.integers(0, arg.dims[dim] - 1))
        shape = list(good.shape)
        shape[dim] = new
        tensors[name] = torch.zeros(shape, dtype=good.dtype)
        return tensors, scalars, (name,) + arg.size_blames
    elif kind == "device":
        if entry.anchor is None or name == entry.anchor:
            return draw(corruption(entry))  # one-argument functions have no device to mismatch
        bad = good.to("meta")
    elif kind == "type":
        bad = draw(st.sampled_from([v for v in NOT_TENSORS if not (arg.keyword and v is None)]))  # None: no output
    elif kind == "data":
        if arg.bad_data is None:
            return draw(corruption(entry))
        bad = arg.bad_data(good, draw(st.integers(0, 2**16)))
    else:  # strided
        if not arg.contiguous:
            return draw(corruption(entry))
        bad = torch.cat([good, good], dim=-1)[..., ::2]
    tensors[name] = bad
    return tensors, scalars, (name,)


def call(entry: Entry, tensors, scalars):
    positional = [tensors[n] for n, a in entry.tensors.items() if not a.keyword]
    positional += [scalars[n] for n in entry.positional_scalars]
    keywords = {n: v for n, v in scalars.items() if n not in entry.positional_scalars}
    keywords.update({n: tensors[n] for n, a in entry.tensors.items() if a.keyword})
    return entry.fn(*positional, **keywords)


@pytest.mark.parametrize("name", list(ENTRIES))
def test_good_arguments_pass(name):
    entry = ENTRIES[name]
    call(entry, {n: a.make() for n, a in entry.tensors.items()}, {n: g for n, (g, _) in entry.scalars.items()})


@pytest.mark.parametrize("name", list(ENTRIES))
@given(data=st.data())
def test_one_bad_argument_raises_a_clear_error(name, data):
    entry = ENTRIES[name]
    tensors, scalars, names = data.draw(corruption(entry))
    snapshot = {n: t.clone() for n, t in tensors.items() if isinstance(t, torch.Tensor) and t.device.type != "meta"}
    try:
        call(entry, tensors, scalars)
    except (TypeError, ValueError) as err:
        assert str(err).startswith(tuple(f"{n}: expected" for n in names)), f"message does not name {names}: {err}"
    else:
        pytest.fail(f"{name} accepted a bad {names[0]}")
    if "kv_cache" in snapshot and name in ("write_kv_cache", "quantize_and_write"):
        assert torch.equal(tensors["kv_cache"], snapshot["kv_cache"]), "a rejected write changed the cache"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error of a machine without CUDA")
@pytest.mark.parametrize("make", [
    lambda: SpinState(SpinConfig(), 2, 2, 10, 640, device="cuda"),
    lambda: SpinIndexer(SpinConfig(), 2, 2, 10, device="cuda"),
    lambda: DenseIndexer(16, device="cuda"),
    lambda: new_kv_cache(2, 16, device="cuda"),
], ids=["SpinState", "SpinIndexer", "DenseIndexer", "new_kv_cache"])
def test_cuda_device_without_cuda_names_the_argument(make):
    with pytest.raises(ValueError, match=r"device: expected an available device, got cuda"):
        make()


@pytest.mark.parametrize("make, what", [
    (lambda: SpinState(SpinConfig(), 61, 2, 2**40, 640), "SpinState"),
    (lambda: SpinIndexer(SpinConfig(), 2, 2**16, 2**16, max_requests=1, num_cache_blocks=8), "SpinIndexer workspace"),
    (lambda: new_kv_cache(10**13, 128), "new_kv_cache"),
], ids=["state", "workspace", "kv_cache"])
def test_sizes_that_cannot_fit_get_a_memory_error_naming_them(make, what):
    with pytest.raises(MemoryError, match=rf"{what}: [0-9.]+ GiB for .*does not fit"):
        make()
