"""What SPIN allocates on a vLLM server, and when: the per-server state (per-slot tables, step workspace,
tracker) at vLLM's profile run, where vLLM's memory profile counts it; the per-block history beside the
cached blocks. Sizes come from the allocated tensors (the meta device sizes exactly what the CPU allocates)."""
from __future__ import annotations

import logging

import pytest

pytest.importorskip("vllm", reason="vllm not installed: these tests run in their own CI step (.ci/vllm_step.sh)")

import torch  # noqa: E402

import vllm_harness as vh  # noqa: E402
from spin_indexer.integrations.settings import SpinVllmSettings  # noqa: E402
from spin_indexer.integrations.vllm_memory import attach_history, build_state, state_bytes  # noqa: E402

pytestmark = pytest.mark.vllm
MAX_MODEL_LEN = 4096
WIDTH = MAX_MODEL_LEN // vh.T


@pytest.fixture
def workspace_manager(monkeypatch):
    """vLLM's WorkspaceManager on the CPU, as GPUWorker initializes it before the profile run (its resize
    empties the accelerator's cache, which a CPU-only torch refuses: a no-op here), and one TP rank."""
    import types

    from vllm.v1.worker import workspace
    monkeypatch.setattr(torch.accelerator, "empty_cache", lambda: None)
    monkeypatch.setattr(vh.sai, "get_tp_group", lambda: types.SimpleNamespace(world_size=1))
    workspace.init_workspace_manager(torch.device("cpu"))
    yield
    workspace.reset_workspace_manager()


def _profile_run(cfg, layers, rows=8):
    """The forward of vLLM's profile run (GPUModelRunner.profile_run -> _dummy_run(is_profile=True)): no
    attention metadata, dummy inputs."""
    q = torch.zeros(rows, vh.H, vh.D).to(torch.float8_e4m3fn)
    with vh.set_current_vllm_config(cfg), vh.set_forward_context(None, cfg):
        for layer in layers:
            layer(torch.empty(rows, 8), q, None, torch.zeros(rows, vh.H))


def test_state_memory_is_sized_by_cached_blocks_and_meta_sizing_is_exact():
    """build_state on the meta device sizes exactly what it allocates on the CPU; only the per-block history
    follows the cache (L x (T + 1) x 2 bytes per block, 2.03 B per cached token per layer); the per-server
    state depends on max_num_seqs, max_model_len and the layer count only."""
    s = SpinVllmSettings(enable=True, sparsity=0.4, vertical_grain="slot")
    sizes = {}
    for device in ("meta", "cpu"):
        for blocks in (100, 300):
            ix, tr = build_state(s, 512, 3, 4, 8192, 1, vh.T, device)
            attach_history(ix, None, blocks)
            sizes[device, blocks] = state_bytes(ix, tr)
    assert sizes["meta", 100] == sizes["cpu", 100] and sizes["meta", 300] == sizes["cpu", 300]
    small, large = sizes["cpu", 100], sizes["cpu", 300]
    assert large["per_block"] - small["per_block"] == 200 * 3 * (vh.T + 1) * 2
    for key in ("per_slot", "workspace", "tracker"):
        assert large[key] == small[key], key
    assert small["tracker"] < 1024  # O(slots): 9 slots of a few int64


@pytest.mark.parametrize("policy, grain, block_grain", [
    ("spin-default", "auto", True), ("vertical-block", "auto", True), ("spin-default", "slot", False),
    ("a1-mean", "auto", False)])  # a1-mean reads each slot's own V: "auto" keeps slot grain for it
def test_block_grain_history_is_the_block_maxima_alone(policy, grain, block_grain):
    """Block grain (the plugin's default for spin-default): attach_history allocates no vertical table, only the
    block maxima, L x 2 bytes a block (1/(T + 1) of slot grain's per-block history)."""
    sizes = {}
    settings = SpinVllmSettings(enable=True, sparsity=0.4, policy=policy, vertical_grain=grain)
    for blocks in (100, 300):
        ix, tr = build_state(settings, 512, 3, 4, 8192, 1, vh.T, "cpu")
        attach_history(ix, None, blocks)
        assert (ix.state.vertical is None) == block_grain
        sizes[blocks] = state_bytes(ix, tr)["per_block"]
    assert sizes[300] - sizes[100] == 200 * 3 * (1 if block_grain else vh.T + 1) * 2


def test_per_server_state_is_allocated_at_vllms_profile_run(workspace_manager, caplog, gen):
    """vLLM's profile run (no attention metadata) builds SPIN's per-server state, on the device of the
    dummy inputs, with exactly build_state's sizes; the first real step uses those very tensors (no new
    allocation but the per-block history) and, at s = 0, gives vLLM's own top-k."""
    caplog.set_level(logging.INFO, logger="spin_indexer.vllm")
    cfg = vh.vllm_config({"enable": True, "sparsity": 0.0}, max_num_seqs=4)
    layers, buffer = vh.build_layers(cfg, [vh.make_cache(80, gen) for _ in range(2)], 512, MAX_MODEL_LEN)
    runtime = layers[0].spin_runtime
    assert runtime.indexer is None
    _profile_run(cfg, layers)
    assert runtime.reserved_at_profile and runtime.indexer is not None
    ix = runtime.indexer
    want_ix, want_tr = build_state(runtime.settings, 512, 2, 4, MAX_MODEL_LEN, 1, vh.T, "meta")
    got = state_bytes(ix, runtime.tracker)
    assert got == state_bytes(want_ix, want_tr)
    assert got["workspace"] > 0 and got["per_slot"] > 0
    ptrs = {name: t.data_ptr() for name, t in vars(ix.workspace).items() if isinstance(t, torch.Tensor)}
    ptrs["diagonal"] = ix.state.diagonal.data_ptr()
    assert any("reserved SPIN's per-server state at vLLM's profile run" in r.getMessage() for r in caplog.records)

    step = vh.make_step([1500, 700], [list(range(0, 24)), list(range(30, 41))], 1, WIDTH, gen)
    for layer in layers:
        got_topk = vh.run_layer(cfg, layers, layer, step)
        want = vh.reference(cfg, layer, step, buffer)
        vh.assert_same_topk(got_topk[:2], want[:2], vh.dense_logits(layer, step), 512)
    assert runtime.planned_for(step.meta) and runtime.indexer is ix
    now = {name: t.data_ptr() for name, t in vars(ix.workspace).items() if isinstance(t, torch.Tensor)}
    now["diagonal"] = ix.state.diagonal.data_ptr()
    assert now == ptrs, "the first step reallocated the per-server state"
    assert ix.state.num_cache_blocks == 80  # the history: SPIN's own here (no KV-cache spec in this harness)
    assert not any("built at the first step" in r.getMessage() for r in caplog.records)


def test_without_a_profile_run_the_state_is_built_at_the_first_step_and_said(caplog, gen):
    caplog.set_level(logging.INFO, logger="spin_indexer.vllm")
    cfg = vh.vllm_config({"enable": True, "sparsity": 0.5}, max_num_seqs=4)
    layers, _ = vh.build_layers(cfg, [vh.make_cache(40, gen)], 512, MAX_MODEL_LEN)
    vh.run_layer(cfg, layers, layers[0], vh.make_step([1500], [list(range(0, 24))], 1, WIDTH, gen))
    runtime = layers[0].spin_runtime
    assert runtime.indexer is not None and not runtime.reserved_at_profile
    assert any("built at the first step" in r.getMessage() for r in caplog.records)
