"""Fidelity metrics (pure functions; REFERENCE.md section 3).

- miss: per query row, the fraction of the dense top-k tokens that fall in skipped blocks;
  summarised as mean and p99 over *eligible* rows (context > k: shorter rows keep everything).
- realized block sparsity: skipped / total logical blocks, per request.
- Table 1: Pearson correlation and top-k recall of a predictor's scores against the current scores,
  for the predictors random, previous layer (same step), previous layer best-of-5, previous iteration
  (same layer).

p99 is the nearest-rank percentile (a value some row actually had: the smallest m with at least 99% of
rows <= m), which is why the paper's p99 values are multiples of 1/k (7.81% = 40/512).
"""
from __future__ import annotations

import math

import torch

from ..checks import check_int, check_range, check_tensor
from ..layout import TOKENS_PER_BLOCK
from ..ops.topk import order_keys, topk_ref
from ..predictor.miss import miss_per_row  # noqa: F401  (re-exported: the one miss computation)

TABLE1_PREDICTORS = ("random", "prev-layer", "prev-layer-best5", "prev-iteration")


def block_sparsity(keep_mask: torch.Tensor, num_blocks: torch.Tensor) -> torch.Tensor:
    """Realized block sparsity per request: 1 - kept / num_blocks, float32 [B].

    keep_mask: bool [B, W]; num_blocks: int [B] blocks the request occupies (kept bits past it are ignored).
    """
    check_tensor("keep_mask", keep_mask, dtype=torch.bool, ndim=2)
    check_tensor("num_blocks", num_blocks, dtype=(torch.int32, torch.int64), shape=(keep_mask.shape[0],),
                 shape_names="[B]")
    in_use = torch.arange(keep_mask.shape[1], device=keep_mask.device)[None, :] < num_blocks[:, None].long()
    kept = (keep_mask & in_use).sum(dim=1).float()
    total = num_blocks.float()
    return torch.where(total > 0, 1.0 - kept / total.clamp(min=1), torch.zeros_like(total))


def eligible_rows(seq_lens: torch.Tensor, k: int) -> torch.Tensor:
    """bool, same shape as seq_lens: rows whose context exceeds k (the only rows SPIN can make sparse)."""
    check_int("k", k, low=1)
    return seq_lens > k


def nearest_rank(values: torch.Tensor, q: float) -> float:
    """The nearest-rank q-quantile of a 1-D tensor (nan when empty): sorted[ceil(q * n) - 1]."""
    check_range("q", q, low=0.0, high=1.0)
    n = values.numel()
    if n == 0:
        return float("nan")
    rank = max(1, math.ceil(q * n))
    return float(torch.sort(values.reshape(-1).double()).values[rank - 1])


def summarize_miss(miss: torch.Tensor, eligible: torch.Tensor | None = None) -> dict[str, float]:
    """{'mean_miss', 'p99_miss', 'rows'} over the eligible entries of `miss` (any shape)."""
    vals = miss.reshape(-1) if eligible is None else miss.reshape(-1)[eligible.reshape(-1)]
    n = vals.numel()
    mean = float(vals.double().mean()) if n else float("nan")
    return {"mean_miss": mean, "p99_miss": nearest_rank(vals, 0.99), "rows": n}


def pearson_rows(pred: torch.Tensor, cur: torch.Tensor) -> torch.Tensor:
    """Pearson correlation per row over the columns finite in both, float32 [R] (nan if < 2 columns).

    pred, cur: float [R, C] (-inf marks positions a row does not have).
    """
    check_tensor("cur", cur, ndim=2)
    check_tensor("pred", pred, shape=tuple(cur.shape), shape_names="[R, C]", device=cur.device, device_of="cur")
    valid = torch.isfinite(pred) & torch.isfinite(cur)
    n = valid.sum(dim=1).double()
    x = torch.where(valid, pred.double(), 0.0)
    y = torch.where(valid, cur.double(), 0.0)
    mx = x.sum(1) / n.clamp(min=1)
    my = y.sum(1) / n.clamp(min=1)
    dx = torch.where(valid, x - mx[:, None], 0.0)
    dy = torch.where(valid, y - my[:, None], 0.0)
    cov = (dx * dy).sum(1)
    den = torch.sqrt((dx * dx).sum(1) * (dy * dy).sum(1))
    out = torch.where((n >= 2) & (den > 0), cov / den.clamp(min=1e-300), torch.full_like(cov, float("nan")))
    return out.float()


