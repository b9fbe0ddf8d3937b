"""spin-indexer: SPIN, a shadow predictive indexer for DeepSeek-style sparse attention decoding."""
from .layout import BYTES_PER_TOKEN, HEAD_DIM, NUM_HEADS, TOKENS_PER_BLOCK, cache_views, new_kv_cache
from .ops import (block_max, dequantize_blocks, paged_indexer_logits, quantize_and_write, quantize_keys,
                  read_kv_cache, topk, write_kv_cache)

__version__ = "0.1.0"
