"""The plugin: entry point, idempotent register(), vLLM builds our subclass under a real VllmConfig, the
op and its fake implementation, settings, and the clear error on an unsupported vLLM."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vllm not installed: these tests run in their own CI step (.ci/vllm_step.sh)")

import torch  # noqa: E402

import vllm_harness as vh  # noqa: E402
from spin_indexer.integrations import settings as st  # noqa: E402
from spin_indexer.integrations import vllm as plugin  # noqa: E402

pytestmark = pytest.mark.vllm
SPIN_ENV = ("SPIN_ENABLE", "SPIN_SPARSITY", "SPIN_EXPLORATION", "SPIN_POLICY", "SPIN_GAMMA", "SPIN_SEED", "SPIN_MTP", "SPIN_SHADOW",
            "SPIN_VERTICAL_GRAIN")


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for name in SPIN_ENV:
        monkeypatch.delenv(name, raising=False)


def test_entry_point_loads_and_registers_once():
    from importlib.metadata import entry_points

    from vllm.config import CompilationConfig
    from vllm.model_executor.custom_op import op_registry_oot
    from vllm.plugins import load_plugins_by_group

    eps = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert eps.get("spin_indexer") == "spin_indexer.integrations.vllm:register"
    funcs = load_plugins_by_group("vllm.general_plugins")  # what vLLM's load_general_plugins() calls
    assert funcs["spin_indexer"] is plugin.register
    assert funcs["spin_indexer"]() is True
    assert plugin.register() is True  # idempotent: no duplicate-registration assertion from vLLM
    from spin_indexer.integrations.vllm_layer import OP_NAME, SpinSparseAttnIndexer
    assert op_registry_oot["SparseAttnIndexer"] is SpinSparseAttnIndexer
    assert CompilationConfig._attention_ops.count(OP_NAME) == 1
    assert hasattr(torch.ops.spin_indexer, "sparse_attn_indexer")
    # vLLM's piecewise compilation then splits its graphs at our op, as at vllm::sparse_attn_indexer
    from vllm.config import CompilationMode
    compilation = CompilationConfig(mode=CompilationMode.VLLM_COMPILE)
    compilation.set_splitting_ops_for_v1(all2all_backend="naive")
    assert OP_NAME in compilation.splitting_ops and "vllm::sparse_attn_indexer" in compilation.splitting_ops


@pytest.mark.parametrize("source", ["off", "additional_config", "env"])
def test_vllm_builds_our_layer_under_real_config(source, monkeypatch, gen):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.sparse_attn_indexer import SparseAttnIndexer
    from vllm.model_executor.models.deepseek_v2 import DeepseekV32IndexerCache

    from spin_indexer.integrations.vllm_layer import SpinSparseAttnIndexer

    assert plugin.register()
    if source == "env":
        monkeypatch.setenv("SPIN_ENABLE", "1")
        monkeypatch.setenv("SPIN_SPARSITY", "0.4")
    cfg = vh.vllm_config({"enable": True, "sparsity": 0.25} if source == "additional_config" else None)
    buffer = torch.full((8, 512), -1, dtype=torch.int32)
    with set_current_vllm_config(cfg):
        cache = DeepseekV32IndexerCache(head_dim=132, dtype=torch.uint8, prefix=f"m.layers.0.{source}.k_cache",
                                        cache_config=cfg.cache_config)  # the model's real cache module
        layer = SparseAttnIndexer(cache, 128, "ue8m0", 512, 128, 4096, 8192, buffer)
    assert type(layer) is SpinSparseAttnIndexer
    assert layer._forward_method == layer._spin_forward
    if source == "off":
        assert layer.spin_runtime is None and "SPIN_ENABLE" in layer.spin_reason
        return
    assert layer.spin_runtime is not None and layer.spin_layer == 0
    sparsity = 0.25 if source == "additional_config" else 0.4
    assert layer.spin_runtime.settings.sparsity == sparsity
    assert layer.spin_runtime.settings.spin_config(512).topk == 512


def test_disabled_layer_is_vllms_own_forward(monkeypatch, gen):
    """SPIN off: forward goes straight to vLLM's path, the op is never called."""
    monkeypatch.setattr(vh.sai, "fp8_fp4_paged_mqa_logits", vh.flattened_paged_logits)
    assert plugin.register()
    cfg = vh.vllm_config(None)
    layers, buffer = vh.build_layers(cfg, [vh.make_cache(40, gen)], 512, 4096)
    calls = []
    monkeypatch.setattr(layers[0], "_spin_forward_eager", lambda *a: calls.append(a))
    step = vh.make_step([1000, 700], [list(range(16)), list(range(16, 28))], 1, 64, gen)
    got = vh.run_layer(cfg, layers, layers[0], step)
    assert not calls
    assert torch.equal(got, vh.reference(cfg, layers[0], step, buffer))


