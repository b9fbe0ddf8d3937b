#!/usr/bin/env bash
# Replays the real-model traces (spin-indexer capture -> runs/traces) and merges the page.
# usage: results/fidelity/run_real.sh [TRACES_DIR] [extra eval options, e.g. --layer-stride 2]
set -euo pipefail
cd "$(dirname "$0")/../.."
TR=${1:-runs/traces}
shift || true
OUT=results/fidelity/real
EVAL="python -m spin_indexer.cli.eval --traces $TR --name ruler-smollm2 --quiet $*"
$EVAL --sweep main --out $OUT/main
$EVAL --sweep exploration --policy explore-none explore-staleness explore-block-age --no-table1 --out $OUT/exploration &
$EVAL --sweep pooling --policy a0 a1-mean a1-top4 a2-max-sum --no-table1 --no-plots --out $OUT/pooling &
wait
python -m spin_indexer.cli.report results/fidelity
