#!/usr/bin/env bash
# The H200 runs of the step redesign, one device call each (carry: .dg, the DeepGEMM kit from ../shared/deepgemm):
#   bash benchmarks/h200_step.sh tests [PATHS]  CUDA test subset (kernels vs references on the device)
#   bash benchmarks/h200_step.sh grid [ARGS]    benchmarks/run_all.py, DeepGEMM side by side; ARGS go to it
#   bash benchmarks/h200_step.sh profile [ARGS] benchmarks/profile_step.py (kernel breakdown, stage timings)
#   bash benchmarks/h200_step.sh v32 [ARGS]     benchmarks/bench_v32_step.py (61 layers, one CUDA graph)
# Everything lands under $OUT (what comes back from the device).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:benchmarks
if [ -d .dg ]; then
    bash .dg/build_on_gpu.sh .dg > "$OUT/deepgemm_build.log" 2>&1 && \
        export PYTHONPATH=/tmp/dg/dg:$PYTHONPATH LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6
    tail -2 "$OUT/deepgemm_build.log"
fi
export SPIN_COMMIT=${SPIN_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
stage=${1:-grid}
shift || true
case "$stage" in
    tests)  # the CUDA subset, or the test paths given
        [ $# -gt 0 ] || set -- tests/ops tests/predictor tests/indexer
        python3 -m pytest -q -p no:cacheprovider "$@" 2>&1 | tee "$OUT/gputests.log" | tail -25 ;;
    grid)
        python3 benchmarks/run_all.py --out "$OUT" "$@" 2>&1 | tee "$OUT/run_all.log" | tail -60 ;;
    profile)
        python3 benchmarks/profile_step.py --out "$OUT" "$@" 2>&1 | tee "$OUT/profile.log" | tail -80 ;;
    v32)
        python3 benchmarks/bench_v32_step.py --out "$OUT" "$@" 2>&1 | tee "$OUT/v32.log" | tail -30 ;;
    *)
        echo "unknown stage $stage (tests, grid, profile, v32)"; exit 2 ;;
esac
