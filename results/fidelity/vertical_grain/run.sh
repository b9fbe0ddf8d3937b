#!/bin/bash
# Block grain against slot grain (SpinConfig.vertical_grain): traces captured on the CPU with the shipped lightning
# head, then `spin-indexer eval` with policies spin-default (slot) and vertical-block. Traces are not committed
# (~50-200 MB a set): this script recaptures them under $TRACES (default /tmp/vg).
set -e
cd "$(dirname "$0")/../../.."
T=${TRACES:-/tmp/vg}; OUT=results/fidelity/vertical_grain
mkdir -p "$T"
head -3 data/prompts/python_stdlib.jsonl > "$T/first3.jsonl"
sed -n 4,8p data/prompts/python_stdlib.jsonl > "$T/next6.jsonl"
cap() { python -m spin_indexer.cli.capture --indexer "${INDEXER:-lightning}" --steps 64 --k 256 --quiet "$@"; }
py() { cap --prompts "$T/$1" --domain python_stdlib --fit cut "${@:2}"; }
[ -d "$T/tr-py-4k" ] || py first3.jsonl --context 4096 --out "$T/tr-py-4k"
[ -d "$T/tr-ruler-4k" ] || cap --context 4096 --prompts 3 --task niah_single_2 --out "$T/tr-ruler-4k"
[ -d "$T/tr-py-8k" ] || py first3.jsonl --context 8192 --out "$T/tr-py-8k"
[ -d "$T/tr-py-16k" ] || py first3.jsonl --context 16384 --out "$T/tr-py-16k"
[ -d "$T/tr-py6-4k" ] || py next6.jsonl --context 4096 --out "$T/tr-py6-4k"
[ -d "$T/tr-ruler-8k" ] || cap --context 8192 --prompts 3 --task niah_single_2 --out "$T/tr-ruler-8k"
for c in 4096 8192; do  # the oracle: the model's own attention logits as the scores (no head)
    [ -d "$T/tr-py-$((c / 1024))k-oracle" ] || INDEXER=oracle py first3.jsonl --context $c \
        --out "$T/tr-py-$((c / 1024))k-oracle"
done
for set in py-4k py6-4k ruler-4k py-8k ruler-8k py-16k py-4k-oracle py-8k-oracle; do
    python -m spin_indexer.cli.main eval --traces "$T/tr-$set" --sweep main --policy spin-default vertical-block \
        --out "$OUT/$set" --jobs 1 --quiet --no-plots --no-table1
done
python - "$OUT" <<'PY'
import csv, sys, os
out = sys.argv[1]
lines = ["| set | s | slot grain mean / p99 | block grain mean / p99 | block - slot (mean, p99) |",
         "|---|---|---|---|---|"]
for name in ("py-4k", "py6-4k", "ruler-4k", "py-8k", "ruler-8k", "py-16k", "py-4k-oracle", "py-8k-oracle"):
    path = os.path.join(out, name, "summary.csv")
    if not os.path.exists(path):
        continue
    rows = {(r["policy"], r["sparsity_target"]): r for r in csv.DictReader(open(path)) if r["context"] == "all"}
    for s in sorted({k[1] for k in rows}):
        a, b = rows[("spin-default", s)], rows[("vertical-block", s)]
        f = lambda r, k: 100 * float(r[k])
        lines.append(f"| {name} | {float(s):.1f} | {f(a, 'mean_miss'):.2f} / {f(a, 'p99_miss'):.2f} | "
                     f"{f(b, 'mean_miss'):.2f} / {f(b, 'p99_miss'):.2f} | "
                     f"{f(b, 'mean_miss') - f(a, 'mean_miss'):+.2f}, {f(b, 'p99_miss') - f(a, 'p99_miss'):+.2f} |")
open(os.path.join(out, "table.md"), "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PY
