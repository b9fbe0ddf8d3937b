"""Result files and markdown tables shaped like the paper's Table 1, Tables 3/5 and Table 7.

An eval run writes into its output directory:
    rows.json      {"summary": [...rows...], "table1": [...], "run": {command, seconds, commit, ...}}
    summary.csv    the columns of results/fidelity/summary.csv, one line per row
    table1.csv     trace_set, indexer, predictor, pearson, topk_recall (context bins as trace_set@4K)
    report.md      the tables below; plots/*.png beside it
`spin-indexer report DIR` merges every rows.json under DIR into DIR/summary.csv, DIR/table1.csv and
DIR/REPORT.md (so later runs, e.g. adaptive policies, add rows by adding a run directory).
"""
from __future__ import annotations

import csv
import json
import math
from pathlib import Path

from .ablations import SUMMARY_COLUMNS, TABLE1_COLUMNS
from ..predictor.policies import POLICIES

# REFERENCE.md sec. 3 (DeepSeek-V4 Flash): target sparsity -> (mean, p99) miss in percent.
PAPER_MISS = {
    "AA-LCR": {0.2: (0.88, 7.81), 0.3: (1.92, 13.48), 0.4: (3.46, 20.31), 0.5: (5.78, 28.52)},
    "RULER": {0.2: (5.72, 19.92), 0.3: (10.07, 29.49), 0.4: (14.87, 38.67), 0.5: (20.68, 48.83)},
    "tau2-airline": {0.2: (5.9, 21.1), 0.3: (10.9, 30.9), 0.4: (17.3, 41.4), 0.5: (25.7, 53.1)},
}
# Paper Table 1: predictor -> {column: (pearson, recall)}; None where the paper has "-".
PAPER_TABLE1 = {
    "random": {"V3.2 summ 9.7K": (0.0, 0.203), "V3.2 AA-LCR 94K": (0.0, 0.022), "V4 summ": (0.0, 0.203),
               "V4 AA-LCR": (0.0, 0.022)},
    "prev-layer": {"V3.2 summ 9.7K": (0.289, 0.359), "V3.2 AA-LCR 94K": (0.431, 0.164), "V4 summ": (0.547, 0.482),
                   "V4 AA-LCR": (0.519, 0.306)},
    "prev-layer-best5": {"V3.2 summ 9.7K": (0.500, 0.461), "V3.2 AA-LCR 94K": None, "V4 summ": (0.626, 0.525),
                         "V4 AA-LCR": None},
    "prev-iteration": {"V3.2 summ 9.7K": (0.913, 0.824), "V3.2 AA-LCR 94K": (0.902, 0.615),
                       "V4 summ": (0.876, 0.751), "V4 AA-LCR": (0.849, 0.577)},
}
PREDICTOR_LABELS = {"random": "Random", "prev-layer": "Previous layer, same step",
                    "prev-layer-best5": "Previous layer, best of 5", "prev-iteration": "Previous iteration, same layer"}


def _fmt(x, pct=False, digits=3):
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    return f"{100 * x:.2f}%" if pct else f"{x:.{digits}f}"


