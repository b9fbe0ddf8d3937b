"""PNG plots after the paper's figures (matplotlib, Agg backend; imported only when plotting).

    heatmap_topk        Fig. 1: where a layer's dense top-k sits over decode steps
    miss_vs_sparsity    Figs. 2-4: p99 (solid) and mean (dotted) miss against realized block sparsity,
                        one line per policy (pooling variants, MTP policies, exploration policies)
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..traces.schema import Trace

FIGURES = {
    "fig3_pooling": (("a0", "a1-max", "a2-max", "a1-mean", "a1-top4", "a1-max-sum", "a2-max-sum"),
                     "Pooling variants (paper Fig. 3)"),
    "fig2_mtp": (("mtp-row0", "mtp-row-local"), "MTP row policies (paper Fig. 2)"),
    "fig4_exploration": (("explore-none", "explore-random", "explore-staleness", "explore-block-age",
                          "explore-random-10"), "Exploration policies (paper Fig. 4)"),
    "main": (("spin-default",), "spin-default (A1-Max + random 5%)"),
}


# Policies whose SpinConfig equals spin-default's: a run of spin-default stands in for them.
ALIASES = {"a1-max": "spin-default", "explore-random": "spin-default", "mtp-row0": "spin-default"}
MARKERS = "os^vDxP*"


def save_figure(fig, path: str | Path) -> Path:
    """Lay out, write (PNG, 110 dpi, parent folders created) and close `fig`; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    _plt().close(fig)
    return path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def heatmap_topk(trace: Trace, layer: int, path: str | Path, row: int = 0, bins: int = 256) -> Path:
    """Fig. 1: fraction of each position bin in the dense top-k, per decode step, for one layer."""
    plt = _plt()
    steps, cols = trace.num_steps, trace.max_len
    bins = min(bins, cols)
    img = torch.zeros(bins, steps)
    if trace.topk is not None:
        topk = trace.topk[:, layer, row].long()  # [S, K]
    else:
        from .metrics import dense_topk

        topk = dense_topk(trace.scores[:, layer, row].float(), trace.seq_lens[:, row], trace.meta.k).long()
    per_bin = cols / bins
    for s in range(steps):
        pos = topk[s][topk[s] >= 0]
        img[:, s] = torch.bincount((pos.float() / per_bin).long().clamp(max=bins - 1), minlength=bins).float()
    img /= per_bin
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.imshow(img.numpy(), aspect="auto", origin="lower", cmap="magma", extent=(0, steps, 0, cols),
              interpolation="nearest", vmin=0, vmax=max(1e-6, float(img.max())))
    ax.set_xlabel("decode step")
    ax.set_ylabel("logical position")
    ax.set_title(f"top-{trace.meta.k} positions, layer {layer}: {trace.meta.model} / {trace.name}", fontsize=9)
    return save_figure(fig, path)


def miss_vs_sparsity(rows: list[dict], policies: tuple[str, ...], title: str, path: str | Path) -> Path | None:
    """p99 (solid) and mean (dotted) miss vs realized sparsity per policy, one panel per (set, indexer)."""
    wanted = set(policies) | {ALIASES[p] for p in policies if p in ALIASES}
    rows = [r for r in rows if r["context"] == "all" and r["policy"] in wanted]
    if not any(r["policy"] in policies for r in rows):
        return None
    plt = _plt()
    panels = sorted({(r["trace_set"], r["indexer"]) for r in rows})
    fig, axes = plt.subplots(1, len(panels), figsize=(4.8 * len(panels), 3.8), squeeze=False)
    for ax, (trace_set, indexer) in zip(axes[0], panels):
        for i, pol in enumerate(policies):
            label = pol
            pick = lambda name: sorted((r["realized_sparsity"], r["p99_miss"], r["mean_miss"]) for r in rows  # noqa
                                       if (r["trace_set"], r["indexer"], r["policy"]) == (trace_set, indexer, name))
            pts = pick(pol)
            if not pts and pol in ALIASES:
                pts, label = pick(ALIASES[pol]), f"{pol} (= {ALIASES[pol]})"
            if not pts:
                continue
            x = [100 * p[0] for p in pts]
            color = f"C{i}"
            # identical curves (a0 / a2-max / a1-max under max-combine) stay visible through their markers
            ax.plot(x, [100 * p[1] for p in pts], "-", marker=MARKERS[i % len(MARKERS)], color=color, ms=7 - i % 4,
                    mfc="none", alpha=0.85, label=label)
            ax.plot(x, [100 * p[2] for p in pts], ":", color=color, lw=1)
        ax.set_xlabel("realized block sparsity (%)")
        ax.set_ylabel("miss of dense top-k (%)")
        ax.set_title(f"{trace_set} ({indexer})", fontsize=9)
        ax.grid(alpha=0.3)
    for ax in axes[0]:
        ax.legend(fontsize=7)
    fig.suptitle(f"{title}: p99 (solid), mean (dotted)", fontsize=10)
    return save_figure(fig, path)


def miss_by_step(rows: list[dict], trace_set: str, target: float, policies: tuple[str, ...] | None,
                 path: str | Path) -> Path | None:
    """Mean miss per decode step (all layers and prompts) for each policy at one target sparsity: shows how
    fast each exploration policy recovers after a sudden shift."""
    wanted = None if policies is None else set(policies) | {ALIASES[p] for p in policies if p in ALIASES}
    rows = [r for r in rows if r["context"] == "all" and r["trace_set"] == trace_set
            and abs(r["sparsity_target"] - target) < 1e-9 and r.get("miss_by_step")
            and (wanted is None or r["policy"] in wanted)]
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 3.6))
    indexers = sorted({r["indexer"] for r in rows})
    for i, r in enumerate(sorted(rows, key=lambda r: (r["indexer"], r["policy"]))):
        ys = [None if v is None else 100 * v for v in r["miss_by_step"]]
        label = r["policy"] + (f" ({r['indexer']})" if len(indexers) > 1 else "")
        style = ("-", "--", ":", "-.")[indexers.index(r["indexer"]) % 4]
        ax.plot(range(len(ys)), ys, style, color=f"C{i % 10}", lw=1.2, label=label)
    ax.set_xlabel("decode step")
    ax.set_ylabel("mean miss (%)")
    ax.set_title(f"{trace_set}: miss per step at {target:.0%} target sparsity", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    return save_figure(fig, path)


def all_figures(rows: list[dict], out_dir: str | Path) -> list[Path]:
    """Figs. 2-4 (+ the default's curve) for whatever policies the rows hold."""
    out = []
    for name, (policies, title) in FIGURES.items():
        p = miss_vs_sparsity(rows, policies, title, Path(out_dir) / f"{name}.png")
        if p is not None:
            out.append(p)
    explore = FIGURES["fig4_exploration"][0]
    for trace_set in sorted({r["trace_set"] for r in rows}):
        p = miss_by_step(rows, trace_set, 0.4, explore, Path(out_dir) / f"steps_{trace_set}.png")
        if p is not None:
            out.append(p)
    return out
