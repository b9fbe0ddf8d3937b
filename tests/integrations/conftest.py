"""The vLLM tests' shared isolation: every test of a module that imports the harness (`import vllm_harness as
vh`) runs with no SPIN_* settings from the environment, vLLM's logits call on the flattened torch fallback and
the plugin registered (vllm_harness.isolate). Modules that test registration itself (test_vllm_plugin) do not
import the harness and keep their own fixtures."""
from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _vllm_cpu(request, monkeypatch):
    harness = getattr(request.module, "vh", None)
    if harness is not None and getattr(harness, "__name__", "") == "vllm_harness":
        harness.isolate(monkeypatch)
