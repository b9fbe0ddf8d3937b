"""Predictor state follows requests: vLLM reorders and condenses its batch, requests skip steps, finish,
are preempted; fresh slots are reset exactly as SpinState.reset does."""
from __future__ import annotations

import copy

import pytest

pytest.importorskip("vllm", reason="vllm not installed: these tests run in their own CI step (.ci/vllm_step.sh)")

import torch  # noqa: E402

import vllm_harness as vh  # noqa: E402
from spin_indexer.indexer import SpinIndexer  # noqa: E402
from spin_indexer.integrations.request_tracker import NO_BLOCK, RequestTracker  # noqa: E402
from spin_indexer.integrations.vllm_runtime import reset_slots_  # noqa: E402
from spin_indexer.predictor import SpinConfig, SpinState  # noqa: E402

pytestmark = pytest.mark.vllm
WIDTH = 64


def _model(gen, num_blocks, layers=2, sparsity=0.5, policy="explore-none", max_num_seqs=8):
    cfg = vh.vllm_config({"enable": True, "sparsity": sparsity, "policy": policy}, max_num_seqs=max_num_seqs)
    kvs = [vh.make_cache(num_blocks, gen) for _ in range(layers)]
    lyrs, buffer = vh.build_layers(cfg, kvs, 512, 4096)
    return cfg, lyrs


def _step_all(cfg, layers, step):
    return [vh.run_layer(cfg, layers, layer, step) for layer in layers]


