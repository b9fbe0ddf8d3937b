"""Serving-engine integrations. Each submodule imports its engine lazily; importing this package never
imports an engine.

    vllm.py            register(): the `vllm.general_plugins` entry point (SPIN as a vLLM plugin)
    vllm_layer.py      the SparseAttnIndexer subclass and the spin_indexer::sparse_attn_indexer op
    vllm_runtime.py    one SpinIndexer per model: step detection, plan, cache view, decode rows
    vllm_memory.py     what SPIN allocates per server (built at vLLM's profile run) and its bytes
    vllm_history.py    the per-block history as vLLM KV-cache layers (sized and allocated by vLLM)
    vllm_hooks.py      the DeepSeek-V3.2 / GLM-5 CUDA attention's call into the indexer
    vllm_stats.py      shadow-mode counters in vLLM's stat logging (a stat-logger plugin)
    request_tracker.py device-side request identity from block tables, lengths and written slots
    shadow.py          shadow mode's device counters; shadow_export.py publishes them from the workers
    settings.py        SpinVllmSettings from environment variables or vLLM's additional_config
"""
