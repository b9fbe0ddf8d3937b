import pytest
import torch

from spin_indexer.indexer import DenseIndexer
from spin_indexer.indexer.c4a import C4AConfig, C4AIndexer, compressed_lengths, window_entries
from spin_indexer.predictor import SpinConfig

T = 64


def test_config_roles_and_validation():
    cfg = C4AConfig(num_layers=6, indexer_layers=(0, 2, 4), reuse=((3, 2),))
    assert [cfg.role(l) for l in range(6)] == ["indexer", "dense", "indexer", "reuse", "indexer", "dense"]
    with pytest.raises(ValueError, match="C4AConfig.indexer_layers"):
        C4AConfig(num_layers=4, indexer_layers=(2, 1))
    with pytest.raises(ValueError, match="C4AConfig.reuse"):
        C4AConfig(num_layers=4, indexer_layers=(0, 2), reuse=((1, 2),))  # source after the layer
    with pytest.raises(ValueError, match="C4AConfig.reuse"):
        C4AConfig(num_layers=4, indexer_layers=(0, 2), reuse=((2, 0),))  # layer has its own indexer


def test_compressed_lengths_and_window():
    raw = torch.tensor([[1027, 1028]], dtype=torch.int32)
    assert compressed_lengths(raw, 4).tolist() == [[256, 257]]
    win = window_entries(raw, 300, 4, 128)
    # entries starting at raw token >= 1027 - 128 = 899 -> entry 225 (start 900) on
    assert win[0].nonzero().min().item() == 225 and win[1].nonzero().min().item() == 225


def test_c4a_indexer_matches_dense_at_zero_sparsity_and_reuses_top_k(gen):
    layers, width = 4, 40
    c4a = C4AConfig(num_layers=layers, indexer_layers=(0, 2), reuse=((3, 2),))
    idx = C4AIndexer(SpinConfig(sparsity=0.0, topk=512), c4a, max_batch=2, max_blocks=width)
    slots = torch.tensor([idx.state.allocate() for _ in range(2)], dtype=torch.int32)
    raw = torch.tensor([[4 * 2000 + 3], [4 * 600]], dtype=torch.int32)
    table = torch.arange(2 * width, dtype=torch.int32).view(2, width)
    dense = DenseIndexer(512)
    comp = compressed_lengths(raw, 4)
    dense.plan(table, comp)
    scores = torch.randn(2, width * T, generator=gen)
    scores[torch.arange(width * T)[None, :] >= comp] = float("-inf")
    for _ in range(2):
        idx.plan(table, raw, slots)
        out0 = idx.run(0, scores=scores)
        assert torch.equal(out0, dense.run_from_scores(0, scores))
        assert idx.run(1) is None
        out2 = idx.run(2, scores=scores)
        assert idx.run(3) is out2
    assert idx.state.num_layers == 2  # state only for the indexer layers
    idx.plan(table, raw, slots)
    with pytest.raises(RuntimeError, match="layer 3 reuses layer 2"):
        idx.run(3)
