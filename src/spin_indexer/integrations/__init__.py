"""Serving-engine integrations. Each submodule imports its engine lazily; importing this package never
imports an engine.

    vllm.py            register(): the `vllm.general_plugins` entry point (SPIN as a vLLM plugin)
    vllm_layer.py      the SparseAttnIndexer subclass and the spin_indexer::sparse_attn_indexer op
    vllm_runtime.py    one SpinIndexer per model: step detection, plan, cache view, decode rows
    request_tracker.py device-side request identity from block tables (no request ids in vLLM metadata)
    settings.py        SpinVllmSettings from environment variables or vLLM's additional_config
"""