def topk_recall_rows(pred: torch.Tensor, cur_topk: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """|top-k(pred) ∩ cur_topk| / |cur_topk| per row, float32 [R].

    pred: float [R, C] predicted scores (positions >= lengths[r] are ignored); cur_topk: int [R, K] the
    current dense top-k, -1 padded; lengths: int [R]. top-k(pred) takes as many positions as cur_topk has
    valid entries; ties go to the lower position.
    """
    check_tensor("pred", pred, ndim=2)
    rows, cols = pred.shape
    check_tensor("cur_topk", cur_topk, dtype=(torch.int32, torch.int64), shape=(rows, None), shape_names="[R, K]")
    check_tensor("lengths", lengths, dtype=(torch.int32, torch.int64), shape=(rows,), shape_names="[R]")
    k = cur_topk.shape[1]
    # NaN or -inf predictions rank below every finite one but still above positions the row lacks.
    p = torch.nan_to_num(pred.float(), nan=-3e38, neginf=-3e38, posinf=3e38)
    order = torch.topk(order_keys(p, lengths), min(k, cols), dim=1).indices  # [R, min(K, C)]
    valid_cur = cur_topk >= 0
    count = valid_cur.sum(dim=1)
    take = torch.arange(order.shape[1], device=pred.device)[None, :] < count[:, None]
    member = torch.zeros(rows, cols + 1, dtype=torch.bool, device=pred.device)
    member.scatter_(1, torch.where(valid_cur, cur_topk.long(), cols), True)
    hits = (torch.gather(member[:, :cols], 1, order) & take).sum(dim=1).float()
    return torch.where(count > 0, hits / count.clamp(min=1).float(), torch.full_like(hits, float("nan")))


def dense_topk(scores: torch.Tensor, lengths: torch.Tensor, k: int) -> torch.Tensor:
    """Dense top-k of float scores [R, C] with lengths [R] -> int32 [R, k]: ops.topk_ref without the
    argument checks (best first, ties to the lower position, -1 past lengths[r])."""
    return topk_ref(scores.float(), lengths.to(torch.int32), k, validate=False)


def table1_rows(scores: torch.Tensor, seq_lens: torch.Tensor, k: int, topk: torch.Tensor | None = None,
                seed: int = 0, max_steps: int | None = None) -> dict[str, dict[str, float]]:
    """Table 1 for one trace: {predictor: {'pearson', 'topk_recall', 'rows'}} averaged over eligible rows.

    scores: float [S, L, N, C]; seq_lens: int32 [S, N]; topk: int [S, L, N, K] (recomputed when None).
    Predictors of the scores of (step s, layer l, row j):
      random            iid uniform scores (Pearson ~0, recall ~k/L by construction);
      prev-layer        scores of (s, l-1, j)           (rows with l >= 1);
      prev-layer-best5  per row, the best of (s, l-1..l-5, j) for each metric separately (an oracle
                        choice among the five previous layers; rows with l >= 1);
      prev-iteration    scores of (s-1, l, j) over the positions both steps have (rows with s >= 1).
    Only eligible rows (context > k) count. max_steps caps the steps used (evenly spaced) for speed.
    """
    check_tensor("scores", scores, ndim=4)
    steps, layers, next_n, cols = scores.shape
    check_tensor("seq_lens", seq_lens, dtype=torch.int32, shape=(steps, next_n), shape_names="[S, N]")
    use = list(range(steps))
    if max_steps is not None and steps > max_steps:
        use = sorted({round(i * (steps - 1) / (max_steps - 1)) for i in range(max_steps)})
    gen = torch.Generator().manual_seed(seed)
    acc = {name: {"pearson": [], "topk_recall": []} for name in TABLE1_PREDICTORS}
    for s in use:
        cur = scores[s].float().reshape(layers * next_n, cols)  # [L*N, C]
        lens = seq_lens[s].repeat(layers)  # [L*N]
        cur_topk = dense_topk(cur, lens, k) if topk is None else topk[s].reshape(layers * next_n, -1)
        elig = (lens > k).view(layers, next_n)

        def add(name, pred_rows, row_mask):
            p = pearson_rows(pred_rows, cur_rows(row_mask))
            r = topk_recall_rows(pred_rows, cur_topk[row_mask.reshape(-1)], lens[row_mask.reshape(-1)])
            acc[name]["pearson"].append(p)
            acc[name]["topk_recall"].append(r)
            return p, r

        def cur_rows(mask):
            return cur[mask.reshape(-1)]

        all_rows = elig
        rnd = torch.rand(layers * next_n, cols, generator=gen)
        rnd = torch.where(torch.isfinite(cur), rnd, float("-inf"))
        add("random", rnd[all_rows.reshape(-1)], all_rows)
        if layers > 1:
            mask = elig.clone()
            mask[0] = False
            prev = scores[s, :-1].float().reshape((layers - 1) * next_n, cols)
            add("prev-layer", prev[mask[1:].reshape(-1)], mask)
            best_p, best_r = None, None
            for back in range(1, 6):
                if back >= layers:
                    break
                m = elig.clone()
                m[:back] = False
                src = scores[s, :-back].float().reshape((layers - back) * next_n, cols)[m[back:].reshape(-1)]
                p = pearson_rows(src, cur_rows(m))
                r = topk_recall_rows(src, cur_topk[m.reshape(-1)], lens[m.reshape(-1)])
                # rows with l >= back: scatter into the per-row best over all rows with l >= 1
                full_p = torch.full((layers, next_n), float("-inf"))
                full_r = torch.full((layers, next_n), float("-inf"))
                full_p[m] = torch.nan_to_num(p, nan=float("-inf"))
                full_r[m] = torch.nan_to_num(r, nan=float("-inf"))
                best_p = full_p if best_p is None else torch.maximum(best_p, full_p)
                best_r = full_r if best_r is None else torch.maximum(best_r, full_r)
            acc["prev-layer-best5"]["pearson"].append(best_p[mask])
            acc["prev-layer-best5"]["topk_recall"].append(best_r[mask])
        if s >= 1:
            prev = scores[s - 1].float().reshape(layers * next_n, cols)
            add("prev-iteration", prev[elig.reshape(-1)], elig)
    out = {}
    for name, parts in acc.items():
        if not parts["pearson"]:
            continue
        p = torch.cat(parts["pearson"]).double()
        r = torch.cat(parts["topk_recall"]).double()
        ok = torch.isfinite(p) & torch.isfinite(r)
        out[name] = {"pearson": float(p[ok].mean()) if ok.any() else float("nan"),
                     "topk_recall": float(r[ok].mean()) if ok.any() else float("nan"), "rows": int(ok.sum())}
    return out
