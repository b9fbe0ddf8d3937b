"""SpinStatLogger: shadow mode's miss and realized sparsity in vLLM's stat logging (log lines and /metrics).

A vLLM stat-logger plugin (entry point group `vllm.stat_logger_plugins`, name `spin_indexer_shadow`): vLLM
0.33's AsyncLLM instantiates it in the API process beside its own loggers and calls log() at each stats
interval. The counters live in the worker processes; their ShadowPublisher (shadow_export.py) writes them to
SPIN_STATS_DIR, and log() reads every worker's last record, then
  - logs one line: `spin-indexer shadow: rows ..., miss mean ..., miss p99 ..., realized sparsity ...`;
  - sets Prometheus gauges in prometheus_client's default registry (vLLM's /metrics serves it with one API
    server; with several, PROMETHEUS_MULTIPROC_DIR's collector serves what each process wrote):
      spin_indexer:shadow_rows, spin_indexer:shadow_miss_mean, spin_indexer:shadow_miss_p99,
      spin_indexer:shadow_realized_sparsity, each labelled layer="0".."L-1" and layer="all".
With SPIN or its shadow mode off it does nothing. Note: vLLM turns its stat logging on when any stat-logger
plugin is installed (even under --disable-log-stats); VLLM_PLUGINS=spin_indexer loads only the layer plugin.

Imports vLLM: loaded by vLLM's plugin loader only.
"""
from __future__ import annotations

import logging

from vllm.v1.metrics.loggers import StatLoggerBase

from .settings import load_settings
from .shadow_export import aggregate, read_published, stats_dir

logger = logging.getLogger("spin_indexer.vllm")
METRICS = ("rows", "miss_mean", "miss_p99", "realized_sparsity")
_GAUGES: dict = {}  # one set per process: prometheus_client refuses a second registration of a name


def _gauges() -> dict:
    if not _GAUGES:
        from prometheus_client import Gauge
        help_text = {"rows": "decode rows measured (length > top-k), summed over worker processes",
                     "miss_mean": "mean fraction of the dense top-k in blocks SPIN skipped",
                     "miss_p99": "p99 of that fraction (largest over worker processes)",
                     "realized_sparsity": "fraction of blocks SPIN skipped"}
        for name in METRICS:
            _GAUGES[name] = Gauge(f"spin_indexer:shadow_{name}", f"SPIN shadow mode: {help_text[name]}",
                                  labelnames=["layer"])
    return _GAUGES


class SpinStatLogger(StatLoggerBase):
    """See the module docstring. vllm_config: vLLM's config (its additional_config says whether SPIN's
    shadow mode is on, with the environment as fallback); engine_index: vLLM's engine index."""

    def __init__(self, vllm_config, engine_index: int = 0):
        settings = load_settings(getattr(vllm_config, "additional_config", None))
        self.enabled = settings.enable and settings.shadow
        self.engine_index = engine_index
        self.directory = stats_dir()
        self.last: list[dict] = []

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0) -> None:
        pass  # nothing per iteration: the counters are read at log()

    def log_engine_initialized(self) -> None:
        if self.enabled:
            logger.info("spin-indexer: shadow-mode counters are read from %s at each stats interval", self.directory)

    def log(self) -> None:
        if not self.enabled:
            return
        self.last = aggregate(read_published(self.directory))
        if not self.last:
            return
        gauges = _gauges()
        for entry in self.last:
            for name in METRICS:
                if entry[name] is not None:
                    gauges[name].labels(layer=str(entry["layer"])).set(entry[name])
        every = self.last[-1]
        fmt = lambda x: "n/a" if x is None else f"{x:.4f}"  # noqa: E731
        logger.info("spin-indexer shadow: rows %d, miss mean %s, miss p99 %s, realized sparsity %s (%d layers)",
                    every["rows"], fmt(every["miss_mean"]), fmt(every["miss_p99"]), fmt(every["realized_sparsity"]),
                    len(self.last) - 1)
