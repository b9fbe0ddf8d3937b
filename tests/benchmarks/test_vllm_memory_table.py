"""benchmarks/vllm_memory.py: the docs' memory table comes from build_state's tensors (meta device: exact
shapes, no memory) and the history spec's page size; here its numbers against independent formulas."""
from __future__ import annotations

import pytest

from conftest import import_benchmark


@pytest.fixture(scope="module")
def vllm_memory():
    return import_benchmark("vllm_memory")


def test_table_rows_match_the_formulas(vllm_memory, capsys):
    table, _ = vllm_memory.rows(61, 2048, 1, vertical_grain="slot")
    first = table[0]  # 128K x 256
    blocks = 256 * 2048
    assert first["tokens"] == blocks * 64
    assert first["history"] == blocks * (61 + 1) * 64 * 2  # 61 layers + 1 spare region, fp16 per token
    block_grain, _ = vllm_memory.rows(61, 2048, 1)  # the plugin's default for spin-default
    assert block_grain[0]["history"] == (blocks + 1) * 61 * 2  # the block maxima (and the trash block), fp16
    assert {k: v for k, v in block_grain[0].items() if k != "history"} == \
        {k: v for k, v in first.items() if k != "history"}
    assert first["keys"] == blocks * 61 * 64 * 132
    assert first["logits"] == 256 * 2048 * 64 * 4 == first["vllm_logits"]
    assert first["plan_scratch"] == 2 * 61 * 256 * 2048 * 4
    slots = 2 * 256 + 1
    assert first["tracker"] == 8 * (slots * 2 + slots + slots + 1)  # slot_blocks, last_len, last_used, clock
    assert first["per_slot"] >= 61 * slots * (8192 + 1) * 2  # the diagonal windows dominate
    assert vllm_memory.main([]) == 0 and "| 1M | 1024 |" in capsys.readouterr().out
