#!/usr/bin/env bash
# Reproduces results/fidelity/synthetic/*: two lanes of `spin-indexer eval` on synthetic presets, then the
# merged page. CPU only, one torch thread per process (see README.md, "Replay speed").
set -euo pipefail
cd "$(dirname "$0")/../.."
EVAL="python -m spin_indexer.cli.eval --prompts 2 --steps 64 --quiet"
OUT=results/fidelity/synthetic
lane_a() {
  $EVAL --synthetic v4-like --sweep all --out $OUT/v4-like --policy spin-default a0 a2-max a1-mean a1-top4 \
    a2-max-sum explore-none explore-staleness explore-block-age combine-vertical combine-diagonal
  $EVAL --synthetic shift --sweep exploration --out $OUT/shift
}
lane_b() {
  $EVAL --synthetic v32-like --sweep all --out $OUT/v32-like --policy spin-default a1-mean a1-top4 a2-max-sum \
    explore-none combine-vertical combine-diagonal
  python -m spin_indexer.cli.eval --synthetic v4-like --next-n 4 --steps 48 --prompts 2 --quiet --sweep mtp \
    --out $OUT/v4-like-mtp4
}
lane_c() {  # miss against context length (bins 4K-32K), the default policy
  $EVAL --synthetic v4-like --context 4096 8192 16384 32768 --sweep main --name synthetic-v4-like-4K-32K --out $OUT/v4-like-bins
}
lane_a & lane_b & wait
lane_c
python -m spin_indexer.cli.report results/fidelity
