"""The indexer that ties ops and predictor together: plan() per step, run() per layer."""
from .block_plan import BlockPlan
from .dense import DenseIndexer
from .spin import SpinIndexer

__all__ = ["SpinIndexer", "DenseIndexer", "BlockPlan"]
