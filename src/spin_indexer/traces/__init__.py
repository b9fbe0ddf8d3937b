"""Indexer-score traces: the on-disk schema, a synthetic generator, and offline replay of SPIN."""
from .schema import (FORMAT_VERSION, Trace, TraceFormatError, TraceMeta, context_bin, list_traces, load_meta,
                     load_trace, save_trace, validate_trace)
from .synthetic import PRESETS as SYNTHETIC_PRESETS
from .synthetic import SyntheticSpec, generate, generate_set

__all__ = ["FORMAT_VERSION", "Trace", "TraceFormatError", "TraceMeta", "context_bin", "list_traces", "load_meta",
           "load_trace", "save_trace", "validate_trace", "SYNTHETIC_PRESETS", "SyntheticSpec", "generate",
           "generate_set"]
