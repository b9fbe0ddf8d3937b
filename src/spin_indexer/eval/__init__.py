"""Fidelity evaluation: metrics, named policies and sweeps over trace replay, reports and plots.

Submodules are imported on use (replay needs the predictor, plots need matplotlib).
"""
from .metrics import (TABLE1_PREDICTORS, block_sparsity, dense_topk, eligible_rows, miss_per_row, nearest_rank,
                      pearson_rows, summarize_miss, table1_rows, topk_recall_rows)

__all__ = ["TABLE1_PREDICTORS", "block_sparsity", "dense_topk", "eligible_rows", "miss_per_row", "nearest_rank",
           "pearson_rows", "summarize_miss", "table1_rows", "topk_recall_rows"]
