"""benchmarks/logits_chunks.py: its config names parse (and bad ones are refused), and a CPU dry run prints a row
per (config, chunk) with the production one marked (the timings need CUDA)."""
from __future__ import annotations

import pytest

from conftest import import_benchmark, run_benchmark_dry


def test_configs_parse_and_reject():
    chunks = import_benchmark("logits_chunks")
    cfg = chunks.parse_config("s2p")
    assert (cfg.group, cfg.num_warps, cfg.num_stages, cfg.prefetch) == (1, 4, 2, 1)
    assert chunks.parse_config("s4").prefetch == 0
    for bad in ("3", "s", "s9", "s3x", "p3"):
        with pytest.raises(SystemExit, match="--configs"):
            chunks.parse_config(bad)


def test_dry_run_prints_every_config_and_chunk():
    """A row for the production launch (chunk=None: its places and chunk, the block-count rule's beside it), then
    one per (config, chunk), the production pair marked."""
    proc = run_benchmark_dry("logits_chunks.py", ["--points", "2x4096", "--chunks", "1,4", "--configs", "s3,s3p"],
                             timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in proc.stdout.splitlines()
            if line.startswith("| 2 x 4096 |")]
    assert [(r[3], r[4].split()[0], r[5].split()[0]) for r in rows] == [
        ("triton", "production", "4"), ("triton", "s3", "1"), ("triton", "s3", "4"), ("triton", "s3p", "1"),
        ("triton", "s3p", "4")]
    assert rows[0][5] == "4 (rule 4)"  # the interpreter has no places: the block-count rule's chunk
    assert [r[4] for r in rows if "(production)" in r[5]] == ["s3p"]  # the compact launch prefetches the scales
    assert all(int(r[2]) < 2 * 64 for r in rows)  # half of 2 x 64 blocks kept (k = 2048 of 4096 tokens)
