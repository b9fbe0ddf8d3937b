"""ShadowPublisher: shadow mode's device counters, published from the worker process for vLLM's stat logging.

The counters (shadow.py) are device tensors in each vLLM worker; vLLM's stat loggers run in the API process
and see only the scheduler's and the iteration's stats, which carry nothing from a model layer. So each
worker's publisher, a daemon thread, copies the counters to the host every `interval_s` seconds and writes
them as JSON to `<SPIN_STATS_DIR>/shadow-<pid>-<id>.json` (written to a temporary name, then renamed, so a
reader never sees half a file); vllm_stats.SpinStatLogger reads every such file at each of vLLM's log
intervals. On CUDA the copy runs on a stream of its own and waits for that stream only: no step is
synchronized, and a snapshot may be taken while a step updates the counters (each counter is a running
sum, so a snapshot is at most one step behind in some of them).

SPIN_STATS_DIR is set by the plugin's register() in the first vLLM process (the API server) when unset,
so the engine and worker processes it starts inherit the same directory.
"""
from __future__ import annotations

import atexit
import json
import os
import tempfile
import threading
import time

import torch

from .shadow import ShadowStats, summarize

ENV_DIR = "SPIN_STATS_DIR"


def stats_dir() -> str:
    """The directory workers publish to and the stat logger reads (SPIN_STATS_DIR, else a per-user default)."""
    return os.environ.get(ENV_DIR) or os.path.join(tempfile.gettempdir(), f"spin-indexer-stats-{os.getuid()}")


class ShadowPublisher:
    """Publishes `stats` (ShadowStats) as `<directory>/shadow-<pid>-<label>.json` every `interval_s` seconds
    once start()ed; publish_once() does one write now (tests, shutdown)."""

    def __init__(self, stats: ShadowStats, label: str, directory: str | None = None, interval_s: float = 5.0):
        self.stats, self.interval_s = stats, interval_s
        self.directory = directory or stats_dir()
        self.path = os.path.join(self.directory, f"shadow-{os.getpid()}-{label}.json")
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="spin-shadow-publisher", daemon=True)
            self._thread.start()
            # At interpreter exit a daemon thread killed inside a torch call aborts the process ("terminate
            # called without an active exception", seen at the end of the vLLM test step): stop it first.
            atexit.register(self.stop)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop publishing, waiting for a publish in progress (at most timeout_s)."""
        self._stop.set()
        thread = self._thread
        if thread is not None and thread.is_alive() and thread is not threading.current_thread():
            thread.join(timeout_s)

    def publish_once(self) -> dict:
        """Copy the counters to the host (on a side stream on CUDA) and write them; returns what was written."""
        counters = self.stats.counters()
        device = next(iter(counters.values())).device
        if device.type == "cuda":
            side = torch.cuda.Stream(device=device)
            with torch.cuda.stream(side):
                host = {k: v.to("cpu", non_blocking=True) for k, v in counters.items()}
            side.synchronize()
        else:
            host = {k: v.clone() for k, v in counters.items()}
        record = {"pid": os.getpid(), "time": time.time(), "layers": summarize(host)}
        os.makedirs(self.directory, exist_ok=True)
        tmp = f"{self.path}.tmp"
        with open(tmp, "w") as f:
            json.dump(record, f)
        os.replace(tmp, self.path)
        return record

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.publish_once()
            except Exception:  # noqa: BLE001 - monitoring must never take the worker down
                pass


def read_published(directory: str | None = None, max_age_s: float = 120.0) -> list[dict]:
    """Every publisher's last record in `directory` written within max_age_s seconds (older files are of
    processes that are gone)."""
    directory = directory or stats_dir()
    try:
        names = sorted(n for n in os.listdir(directory) if n.startswith("shadow-") and n.endswith(".json"))
    except FileNotFoundError:
        return []
    now, out = time.time(), []
    for name in names:
        try:
            with open(os.path.join(directory, name)) as f:
                record = json.load(f)
        except (OSError, ValueError):
            continue
        if now - record.get("time", 0) <= max_age_s:
            out.append(record)
    return out


def aggregate(records: list[dict]) -> list[dict]:
    """Per layer over every record (processes): rows, miss_mean (rows-weighted), miss_p99 (the largest of
    the processes'), realized_sparsity (skipped / total blocks); then one entry with layer "all"."""
    by_layer: dict = {}
    for record in records:
        for entry in record["layers"]:
            acc = by_layer.setdefault(entry["layer"], {"rows": 0, "miss_sum": 0.0, "p99": None, "total": 0,
                                                       "skipped": 0})
            acc["rows"] += entry["rows"]
            acc["miss_sum"] += entry["miss_sum"]
            acc["total"] += entry["blocks_total"]
            acc["skipped"] += entry["blocks_skipped"]
            if entry["miss_p99"] is not None:
                acc["p99"] = max(acc["p99"] or 0.0, entry["miss_p99"])
    items = sorted(by_layer.items())
    if items:
        every = {"rows": sum(a["rows"] for _, a in items), "miss_sum": sum(a["miss_sum"] for _, a in items),
                 "total": sum(a["total"] for _, a in items), "skipped": sum(a["skipped"] for _, a in items),
                 "p99": max((a["p99"] for _, a in items if a["p99"] is not None), default=None)}
        items.append(("all", every))
    return [{"layer": layer, "rows": a["rows"], "miss_mean": a["miss_sum"] / a["rows"] if a["rows"] else None,
             "miss_p99": a["p99"], "realized_sparsity": a["skipped"] / a["total"] if a["total"] else None}
            for layer, a in items]
