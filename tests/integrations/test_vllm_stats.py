"""Shadow mode's counters through vLLM's stat logging: the worker's publisher writes them, SPIN's stat-logger
plugin (a vLLM StatLoggerBase, entry point vllm.stat_logger_plugins) reads them at log(), logs one line and
sets Prometheus gauges that equal runtime.shadow.snapshot()."""
from __future__ import annotations

import importlib
import json
import logging
import tomllib
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vllm not installed: these tests run in their own CI step (.ci/vllm_step.sh)")

import vllm_harness as vh  # noqa: E402

pytestmark = pytest.mark.vllm
WIDTH = 4096 // vh.T


@pytest.fixture(autouse=True)
def _stats_dir(_vllm_cpu, monkeypatch, tmp_path):  # after the isolation (conftest), which clears SPIN_* settings
    monkeypatch.setenv("SPIN_STATS_DIR", str(tmp_path))


def _gauge(name: str, layer: str) -> float | None:
    from prometheus_client import REGISTRY
    return REGISTRY.get_sample_value(f"spin_indexer:shadow_{name}", {"layer": layer})


def test_shadow_counters_reach_vllms_stat_logger_and_prometheus(caplog, tmp_path, gen):
    from vllm.v1.metrics.loggers import StatLoggerBase

    from spin_indexer.integrations.vllm_stats import SpinStatLogger

    spin = {"enable": True, "sparsity": 0.5, "shadow": True, "policy": "explore-none"}
    cfg = vh.vllm_config(spin, max_num_seqs=4)
    layers, _ = vh.build_layers(cfg, [vh.make_cache(120, gen) for _ in range(2)], 512, 4096)
    runtime = layers[0].spin_runtime
    tables, lens = [list(range(0, 60)), list(range(60, 100))], [3500, 2400]
    for _ in range(3):
        lens = [L + 1 for L in lens]
        step = vh.make_step(lens, tables, 1, WIDTH, gen)
        for layer in layers:
            vh.run_layer(cfg, layers, layer, step)
    assert runtime.publisher is not None and runtime.publisher.directory == str(tmp_path)
    written = runtime.publisher.publish_once()
    snap = runtime.shadow.snapshot()
    assert written["layers"] == snap

    assert issubclass(SpinStatLogger, StatLoggerBase)
    stat_logger = SpinStatLogger(cfg, engine_index=0)
    caplog.set_level(logging.INFO, logger="spin_indexer.vllm")
    stat_logger.record(None, None)
    stat_logger.log()
    for entry in snap:
        for name in ("rows", "miss_mean", "miss_p99", "realized_sparsity"):
            assert _gauge(name, str(entry["layer"])) == pytest.approx(entry[name]), (name, entry["layer"])
    rows = sum(e["rows"] for e in snap)
    assert _gauge("rows", "all") == rows
    skipped, total = sum(e["blocks_skipped"] for e in snap), sum(e["blocks_total"] for e in snap)
    assert _gauge("realized_sparsity", "all") == pytest.approx(skipped / total) and skipped > 0
    assert _gauge("miss_mean", "all") == pytest.approx(sum(e["miss_sum"] for e in snap) / rows)
    said = [r.getMessage() for r in caplog.records if "spin-indexer shadow:" in r.getMessage()]
    assert len(said) == 1 and f"rows {rows}" in said[0], said

    # two worker processes (two TP ranks, say): counts add up, ratios stay exact
    other = dict(written, pid=written["pid"] + 1)
    (tmp_path / "shadow-other.json").write_text(json.dumps(other))
    stat_logger.log()
    assert _gauge("rows", "all") == 2 * rows
    assert _gauge("realized_sparsity", "all") == pytest.approx(skipped / total)


def test_stat_logger_is_inert_without_shadow_mode_and_declared_as_a_vllm_plugin():
    from spin_indexer.integrations.vllm_stats import SpinStatLogger

    stat_logger = SpinStatLogger(vh.vllm_config({"enable": True, "sparsity": 0.5}))
    assert not stat_logger.enabled
    stat_logger.log()
    assert stat_logger.last == []
    pyproject = tomllib.loads((Path(__file__).parents[2] / "pyproject.toml").read_text())
    plugins = pyproject["project"]["entry-points"]["vllm.stat_logger_plugins"]
    assert plugins == {"spin_indexer_shadow": "spin_indexer.integrations.vllm_stats:SpinStatLogger"}
    module, name = plugins["spin_indexer_shadow"].split(":")
    assert getattr(importlib.import_module(module), name) is SpinStatLogger
