"""Fidelity metrics on hand-made cases (expected values worked out by hand) and against numpy."""
import math

import numpy as np
import pytest
import torch

from spin_indexer.eval.metrics import (block_sparsity, dense_topk, eligible_rows, miss_per_row, nearest_rank,
                                       pearson_rows, summarize_miss, table1_rows, topk_recall_rows)
from spin_indexer.ops.topk import topk_ref


def test_miss_hand_case():
    # request 0: blocks 0 and 2 kept of 3; request 1: only block 0 kept. next_n = 2 rows each.
    keep = torch.tensor([[True, False, True], [True, False, False]])
    topk = torch.tensor([
        [0, 64, 65, 130, -1],     # blocks 0,1,1,2 -> 2 of 4 missed
        [70, -1, -1, -1, -1],     # block 1 -> 1 of 1
        [-1, -1, -1, -1, -1],     # nothing valid -> 0
        [1, 2, 63, 64, 191],      # blocks 0,0,0,1,2 -> 2 of 5
    ], dtype=torch.int32)
    got = miss_per_row(keep, topk, next_n=2)
    assert torch.allclose(got, torch.tensor([0.5, 1.0, 0.0, 0.4]))


def test_miss_random_against_loop():
    g = torch.Generator().manual_seed(1)
    keep = torch.rand(3, 9, generator=g) < 0.6
    topk = torch.randint(-1, 9 * 64, (6, 20), generator=g, dtype=torch.int32)
    got = miss_per_row(keep, topk, next_n=2)
    for r in range(6):
        valid = [int(p) for p in topk[r] if p >= 0]
        missed = sum(1 for p in valid if not bool(keep[r // 2, p // 64]))
        assert got[r].item() == pytest.approx(missed / len(valid) if valid else 0.0)


def test_block_sparsity_ignores_bits_past_num_blocks():
    keep = torch.tensor([[True, False, True, True], [False, False, False, False], [True, True, True, True]])
    got = block_sparsity(keep, torch.tensor([3, 4, 0], dtype=torch.int32))
    assert torch.allclose(got, torch.tensor([1 / 3, 1.0, 0.0]))


def test_nearest_rank_and_summary():
    vals = torch.arange(1, 101, dtype=torch.float32)  # 1..100
    assert nearest_rank(vals, 0.99) == 99.0
    assert nearest_rank(vals[:10], 0.99) == 10.0  # ceil(9.9) = 10th smallest
    assert nearest_rank(torch.tensor([0.5]), 0.99) == 0.5
    assert math.isnan(nearest_rank(torch.tensor([]), 0.99))
    miss = torch.tensor([[0.0, 0.5], [0.25, 1.0]])
    elig = eligible_rows(torch.tensor([[10, 3000], [3000, 100]]), k=2048)
    out = summarize_miss(miss, elig)  # eligible: 0.5 and 0.25
    assert out == {"mean_miss": pytest.approx(0.375), "p99_miss": 0.5, "rows": 2}


def test_pearson_against_numpy():
    g = torch.Generator().manual_seed(2)
    pred = torch.randn(5, 40, generator=g)
    cur = 0.5 * pred + torch.randn(5, 40, generator=g)
    cur[1, 30:] = float("-inf")  # row 1 has only 30 positions
    pred[2, :3] = float("-inf")  # the predictor lacks 3 positions of row 2
    got = pearson_rows(pred, cur)
    for r in range(5):
        ok = np.isfinite(pred[r].numpy()) & np.isfinite(cur[r].numpy())
        want = np.corrcoef(pred[r].numpy()[ok].astype(np.float64), cur[r].numpy()[ok].astype(np.float64))[0, 1]
        assert got[r].item() == pytest.approx(want, abs=1e-6)
    const = pearson_rows(torch.ones(1, 5), torch.arange(5.0)[None])
    assert math.isnan(const[0].item())


def test_topk_recall_hand_cases():
    pred = torch.tensor([[5.0, 4, 3, 2, 1], [1.0, 1, 1, 1, 1], [0.0, 9, 8, 7, 6]])
    cur = torch.tensor([[0, 2], [1, 2], [1, 2]], dtype=torch.int32)
    lens = torch.tensor([5, 5, 2], dtype=torch.int32)
    # row 0: top2(pred) = {0, 1} -> 1 of 2; row 1: ties -> {0, 1} -> 1 of 2;
    # row 2: only positions 0, 1 exist, top2 = {1, 0}; cur {1, 2} -> 1 of 2
    assert torch.allclose(topk_recall_rows(pred, cur, lens), torch.tensor([0.5, 0.5, 0.5]))
    cur_pad = torch.tensor([[1, -1], [0, -1], [3, 4]], dtype=torch.int32)
    # row 0: 1 valid entry -> top1(pred) = {0} -> 0; row 1: top1 = {0} -> 1; row 2 len 5: top2 = {1, 2} -> 0
    assert torch.allclose(topk_recall_rows(pred, cur_pad, torch.tensor([5, 5, 5], dtype=torch.int32)),
                          torch.tensor([0.0, 1.0, 0.0]))


def test_dense_topk_equals_reference_on_ties():
    g = torch.Generator().manual_seed(3)
    for _ in range(20):
        cols = int(torch.randint(1, 200, (1,), generator=g))
        x = torch.randint(-3, 4, (6, cols), generator=g).float() * 0.5
        x[0, : min(3, cols)] = -0.0
        x[1] = float("-inf")
        lens = torch.randint(0, cols + 1, (6,), generator=g, dtype=torch.int32)
        k = int(torch.randint(1, cols + 10, (1,), generator=g))
        assert torch.equal(dense_topk(x, lens, k), topk_ref(x, lens, k))


def _trace_tensors(steps, layers, cols, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = (cols - steps + 1 + torch.arange(steps)).to(torch.int32)[:, None]  # the last step fills every column
    base = torch.randn(cols, generator=g)
    scores = base.expand(steps, layers, 1, cols).clone()
    past = torch.arange(cols)[None, None, None, :] >= lens[:, None, :, None].long()
    return scores.masked_fill(past, float("-inf")), lens


def test_table1_identical_scores_predict_perfectly():
    scores, lens = _trace_tensors(steps=5, layers=3, cols=400, k=32)
    out = table1_rows(scores, lens, k=32)
    for name in ("prev-layer", "prev-layer-best5", "prev-iteration"):
        assert out[name]["pearson"] == pytest.approx(1.0, abs=1e-6)
        assert out[name]["topk_recall"] == pytest.approx(1.0)
    assert abs(out["random"]["pearson"]) < 0.1
    assert out["random"]["topk_recall"] == pytest.approx(32 / 398, abs=0.04)  # k / L
    assert out["prev-layer"]["rows"] == 5 * 2 and out["prev-iteration"]["rows"] == 4 * 3


def test_table1_best5_picks_the_best_earlier_layer():
    g = torch.Generator().manual_seed(4)
    cols, k = 300, 16
    a, b = torch.randn(cols, generator=g), torch.randn(cols, generator=g)
    # layers: a, b, a. Layer 2's previous layer (b) is unrelated; two back (a) is identical.
    scores = torch.stack([a, b, a])[None, :, None, :].clone()
    lens = torch.tensor([[cols]], dtype=torch.int32)
    out = table1_rows(scores, lens, k=k)
    corr_ab = float(np.corrcoef(a.numpy(), b.numpy())[0, 1])
    assert out["prev-layer"]["pearson"] == pytest.approx(corr_ab, abs=1e-5)  # rows (1: a->b), (2: b->a)
    assert out["prev-layer-best5"]["pearson"] == pytest.approx((corr_ab + 1.0) / 2, abs=1e-5)


def test_table1_skips_short_rows():
    scores, lens = _trace_tensors(steps=3, layers=2, cols=100, k=512)
    out = table1_rows(scores, lens, k=512)
    assert set(out) == {"random", "prev-layer", "prev-layer-best5", "prev-iteration"}
    assert all(v["rows"] == 0 and math.isnan(v["pearson"]) for v in out.values())


def test_eval_table1_steps_caps_the_steps_table1_reads(tmp_path):
    """spin-indexer eval --table1-steps N: Table 1 over N evenly spaced steps per trace (the same numbers as
    ablations.table1(max_steps=N)), the replay itself unchanged."""
    import csv

    from spin_indexer.cli import main as cli
    from spin_indexer.eval.ablations import table1
    from spin_indexer.traces import generate

    out = {}
    for n in (32, 4):
        out[n] = tmp_path / f"t{n}"
        assert cli.main(["eval", "--synthetic", "v4-like", "--prompts", "1", "--steps", "16", "--num-layers", "4",
                         "--context", "2048", "--sweep", "smoke", "--no-plots", "--quiet", "--table1-steps", str(n),
                         "--out", str(out[n])]) == 0
    assert (out[32] / "summary.csv").read_text() == (out[4] / "summary.csv").read_text()
    trace = generate("v4-like", seed=0, prompt_id="v4-like-2048-0", context_len=2048, num_steps=16, num_layers=4)
    for n in (32, 4):
        want = {r["predictor"]: r["pearson"] for r in table1({"synthetic-v4-like": [trace]}, max_steps=n)
                if r["context"] == "all"}
        with open(out[n] / "table1.csv") as f:
            got = {r["predictor"]: float(r["pearson"]) for r in csv.DictReader(f)}
        assert got == pytest.approx(want, abs=1e-6)
    with open(out[4] / "table1.csv") as f4, open(out[32] / "table1.csv") as f32:
        assert f4.read() != f32.read()