def test_op_fake_impl_is_shape_only():
    """Under fake tensors (what torch.compile traces with) the op runs its fake body, never the layer."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    assert plugin.register()
    with FakeTensorMode():
        hidden = torch.empty(4, 8)
        kv = torch.empty(10, 64, 132, dtype=torch.uint8)
        q = torch.empty(4, 64, 128, dtype=torch.float8_e4m3fn)
        w = torch.empty(4, 64)
        buf = torch.empty(4, 512, dtype=torch.int32)
        out = torch.ops.spin_indexer.sparse_attn_indexer(hidden, "no-such-layer", kv, q, None, w, buf)
    assert out is None


def test_settings_precedence_and_errors():
    env = {"SPIN_ENABLE": "yes", "SPIN_SPARSITY": "0.4", "SPIN_EXPLORATION": "none", "SPIN_POLICY": "a1-mean"}
    s = st.load_settings({"spin": {"sparsity": 0.2}}, env)
    assert (s.enable, s.sparsity, s.exploration, s.policy) == (True, 0.2, "none", "a1-mean")
    cfg = s.spin_config(2048)
    assert (cfg.sparsity, cfg.topk, cfg.exploration.value, cfg.reduce.value, cfg.mtp.value) == \
        (0.2, 2048, "none", "mean", "row0")
    assert not st.load_settings(None, {}).enable  # off by default
    with pytest.raises(ValueError, match="SPIN_SPARSITY"):
        st.load_settings(None, {"SPIN_SPARSITY": "lots"})
    with pytest.raises(ValueError, match="sparsity"):
        st.load_settings(None, {"SPIN_SPARSITY": "1.5"})
    with pytest.raises(ValueError, match="SPIN_ENABLE"):
        st.load_settings(None, {"SPIN_ENABLE": "maybe"})
    with pytest.raises(ValueError, match="expected keys"):
        st.load_settings({"spin": {"sparsty": 0.3}}, {})
    with pytest.raises(ValueError, match="policy"):
        st.load_settings(None, {"SPIN_POLICY": "nope"}).spin_config(512)
    with pytest.raises(ValueError, match="SpinVllmSettings.policy: 'summary8-0.7' is an evaluation policy"):
        st.load_settings({"spin": {"policy": "summary8-0.7"}}, {})
    for layered in ("spin-layers", "spin-layers-mix"):  # the proxy model's 30-layer budgets
        with pytest.raises(ValueError, match=f"SpinVllmSettings.policy: '{layered}' holds the proxy model's"):
            st.load_settings({"spin": {"policy": layered}}, {})


def test_unsupported_vllm_names_the_version(monkeypatch):
    monkeypatch.setitem(plugin.REQUIRED, "vllm.forward_context", ("get_forward_context", "no_such_symbol"))
    with pytest.raises(plugin.UnsupportedVllmError, match=r"vllm==0\.33\.0.*found vllm .*no_such_symbol"):
        plugin.check_vllm()
    monkeypatch.setitem(plugin.REQUIRED, "vllm.no_such_module", ("x",))
    monkeypatch.delitem(plugin.REQUIRED, "vllm.forward_context")
    with pytest.raises(plugin.UnsupportedVllmError, match="import vllm.no_such_module"):
        plugin.check_vllm()
    # register() raises only when SPIN was asked for; otherwise vLLM starts with the plugin inactive
    monkeypatch.setattr(plugin, "_registered", False)
    assert plugin.register() is False
    monkeypatch.setenv("SPIN_ENABLE", "1")
    with pytest.raises(plugin.UnsupportedVllmError):
        plugin.register()
