"""Request identity from what vLLM gives (block tables, lengths, the step's slot_mapping), checked against an
oracle that knows every request: prefix caching, preemption and re-admission, chunked prefill with MTP, a
block filled by a KV connector. Each step of each layer must be bit-identical to a SpinIndexer whose slots
are assigned by request name (a fresh slot exactly when a request is new or re-admitted), at s = 0.5 with
no exploration (slot numbers cannot matter), so every history (per block and per request) is the oracle's."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm not installed: these tests run in their own CI step (.ci/vllm_step.sh)")

import torch  # noqa: E402

import vllm_harness as vh  # noqa: E402
from spin_indexer.indexer import SpinIndexer  # noqa: E402

pytestmark = pytest.mark.vllm
MAX_MODEL_LEN = 4096
WIDTH = MAX_MODEL_LEN // vh.T
NUM_BLOCKS = 200


def _slots(blocks, lo, hi):
    return [blocks[p // vh.T] * vh.T + p % vh.T for p in range(lo, hi)]


def _drive(gen, schedule, next_n=1, mtp="row0", layers=2, grain="auto"):
    """schedule: steps of (rows, written, new): rows = [(name, L, blocks, accepted)], written = KV slots
    also written (prefills), new = names that enter (new or re-admitted). grain: SpinVllmSettings.vertical_grain
    ("auto": block grain, the plugin's default). Returns the runtime and, per step, the oracle's plans of layer 0
    (keep masks)."""
    cfg = vh.vllm_config({"enable": True, "sparsity": 0.5, "policy": "explore-none", "mtp": mtp,
                          "vertical_grain": grain}, max_num_seqs=4)
    if next_n > 1:
        cfg.speculative_config = type("Spec", (), {"num_speculative_tokens": next_n - 1})()
    lyrs, _ = vh.build_layers(cfg, [vh.make_cache(NUM_BLOCKS, gen) for _ in range(layers)], 512, MAX_MODEL_LEN)
    runtime = lyrs[0].spin_runtime
    ref, slot_of, keeps = None, {}, []
    for s, (rows, written, new) in enumerate(schedule):
        names = [r[0] for r in rows]
        step = vh.make_step([r[1] for r in rows], [r[2] for r in rows], next_n, WIDTH, gen, extra_written=written)
        outs = [vh.run_layer(cfg, lyrs, layer, step) for layer in lyrs]
        assert runtime.planned_for(step.meta), f"step {s} went to vLLM"
        if ref is None:
            ref = SpinIndexer(runtime.indexer.config, num_layers=layers, max_batch=4, max_blocks=WIDTH, next_n=next_n,
                              max_requests=8, num_cache_blocks=NUM_BLOCKS)
        for name in new:
            if name in slot_of:
                ref.state.free(slot_of[name])
            slot_of[name] = ref.state.allocate()
        accepted = torch.tensor([0 if n in new else r[3] for n, r in zip(names, rows)], dtype=torch.int32)
        ref.plan(step.block_table, step.seq_lens, torch.tensor([slot_of[n] for n in names]),
                 num_accepted=accepted if mtp == "row-local" else None)
        keeps.append(ref.plans(0).keep_mask.clone())
        for i, layer in enumerate(lyrs):
            kv = layer.k_cache.kv_cache.view(-1, vh.T, 1, vh.ROW)
            want = ref.run(i, step.q.view(len(rows), next_n, vh.H, vh.D), kv, step.weights)
            assert torch.equal(outs[i][:len(rows) * next_n], want), f"step {s}, layer {i}"
        assert runtime.last_fresh.tolist() == [n in new for n in names], f"step {s}"
        if mtp == "row-local":
            assert runtime.last_accepted.tolist() == accepted.tolist(), f"step {s}"
    assert (runtime.indexer.state.vertical is None) == (grain != "slot") == (ref.state.vertical is None)
    for name in ("vertical", "block_max"):
        got, want = getattr(runtime.indexer.state, name), getattr(ref.state, name)
        assert (got is None and want is None) or torch.equal(got, want), name
    return runtime, keeps


@pytest.mark.parametrize("grain", ["auto", "slot"])  # block grain (the default) and the paper's per-token history
def test_prefix_cached_blocks_share_one_history_reset_when_a_sharer_enters(gen, grain):
    """A and B share prompt blocks 0-9 (B's prefix-cache hit; B's prefill writes only its own tail). By
    design the per-block history is one per physical block: both requests read and update the same rows;
    B's entry resets those blocks (it never observed them), so at B's first step both keep every shared
    block, and afterwards both requests' selections come from the one shared history."""
    shared = list(range(0, 10))
    a, b = shared + list(range(10, 30)), shared + list(range(40, 52))
    la, lb = 1500, 900
    schedule = [([("A", la, a, 0)], None, {"A"}), ([("A", la + 1, a, 0)], None, set()),
                ([("A", la + 2, a, 0)], _slots(b, 640, lb - 1), set()),  # B's prefill past the shared 640 tokens
                ([("B", lb, b, 0), ("A", la + 3, a, 0)], None, {"B"})]
    schedule += [([("A", la + 4 + i, a, 0), ("B", lb + 1 + i, b, 0)], None, set()) for i in range(3)]
    runtime, keeps = _drive(gen, schedule, grain=grain)
    assert not bool(keeps[1][0, :10].all()), "A should skip some shared blocks before B enters"
    assert bool(keeps[3][:, :10].all()), "B's entry resets the shared blocks: both keep all of them"
    assert torch.isfinite(runtime.indexer.state.block_max[shared]).all(), "the shared history was rebuilt"


def test_preempted_request_readmitted_starts_fresh_beside_a_running_one(gen):
    """B is preempted (two steps absent, its blocks freed), then re-admitted: re-prefilled into the same
    physical blocks (its own freed blocks hit the prefix cache, the tail block is recomputed) or into new
    ones. Either way its re-prefill writes the block of its previous token, so it starts fresh; A keeps its
    slot throughout."""
    a, b, b2 = list(range(0, 50)), list(range(50, 100)), list(range(100, 150))
    la, lb = 2000, 1800
    schedule = [([("A", la, a, 0), ("B", lb, b, 0)], None, {"A", "B"}),
                ([("A", la + 1, a, 0), ("B", lb + 1, b, 0)], None, set()),
                ([("A", la + 2, a, 0)], None, set()),
                ([("A", la + 3, a, 0)], _slots(b, (lb // vh.T) * vh.T, lb + 1), set()),  # same blocks: tail only
                ([("B", lb + 2, b, 0), ("A", la + 4, a, 0)], None, {"B"}),
                ([("A", la + 5, a, 0)], None, set()),
                ([("A", la + 6, a, 0)], _slots(b2, 0, lb + 2), set()),  # preempted again, re-prefilled elsewhere
                ([("A", la + 7, a, 0), ("B", lb + 3, b2, 0)], None, {"B"}),
                ([("B", lb + 4, b2, 0), ("A", la + 8, a, 0)], None, set())]
    _drive(gen, schedule)


def test_chunked_prefill_with_mtp_row_local_accepted_counts(gen):
    """next_n = 2, row-local MTP: E is prefilled in two chunks beside A's decodes, then decodes with A; the
    accepted counts come from the lengths (A accepts 1, 0, 1 drafts; E 0, 1), and E starts fresh."""
    a, e = list(range(0, 60)), list(range(60, 120))
    la, le = 2500, 2000
    schedule = [([("A", la, a, 0)], None, {"A"}),
                ([("A", la + 2, a, 1)], _slots(e, 0, 1000), set()),
                ([("A", la + 3, a, 0)], _slots(e, 1000, le - 2), set()),
                ([("E", le, e, 0), ("A", la + 5, a, 1)], None, {"E"}),
                ([("A", la + 6, a, 0), ("E", le + 1, e, 0)], None, set()),
                ([("E", le + 3, e, 1), ("A", la + 7, a, 0)], None, set())]
    _drive(gen, schedule, next_n=2, mtp="row-local")


def test_kv_connector_filled_blocks_start_fresh(gen):
    """A finishes; a KV connector loads request E into A's freed blocks (no slot_mapping write: A's record
    is still there). E's length does not continue A's, so E starts fresh; B keeps its history."""
    a, b = list(range(0, 50)), list(range(50, 100))
    la, lb = 3000, 2000
    schedule = [([("A", la, a, 0), ("B", lb, b, 0)], None, {"A", "B"}),
                ([("A", la + 1, a, 0), ("B", lb + 1, b, 0)], None, set()),
                ([("B", lb + 2, b, 0), ("E", la - 2, a, 0)], None, {"E"}),
                ([("E", la - 1, a, 0), ("B", lb + 3, b, 0)], None, set())]
    _drive(gen, schedule)