def test_reordered_condensed_batches_match_fixed_slot_spin(gen):
    """Steps with permuted and condensed batches give exactly what SpinIndexer gives when each request
    keeps a fixed slot (no exploration, so slot numbers cannot matter), and each request keeps one slot."""
    lens = {"A": 3000, "B": 2200, "C": 1400, "D": 4000}
    num_blocks = 200
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    tables, at = {}, 0
    for name, L in lens.items():
        n = -(-(L + 10) // vh.T)
        tables[name], at = perm[at:at + n], at + n
    cfg, layers = _model(gen, num_blocks)
    runtime = layers[0].spin_runtime
    orders = [["A", "B", "C", "D"], ["C", "A", "D", "B"], ["D", "C"], ["B", "D", "A", "C"], ["A", "C"],
              ["D", "B", "C", "A"]]
    ref, ref_slot, seen_slot = None, {}, {}
    for order in orders:
        for name in order:
            lens[name] += 1
        step = vh.make_step([lens[n] for n in order], [tables[n] for n in order], 1, WIDTH, gen)
        outs = _step_all(cfg, layers, step)
        if ref is None:  # the reference: the same SpinIndexer config, one fixed slot per request
            ref = SpinIndexer(runtime.indexer.config, num_layers=2, max_batch=8, max_blocks=WIDTH, max_requests=4)
            for name in lens:
                ref_slot[name] = ref.state.allocate()
        slots = torch.tensor([ref_slot[n] for n in order])
        ref.plan(step.block_table, step.seq_lens, slots)
        for i, layer in enumerate(layers):
            kv = layer.k_cache.kv_cache.view(-1, vh.T, 1, vh.ROW)
            want = ref.run(i, step.q.view(len(order), 1, vh.H, vh.D), kv, step.weights)
            assert torch.equal(outs[i][:len(order)], want), f"layer {i}, order {order}"
        for row, name in enumerate(order):
            slot = int(runtime.last_slots[row])
            fresh = bool(runtime.last_fresh[row])
            assert fresh == (name not in seen_slot), f"{name}: fresh={fresh}"
            assert seen_slot.setdefault(name, slot) == slot, f"{name} moved from slot {seen_slot[name]} to {slot}"
    assert len(set(seen_slot.values())) == 4


@pytest.mark.parametrize("prefill_step", ["spin", "delegated"])
def test_finished_request_blocks_reused_start_fresh(prefill_step, gen):
    """A finishes; E gets A's physical blocks (its prefill writes them, its last prompt token in A's last
    block) and, with all 4 slots used once, A's old slot. E must not inherit A's history: at E's first
    decode every block is kept (never observed) although s = 0.5."""
    cfg, layers = _model(gen, 200, layers=1, max_num_seqs=2)  # 2 x 2 = 4 state slots
    runtime = layers[0].spin_runtime
    a_blocks, b_blocks, c_blocks, d_blocks = (list(range(i * 50, i * 50 + 50)) for i in range(4))
    la, lb, lc, ld = 3000, 2500, 2000, 2100
    for _ in range(2):
        la, lb = la + 1, lb + 1
        _step_all(cfg, layers, vh.make_step([la, lb], [a_blocks, b_blocks], 1, WIDTH, gen))
    for _ in range(2):  # A has finished; C and D take the two unused slots
        lc, ld = lc + 1, ld + 1
        _step_all(cfg, layers, vh.make_step([lc, ld], [c_blocks, d_blocks], 1, WIDTH, gen))
    assert sorted(runtime.last_slots.tolist()) == [2, 3]
    le = la - 2  # E's prompt (le - 1 tokens) ends in A's last block, written by E's prefill
    prompt = [a_blocks[p // vh.T] * vh.T + p % vh.T for p in range(le - 1)]
    if prefill_step == "spin":  # the prefill rides in a step that SPIN handles (B decodes)
        lb += 1
        _step_all(cfg, layers, vh.make_step([lb], [b_blocks], 1, WIDTH, gen, extra_written=prompt))
    else:  # ... or in a step delegated to vLLM (only a short request decodes)
        step = vh.make_step([20], [d_blocks[-1:]], 1, WIDTH, gen, extra_written=prompt)
        _step_all(cfg, layers, step)
        assert not runtime.planned_for(step.meta)
    lb += 1
    step = vh.make_step([lb, le], [b_blocks, a_blocks], 1, WIDTH, gen)
    _step_all(cfg, layers, step)
    plan = runtime.indexer.block_plan
    assert runtime.last_fresh.tolist() == [False, True]
    assert int(runtime.last_slots[1]) == 0, "E should reuse A's least recently used slot"
    assert int(plan.num_kept[1]) == int(plan.num_blocks[1]), "E inherited A's history"
    assert int(plan.num_kept[0]) < int(plan.num_blocks[0]), "B lost its history"


def test_preempted_request_restarts_fresh(gen):
    """B is preempted (its blocks freed), later re-prefilled (here into the same physical blocks, as a
    prefix-cache hit on its own freed blocks would give) and decodes again: fresh slot, full keep; A, which
    kept decoding, keeps its slot."""
    cfg, layers = _model(gen, 160, layers=1)
    runtime = layers[0].spin_runtime
    a_blocks, b_blocks = list(range(0, 50)), list(range(50, 100))
    la, lb = 3000, 2500
    for _ in range(2):
        la, lb = la + 1, lb + 1
        _step_all(cfg, layers, vh.make_step([la, lb], [a_blocks, b_blocks], 1, WIDTH, gen))
    slot_a, slot_b = runtime.last_slots.tolist()
    la += 1
    recompute = [b_blocks[p // vh.T] * vh.T + p % vh.T for p in range(lb)]
    _step_all(cfg, layers, vh.make_step([la], [a_blocks], 1, WIDTH, gen, extra_written=recompute))
    la, lb = la + 1, lb + 1
    _step_all(cfg, layers, vh.make_step([lb, la], [b_blocks, a_blocks], 1, WIDTH, gen))
    plan = runtime.indexer.block_plan
    assert runtime.last_fresh.tolist() == [True, False]
    assert int(runtime.last_slots[1]) == slot_a
    assert int(plan.num_kept[0]) == int(plan.num_blocks[0])


def test_tracker_reclaims_lru_slot_and_drops_records_of_rewritten_blocks():
    """Identity comes from the block of each row's previous token, its length and the step's writes only
    (no table sized by the KV cache): LRU reclaim, a record dropped by any write into its blocks, padding."""
    t = RequestTracker(num_slots=2, tokens_per_block=4)
    none = torch.empty(0, dtype=torch.int64)

    def go(rows, written=none):  # rows: (physical blocks, L)
        table = torch.zeros(len(rows), 8, dtype=torch.int32)
        for b, (ids, _) in enumerate(rows):
            table[b, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
        lens = torch.tensor([[L] for _, L in rows], dtype=torch.int32)
        slots, fresh, _ = t.assign(table, lens, written)
        return slots.tolist(), fresh.tolist()

    assert go([([1, 2], 6)]) == ([0], [True])  # A
    assert go([([1, 2], 7)]) == ([0], [False])
    assert go([([3], 2), ([4], 2)]) == ([1, 0], [True, True])  # B, C: LRU hands C A's idle slot 0
    # A comes back: slot 0 records C's block now, so A starts over in the LRU slot (a tie of two slots used
    # in the same step goes to the lower id); then C finds no slot holding its block and starts over.
    assert go([([1, 2], 8)]) == ([0], [True])
    assert go([([4], 3)]) == ([1], [True])
    # A grows into block 9: found through its previous token (block 2); slot 0 then records block 9.
    assert go([([1, 2, 9], 9)]) == ([0], [False])
    assert t.slot_blocks[0].tolist() == [9, 9]
    # Someone else writes into block 9 (a prefill there, say): A's record is gone, A restarts.
    t.forget_writes(torch.tensor([-1, 9 * 4 + 2, 5], dtype=torch.int64))
    assert t.slot_blocks[0].tolist() == [NO_BLOCK, NO_BLOCK]
    assert go([([1, 2, 9], 10)]) == ([1], [True])  # the LRU slot: C's, whose request is displaced
    # the same request's own write in a step does not drop the record it sets in that step
    assert go([([1, 2, 9], 11)], torch.tensor([9 * 4 + 2])) == ([1], [False])
    # padding rows (length 0) get the trash slot and leave no trace
    assert go([([5], 0), ([1, 2, 9], 12)]) == ([2, 1], [False, False])
    assert t.slot_blocks[2].tolist() == [NO_BLOCK, NO_BLOCK] and int(t.last_len[2]) == 0


def test_tracker_mtp_rows_and_duplicate_claims():
    t = RequestTracker(num_slots=4, tokens_per_block=4, next_n=3)
    written = torch.empty(0, dtype=torch.int64)
    table = torch.tensor([[1, 2, 3, 0]], dtype=torch.int32)
    rows = lambda L: torch.tensor([[L - 2, L - 1, L]], dtype=torch.int32)  # next_n = 3
    s0, f0, a0 = t.assign(table, rows(6), written)  # positions 3..5 (blocks 0 and 1)
    assert a0.tolist() == [0]
    # 0, 2, 0 drafts accepted (L grows by 1 + accepted): the previous token is always in a block written
    # last step, and the accepted count of the previous step comes from the length change, on the device
    for L, accepted in ((7, 0), (10, 2), (11, 0)):
        s, f, a = t.assign(table, rows(L), written)
        assert (s.tolist(), f.tolist(), a.tolist()) == (s0.tolist(), [False], [accepted])
    # A length that no decode step produces (shrank, or grew by more than next_n): restart, not inherit.
    s, f, a = t.assign(table, rows(15), written)
    assert (f.tolist(), a.tolist()) == ([True], [0])
    # Two rows that claim one slot (cannot happen in vLLM): the first keeps it, the second starts fresh.
    dup = torch.tensor([[1, 2, 3, 0], [1, 2, 3, 0]], dtype=torch.int32)
    s0 = s
    s, f, a = t.assign(dup, torch.tensor([[14, 15, 16]] * 2, dtype=torch.int32), written)
    assert s.tolist()[0] == s0.tolist()[0] and f.tolist() == [False, True]


def test_reset_slots_matches_spinstate_reset(gen):
    """The device-side reset of the runtime equals SpinState.reset on every tensor of the state."""
    cfg = SpinConfig(sparsity=0.3, topk=512)
    base = SpinState(cfg, num_layers=2, max_requests=5, num_cache_blocks=6, max_context=6 * 64)
    for name, value in vars(base).items():
        if isinstance(value, torch.Tensor):
            if value.dtype == torch.bool:
                value.copy_(torch.rand(value.shape, generator=gen) < 0.5)
            elif value.is_floating_point():
                value.copy_(torch.randn(value.shape, generator=gen))
            else:
                value.copy_(torch.randint(0, 9, value.shape, generator=gen))
    for slots in ([1], [0, 3], [4, 4, 2]):
        want, got = copy.deepcopy(base), copy.deepcopy(base)
        for s in set(slots):
            want.reset(s)
        reset_slots_(got, torch.tensor(slots))
        for name, value in vars(want).items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, getattr(got, name)), f"{name} differs after reset of {slots}"
