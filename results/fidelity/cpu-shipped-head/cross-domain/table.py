"""The cross-domain table of README.md from the eight <set>/summary.csv files: python table.py <this folder>."""
import csv, sys
doms = [("ruler", "RULER"), ("python_stdlib", "stdlib")]
ctxs = ["4k", "8k", "16k", "32k"]
pols = ["spin-default", "explore-none", "explore-random-10", "explore-staleness", "a1-top4", "a2-max", "a0"]
base = sys.argv[1]
data = {}
for d, _ in doms:
    for c in ctxs:
        for r in csv.DictReader(open(f"{base}/{d}-{c}/summary.csv")):
            if r["context"] != "all":
                continue
            data[(d, c, r["policy"], round(float(r["sparsity_target"]), 1))] = (100 * float(r["mean_miss"]), 100 * float(r["p99_miss"]), 100 * float(r["realized_sparsity"]))
for sp in (0.4, 0.5):
    print(f"\n### target {int(sp*100)}%: mean / p99 miss (%); a0 shows its realized sparsity (the others realize the target)\n")
    head = "| policy | " + " | ".join(f"{name} {c.upper()}" for d, name in doms for c in ctxs) + " |"
    print(head)
    print("|" + "---|" * (1 + len(doms) * len(ctxs)))
    for p in pols:
        cells = []
        for d, _ in doms:
            for c in ctxs:
                v = data.get((d, c, p, sp))
                cells.append("-" if v is None else (f"{v[0]:.2f} / {v[1]:.2f}" + (f" (realized {v[2]:.1f}%)" if p == "a0" else "")))
        print(f"| {p} | " + " | ".join(cells) + " |")