def write_csv(path: Path, rows: list[dict], columns: tuple[str, ...]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(columns)
        for r in rows:
            w.writerow([_csv_value(r[c]) for c in columns])


def _csv_value(v):
    return f"{v:.6f}" if isinstance(v, float) else v


def table1_csv_rows(t1: list[dict]) -> list[dict]:
    """Table-1 rows for table1.csv: context bins fold into the trace_set name (set@16K)."""
    bins: dict[tuple, set] = {}
    for r in t1:
        if r.get("context", "all") != "all":
            bins.setdefault((r["trace_set"], r["indexer"]), set()).add(r["context"])
    out = []
    for r in t1:
        ctx = r.get("context", "all")
        if ctx != "all" and len(bins[(r["trace_set"], r["indexer"])]) < 2:
            continue  # a single bin repeats the set's own rows
        out.append({**r, "trace_set": r["trace_set"] if ctx == "all" else f"{r['trace_set']}@{ctx}"})
    return out


def write_run(out_dir: Path, summary: list[dict], t1: list[dict], run_info: dict) -> None:
    """rows.json + summary.csv + table1.csv + report.md of one eval run."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "rows.json").write_text(json.dumps({"summary": summary, "table1": t1, "run": run_info}, indent=1))
    write_csv(out_dir / "summary.csv", summary, SUMMARY_COLUMNS)
    write_csv(out_dir / "table1.csv", table1_csv_rows(t1), TABLE1_COLUMNS)
    (out_dir / "report.md").write_text(markdown(summary, t1, [run_info]))


def load_runs(results_dir: Path) -> tuple[list[dict], list[dict], list[dict]]:
    """Every rows.json under results_dir merged, oldest run first (by its recorded date), so a rerun's row
    replaces the older one with the same key: (summary rows, table1 rows, run infos)."""
    summary, t1, runs = [], [], []  # summary and t1: one list of rows per run
    files = sorted(Path(results_dir).rglob("rows.json"))
    if not files:
        raise FileNotFoundError(f"{results_dir}: no rows.json found (run `spin-indexer eval --out ...` first)")
    loaded = [(f, json.loads(f.read_text())) for f in files]
    loaded.sort(key=lambda fd: (fd[1].get("run", {}).get("date", ""), str(fd[0])))  # older runs first
    for f, data in loaded:
        summary.append(data.get("summary", []))
        t1.append(data.get("table1", []))
        runs.append({**data.get("run", {}), "file": str(f.relative_to(results_dir))})
    return _dedupe(_drop_stale_pools(summary), ("trace_set", "indexer", "context", "sparsity_target", "policy")), \
        _dedupe(_drop_stale_pools(t1), ("trace_set", "indexer", "predictor", "context")), runs


def _drop_stale_pools(per_run: list[list[dict]]) -> list[dict]:
    """Rows of every run, in order, less the pooled context 'all' rows of a run that does not cover every
    context of its (trace set, indexer): a run pools only its own traces, so its 'all' would misstate the
    merged set (and, being the last written, silently win)."""
    def key(r):
        return r.get("trace_set"), r.get("indexer")

    owns = []  # per run: (trace set, indexer) -> the contexts it has rows for
    for rows in per_run:
        own: dict[tuple, set] = {}
        for r in rows:
            if r.get("context") != "all":
                own.setdefault(key(r), set()).add(r.get("context"))
        owns.append(own)
    union: dict[tuple, set] = {}
    for own in owns:
        for k, contexts in own.items():
            union.setdefault(k, set()).update(contexts)
    out = []
    for rows, own in zip(per_run, owns):
        out += [r for r in rows if r.get("context") != "all" or own.get(key(r), set()) >= union.get(key(r), set())]
    return out


def _dedupe(rows: list[dict], key: tuple[str, ...]) -> list[dict]:
    """Last row wins for equal keys (a rerun replaces an older one)."""
    seen: dict[tuple, dict] = {}
    for r in rows:
        seen[tuple(r.get(k) for k in key)] = r
    return list(seen.values())


def markdown(summary: list[dict], t1: list[dict], runs: list[dict]) -> str:
    """The report page body: Table 1, Tables 3/5, Table 7, pooling and exploration tables."""
    parts = ["# SPIN fidelity report", ""]
    if t1:
        parts += _table1_md(t1)
    sets = sorted({(r["trace_set"], r["indexer"]) for r in summary})
    for trace_set, indexer in sets:
        rows = [r for r in summary if r["trace_set"] == trace_set and r["indexer"] == indexer]
        parts += _miss_md(trace_set, indexer, rows)
    if runs:
        parts += ["## Runs", ""]
        for r in runs:
            parts.append(f"- `{r.get('command', '?')}`: {r.get('seconds', float('nan')):.0f} s, "
                         f"{r.get('throughput', float('nan')):.0f} rows x layers x steps / s, "
                         f"commit {r.get('commit', '?')}, {r.get('date', '?')}")
        parts.append("")
    return "\n".join(parts)


def _ctx_key(ctx: str) -> float:
    return float("inf") if ctx == "all" else float(ctx.rstrip("K") or 0)


def _table1_md(t1: list[dict]) -> list[str]:
    nbins: dict[tuple, int] = {}
    for r in t1:
        if r.get("context", "all") != "all" and r["predictor"] == "random":
            nbins[(r["trace_set"], r["indexer"])] = nbins.get((r["trace_set"], r["indexer"]), 0) + 1
    cols = sorted({(r["trace_set"], r["indexer"], r.get("context", "all")) for r in t1
                   if r.get("context", "all") == "all" or nbins.get((r["trace_set"], r["indexer"]), 0) > 1},
                  key=lambda c: (c[0], c[1], c[2] != "all", _ctx_key(c[2])))
    preds = list(PREDICTOR_LABELS)
    out = ["## Table 1: predictors of the current indexer scores (Pearson / top-k recall)", "",
           "| trace set | indexer | context | " + " | ".join(PREDICTOR_LABELS.values()) + " |",
           "|---" * (len(preds) + 3) + "|"]
    for s, i, c in cols:
        cells = []
        for pred in preds:
            hit = [r for r in t1 if (r["trace_set"], r["indexer"], r.get("context", "all"), r["predictor"])
                   == (s, i, c, pred)]
            cells.append(f"{hit[0]['pearson']:.3f} / {hit[0]['topk_recall']:.3f}" if hit else "-")
        out.append(f"| {s} | {i} | {c} | " + " | ".join(cells) + " |")
    for column, label in (("V3.2 summ 9.7K", "V3.2 summscreenfd"), ("V3.2 AA-LCR 94K", "V3.2 AA-LCR"),
                          ("V4 summ", "V4 Flash summscreenfd"), ("V4 AA-LCR", "V4 Flash AA-LCR")):
        paper = [PAPER_TABLE1[pred][column] for pred in preds]
        ctx = "94K" if "AA-LCR" in column else "9.7K"
        out.append(f"| *paper* {label} | - | {ctx} | "
                   + " | ".join("-" if p is None else f"{p[0]:.3f} / {p[1]:.3f}" for p in paper) + " |")
    return out + ["", "Random recall is k / L by construction. Ours: averaged over eligible rows (context > k), "
                  "all layers and decode steps of every prompt.", ""]


def _miss_md(trace_set: str, indexer: str, rows: list[dict]) -> list[str]:
    out = [f"## {trace_set} ({indexer})", ""]
    bins = {r["context"] for r in rows} - {"all"}
    # one context bin: its rows repeat the "all" rows, show those only
    default = sorted((r for r in rows if r["policy"] == "spin-default" and (len(bins) > 1 or r["context"] == "all")),
                     key=lambda r: (r["context"] == "all", _ctx_key(r["context"]), r["sparsity_target"]))
    if default:
        out += ["### Tables 3/5: miss of the dense top-k, spin-default (A1-Max + random 5%)", "",
                "| context | target | realized | mean miss | p99 miss | rows | paper AA-LCR mean / p99 | "
                "paper RULER mean / p99 |", "|---|---|---|---|---|---|---|---|"]
        for r in default:
            s = round(r["sparsity_target"], 2)
            aa, ru = PAPER_MISS["AA-LCR"].get(s), PAPER_MISS["RULER"].get(s)
            out.append(f"| {r['context']} | {s:.0%} | {_fmt(r['realized_sparsity'], True)} | "
                       f"{_fmt(r['mean_miss'], True)} | {_fmt(r['p99_miss'], True)} | {r['rows']} | "
                       f"{'-' if aa is None else f'{aa[0]:.2f}% / {aa[1]:.2f}%'} | "
                       f"{'-' if ru is None else f'{ru[0]:.2f}% / {ru[1]:.2f}%'} |")
        out.append("")
    allctx = [r for r in rows if r["context"] == "all"]
    policies = list(dict.fromkeys(r["policy"] for r in allctx))
    if len(policies) > 1:
        targets = sorted({r["sparsity_target"] for r in allctx})
        out += ["### Policies (all contexts): mean / p99 miss, realized sparsity", "",
                "| policy | " + " | ".join(f"{t:.0%}" for t in targets) + " | what |",
                "|---" * (len(targets) + 2) + "|"]
        for p in policies:
            cells = []
            for t in targets:
                hit = [r for r in allctx if r["policy"] == p and r["sparsity_target"] == t]
                cells.append(f"{_fmt(hit[0]['mean_miss'], True)} / {_fmt(hit[0]['p99_miss'], True)} "
                             f"({_fmt(hit[0]['realized_sparsity'], True)})" if hit else "-")
            what = POLICIES[p][1] if p in POLICIES else ""
            out.append(f"| {p} | " + " | ".join(cells) + f" | {what} |")
        out.append("")
    mtp = [r for r in allctx if r["policy"].startswith("mtp-")]
    if mtp and max(r.get("next_n", 1) for r in mtp) > 1:
        out += ["### Table 7: MTP row policies", "",
                "| policy | target | realized sparsity | mean miss | p99 miss | acceptance |",
                "|---|---|---|---|---|---|"]
        for r in sorted(mtp, key=lambda r: (r["policy"], r["sparsity_target"])):
            out.append(f"| {r['policy']} | {r['sparsity_target']:.0%} | {_fmt(r['realized_sparsity'], True)} | "
                       f"{_fmt(r['mean_miss'], True)} | {_fmt(r['p99_miss'], True)} | "
                       f"{r.get('acceptance', 'not measured (replay)')} |")
        out.append("")
    return out
