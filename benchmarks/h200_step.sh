#!/usr/bin/env bash
# The H200 runs of the step redesign, one device call each (carry: .dg, the DeepGEMM kit from ../shared/deepgemm):
#   bash benchmarks/h200_step.sh tests [PATHS]  CUDA test subset (kernels vs references on the device)
#   bash benchmarks/h200_step.sh grid [ARGS]    benchmarks/run_all.py, DeepGEMM side by side; ARGS go to it
#   bash benchmarks/h200_step.sh profile [ARGS] benchmarks/profile_step.py (kernel breakdown, stage timings), and
#                                               the update pass's ptxas counts in update_registers.log
#                                               (and the top-k's in topk_registers.log)
#   bash benchmarks/h200_step.sh v32 [ARGS]     benchmarks/bench_v32_step.py (61 layers, one CUDA graph)
#   bash benchmarks/h200_step.sh mtp [ARGS]     benchmarks/bench_mtp_logits.py (next_n 1-4 configs vs DeepGEMM and
#                                               the floors; ARGS go to it) after the logits kernel's CUDA tests,
#                                               ptxas counts of the device's triton in registers.log (7 files back)
#   bash benchmarks/h200_step.sh cuda [ARGS]    the CUDA logits kernel (issue #17): its tests under a 60 s limit (a
#                                               hung kernel must not eat the call), then, unless they hung,
#                                               benchmarks/cuda_logits_probe.py (ARGS go to it) under 200 s, and
#                                               with CUDA_MTP='ARGS' bench_mtp_logits.py (those ARGS) into $OUT/mtp
#   bash benchmarks/h200_step.sh ncu [ARGS]     Nsight Compute over benchmarks/ncu_kernels.py (one launch of each
#                                               kernel of the step and of the MTP logits) in $OUT/ncu.txt
#   bash benchmarks/h200_step.sh summary [ARGS] the summary mix (issue #18): its CUDA tests under a limit (a hung
#                                               kernel must not eat the call), then benchmarks/bench_summary.py
#                                               (ARGS go to it; rows in summary_cost.json)
#   bash benchmarks/h200_step.sh e2e [POINTS]   bench_e2e.py with the DSA-shape head (64 x 128, bf16), dense /
#                                               spin-0.4 / spin-0.5 at POINTS (default 96x32768,32x32768: #14's;
#                                               96 requests need an H200's memory) into $OUT/e2e
#   bash benchmarks/h200_step.sh cmd 'LINE'     LINE after the set-up (DeepGEMM built, PYTHONPATH, SPIN_COMMIT)
#   bash benchmarks/h200_step.sh canonical      #14's one call: `e2e` at the card's points, then `all` (~500 s)
#   bash benchmarks/h200_step.sh all            tests of the step's kernels + grid + v32 (+ profile, + a command:
#                                               ALL_* variables, see the stage) in one call, packed into
#                                               $OUT/h200_all.tgz (one file: a call brings back at most 8)
# Everything lands under $OUT (what comes back from the device; packed into $OUT/out.tgz past 7 files).
# SPIN_COMMIT names the commit in the results
# (the device copy's git HEAD can be stale: pass it explicitly).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
export PYTHONPATH=src:benchmarks
# pytest-xdist for the CUDA tests (carry .whl: its wheels, git-ignored): the tests' time there is triton's
# compile of each kernel variant (run 17: > 9 min for ~300 tests in one process), which parallelizes over the
# host's 16 cores; TEST_WORKERS=0 runs them in one process
if ! python3 -c "import xdist" 2>/dev/null && ls .whl/pytest_xdist-*.whl > /dev/null 2>&1; then
    python3 -m pip install -q --no-index --no-deps --target /tmp/site-xdist .whl/pytest_xdist-*.whl .whl/execnet-*.whl \
        && export PYTHONPATH=$PYTHONPATH:/tmp/site-xdist
fi
XDIST=""
if [ "${TEST_WORKERS:-8}" != 0 ] && python3 -c "import xdist" 2>/dev/null; then XDIST="-n ${TEST_WORKERS:-8}"; fi
if [ -d .dg ]; then
    bash .dg/build_on_gpu.sh .dg > "$OUT/deepgemm_build.log" 2>&1 && \
        export PYTHONPATH=/tmp/dg/dg:$PYTHONPATH LD_PRELOAD=/usr/lib/x86_64-linux-gnu/libstdc++.so.6
    tail -2 "$OUT/deepgemm_build.log"
fi
# The device copy's git HEAD can be stale (runs 58, 59 and 64 named an older commit from it): no default from it.
if [ -z "${SPIN_COMMIT:-}" ]; then
    echo "h200_step.sh: SPIN_COMMIT is not set: the results will name commit 'unset' (pass the hash you sent)" >&2
fi
export SPIN_COMMIT=${SPIN_COMMIT:-unset}
stage=${1:-grid}
shift || true
case "$stage" in
    tests)  # the CUDA subset, or the test paths given
        [ $# -gt 0 ] || set -- tests/ops tests/predictor tests/indexer
        python3 -m pytest -q -p no:cacheprovider $XDIST "$@" 2>&1 | tee "$OUT/gputests.log" | tail -25 ;;
    grid)
        python3 benchmarks/run_all.py --out "$OUT" "$@" 2>&1 | tee "$OUT/run_all.log" | tail -60 ;;
    profile)  # + the update pass's ptxas counts with the device's triton (update_registers.log)
        python3 benchmarks/update_registers.py > "$OUT/update_registers.log" 2>&1
        python3 benchmarks/topk_registers.py --groups 8 > "$OUT/topk_registers.log" 2>&1  # ptxas of the merges: ~1-2 min
        python3 benchmarks/profile_step.py --out "$OUT" "$@" 2>&1 | tee "$OUT/profile.log" | tail -80 ;;
    v32)
        python3 benchmarks/bench_v32_step.py --out "$OUT" "$@" 2>&1 | tee "$OUT/v32.log" | tail -30 ;;
    mtp)  # kernel tests first (the compiled kernel vs float64), then the sweep; the table is the last output
        python3 -m pytest -q -p no:cacheprovider $XDIST tests/ops/test_indexer_logits_triton.py \
            tests/ops/test_history.py::test_logits_with_history_leave_the_reference_state \
            tests/ops/test_history.py::test_fill_tail_false_leaves_blocks_past_the_lengths_unwritten \
            tests/ops/test_padded_cache.py::test_v4_page_strides_with_next_n > "$OUT/gputests.log" 2>&1
        tail -2 "$OUT/gputests.log"
        python3 benchmarks/logits_registers.py > "$OUT/registers.log" 2>&1
        python3 benchmarks/bench_mtp_logits.py --out "$OUT" "$@" 2>&1 | tee "$OUT/mtp.log" | tail -45 | cut -c1-400 ;;
    cuda)  # the CUDA logits kernel: tests (exit 124 / 137: timed out, probably a hang), then the probe builds
        timeout -k 5 "${CUDA_TESTS_S:-60}" python3 -m pytest -q -p no:cacheprovider tests/ops/test_indexer_logits_cuda.py \
            > "$OUT/cudatests.log" 2>&1
        rc=$?
        echo "cuda tests: exit $rc"; grep -E "passed|failed|^E  " "$OUT/cudatests.log" | head -8 | cut -c1-250
        if [ $rc -ne 124 ] && [ $rc -ne 137 ]; then
            timeout -k 5 "${CUDA_PROBE_S:-200}" python3 benchmarks/cuda_logits_probe.py --out "$OUT/probe" "$@" 2>&1 \
                | tee "$OUT/probe.log" | grep -E "^point|^- builds|^total|Error|error" | cut -c1-700
            if [ -n "${CUDA_MTP:-}" ]; then  # then #17's table (bench_mtp_logits, these arguments) in the same call
                timeout -k 5 "${CUDA_MTP_S:-240}" python3 benchmarks/bench_mtp_logits.py --out "$OUT/mtp" $CUDA_MTP 2>&1 \
                    | tee "$OUT/mtp.log" | grep -E "^B=|^- |^total|Error|error" | cut -c1-400
            fi
        fi ;;
    ncu)  # Nsight Compute counters of one launch of each kernel of benchmarks/ncu_kernels.py's parts (ARGS go
          # to it); works on Firecracker machines only (KINDS.md); the text report in $OUT/ncu.txt. NCU_KERNELS
          # (a regex) profiles only those kernels; NCU_SOURCE=1 adds the SourceCounters section and writes the
          # source page (stall samples by SASS instruction) to $OUT/source.csv.gz and its summary
          # (benchmarks/ncu_source.py) to $OUT/source_summary.txt
        src_args=(); [ -n "${NCU_SOURCE:-}" ] && src_args=(--section SourceCounters --import-source no -o "$OUT/ncu" -f)
        ncu --clock-control none --target-processes all --nvtx --nvtx-include "measure/" \
            ${NCU_KERNELS:+--kernel-name "regex:$NCU_KERNELS"} "${src_args[@]}" \
            --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
            --section SchedulerStats --section MemoryWorkloadAnalysis --section ComputeWorkloadAnalysis \
            python3 benchmarks/ncu_kernels.py "$@" > "$OUT/ncu.txt" 2>&1
        if [ -n "${NCU_SOURCE:-}" ] && [ -f "$OUT/ncu.ncu-rep" ]; then
            ncu --import "$OUT/ncu.ncu-rep" --page details >> "$OUT/ncu.txt" 2>&1
            ncu --import "$OUT/ncu.ncu-rep" --page source --csv --print-source sass 2>/dev/null | gzip -9 > "$OUT/source.csv.gz"
            rm -f "$OUT/ncu.ncu-rep"
            python3 benchmarks/ncu_source.py "$OUT/source.csv.gz" > "$OUT/source_summary.txt" 2>&1
        fi
        grep -E "^  [_a-z].*\(|Duration|Memory Throughput|Achieved Occupancy|Registers Per|Warp Cycles Per Issued|==PROF==|ERR" \
            "$OUT/ncu.txt" | head -120 | cut -c1-200 ;;
    all)  # environment overrides: ALL_TESTS (test paths), ALL_POINTS / ALL_BUDGET_S (grid), ALL_V32 (v32 points),
          # ALL_PROFILE (profile points; empty = no profile), ALL_EXTRA (a command run last, output under all/; it
          # must keep $PYTHONPATH, where DeepGEMM is: PYTHONPATH=src:benchmarks:$PYTHONPATH, or it runs without it);
          # ALL_TESTS_S / ALL_GRID_S / ALL_V32_S / ALL_PROFILE_S: each stage's wall limit (the tgz is packed anyway);
          # ALL_SPARSITIES (the grid's, default 0.5-0.2: the targets' range), ALL_GRID_ARGS (more run_all.py arguments, e.g. --tau-hint), ALL_V32_VARIANTS (bench_v32_step --variants), ALL_V32_ARGS (more bench_v32_step arguments, e.g. --vertical-grain block), ALL_PROFILE_PARTS (profile_step --parts); ALL_WARM=0: no
          # warm_cache.py (by default it compiles the grid's and profile's kernels in parallel while the tests run)
        mkdir -p "$OUT/all/grid" "$OUT/all/v32" "$OUT/all/profile"
        cp "$OUT/deepgemm_build.log" "$OUT/all/" 2>/dev/null
        points=${ALL_POINTS:-96x524288x1,96x1048576x1,96x131072x1,96x262144x1,32x524288x2,96x131072x2,\
8x131072x1,1x131072x1,32x131072x1,8x524288x1,1x1048576x1,1x65536x1,8x65536x1,96x65536x1,8x131072x2,1x131072x2,\
1x262144x1,1x524288x1,8x1048576x1,1x524288x2,1x1048576x2,8x524288x2}
        if [ "${ALL_WARM:-1}" = 1 ]; then  # the grid's and profile's kernels compiled meanwhile, in parallel
            timeout "${ALL_WARM_S:-400}" python3 benchmarks/warm_cache.py --out "$OUT/all/warm" \
                --points "$points${ALL_PROFILE:+,$ALL_PROFILE}" > "$OUT/all/warm.log" 2>&1 &
            warm_pid=$!
        fi
        timeout "${ALL_TESTS_S:-3600}" python3 -m pytest -q -p no:cacheprovider $XDIST ${ALL_TESTS:-tests/ops/test_indexer_logits_cuda.py tests/ops/test_history.py \
            tests/ops/test_indexer_logits_triton.py tests/ops/test_topk_triton.py tests/ops/test_topk_positions.py \
            tests/ops/test_deepgemm.py tests/ops/test_deepgemm_schedule.py tests/predictor/test_plan_triton.py tests/predictor/test_step_guard.py \
            tests/indexer/test_spin.py tests/ops/test_topk_attention.py tests/model/test_rope_triton.py \
            tests/ops/test_summary_cache.py tests/predictor/test_plan_summary_triton.py tests/indexer/test_spin_cuda.py} \
            > "$OUT/all/gputests.log" 2>&1
        tail -2 "$OUT/all/gputests.log"
        if [ -n "${warm_pid:-}" ]; then wait "$warm_pid"; tail -3 "$OUT/all/warm.log"; fi
        timeout "${ALL_GRID_S:-3600}" python3 benchmarks/run_all.py --out "$OUT/all/grid" --sparsities "${ALL_SPARSITIES:-0.5,0.4,0.3,0.2}" --budget-s "${ALL_BUDGET_S:-170}" \
            --points "$points" ${ALL_GRID_ARGS:-} > "$OUT/all/grid/run_all.log" 2>&1
        grep -E "^point|^- |^total" "$OUT/all/grid/run_all.log" | cut -c1-400
        timeout "${ALL_V32_S:-3600}" python3 benchmarks/bench_v32_step.py --out "$OUT/all/v32" --points "${ALL_V32:-96x131072,96x262144,autox1048576}" \
            --sparsity 0.5 --variants "${ALL_V32_VARIANTS:-default}" ${ALL_V32_ARGS:-} > "$OUT/all/v32/v32.log" 2>&1
        tail -24 "$OUT/all/v32/v32.log" | cut -c1-300
        if [ -n "${ALL_PROFILE:-}" ]; then
            timeout "${ALL_PROFILE_S:-3600}" python3 benchmarks/profile_step.py --out "$OUT/all/profile" --points "$ALL_PROFILE" \
                --parts "${ALL_PROFILE_PARTS:-kernels,topk,update}" \
                > "$OUT/all/profile/profile.log" 2>&1
            grep -E "top-k stages|us/layer" "$OUT/all/profile/profile.log" | head -40 | cut -c1-200
        fi
        if [ -n "${ALL_EXTRA:-}" ]; then
            mkdir -p "$OUT/all/extra"
            OUT="$OUT/all/extra" bash -c "$ALL_EXTRA" > "$OUT/all/extra/extra.log" 2>&1
            tail -30 "$OUT/all/extra/extra.log" | cut -c1-300
        fi
        tar czf "$OUT/h200_all.tgz" -C "$OUT" all && rm -rf "$OUT/all" "$OUT/deepgemm_build.log" ;;
    summary)  # the summary mix: the cache ops, the per-layer select and the step with it, on the device; then its cost
        timeout -k 5 "${SUMMARY_TESTS_S:-300}" python3 -m pytest -q -p no:cacheprovider $XDIST tests/ops/test_summary_cache.py \
            tests/predictor/test_plan_summary_triton.py tests/predictor/test_summary.py tests/indexer/test_spin_cuda.py \
            > "$OUT/summarytests.log" 2>&1
        echo "summary tests: exit $?"; grep -E "passed|failed|^E  " "$OUT/summarytests.log" | head -8 | cut -c1-250
        timeout -k 5 "${SUMMARY_BENCH_S:-240}" python3 benchmarks/bench_summary.py --out "$OUT/summary_cost.json" "$@" \
            2>&1 | tee "$OUT/summary.log" | tail -20 ;;
    canonical)  # #14's one H200 call: the e2e at the card's points (an H100 cannot hold 96 x 32K: 32 and 64
                # requests there), then `all` with the logits kernel's tests (warm_cache compiles meanwhile);
                # ~500 s with DeepGEMM's build. Each stage has a wall limit, so a slow one cannot eat the call;
                # the grid stops starting points 35 s before its limit, so that run_all finishes the point it is
                # in and writes its table (run 179: a 100 s limit under a 170 s budget killed it three points
                # short of the list, before the table).
        case "$(nvidia-smi --query-gpu=name --format=csv,noheader | head -1)" in
            *H200*) pts=96x32768,32x32768 ;;
            *) pts=32x32768,64x32768 ;;
        esac
        OUT="$OUT/e2eout" timeout "${CANONICAL_E2E_S:-130}" bash benchmarks/h200_step.sh e2e "$pts" \
            | grep -E "tok/s|spin-0|dense|x32768|Error" | cut -c1-160
        (cd "$OUT" && tar czf e2e.tgz e2eout && rm -rf e2eout)
        ALL_TESTS=${ALL_TESTS:-tests/ops/test_indexer_logits_triton.py} ALL_TESTS_S=${ALL_TESTS_S:-40} \
            ALL_GRID_S=${ALL_GRID_S:-150} ALL_BUDGET_S=${ALL_BUDGET_S:-$(( ${ALL_GRID_S:-150} - 35 ))} \
            ALL_V32_S=${ALL_V32_S:-40} ALL_WARM_S=${ALL_WARM_S:-150} \
            OUT="$OUT" timeout "${CANONICAL_ALL_S:-390}" bash benchmarks/h200_step.sh all ;;
    e2e)  # #14's end-to-end points with the DSA models' indexer shape
        python3 benchmarks/bench_e2e.py --random-weights --indexer-shape 64x128 --steps 24 \
            --configs dense spin-0.4 spin-0.5 --points "${1:-96x32768,32x32768}" --out "$OUT/e2e" 2>&1 \
            | tee "$OUT/e2e.log" | tail -12 ;;
    cmd)  # any command line after the set-up above (DeepGEMM on PYTHONPATH, SPIN_COMMIT exported): bash -c "$*"
        bash -c "$*" ;;
    *)
        echo "unknown stage $stage (tests, grid, profile, v32, mtp, cuda, ncu, summary, all, e2e, cmd)"; exit 2 ;;
esac
rc=$?
# A call brings back at most 8 files (run 165 left its e2e csv files on the device): more than that under $OUT are
# packed into $OUT/out.tgz (archives already there stay beside it)
if [ "$(find "$OUT" -type f ! -name '*.tgz' | wc -l)" -gt 7 ]; then
    (cd "$OUT" && find . -type f ! -name '*.tgz' -print0 | tar czf out.tgz --null -T - --remove-files \
        && find . -mindepth 1 -type d -empty -delete)
    echo "h200_step.sh: packed $OUT into out.tgz (more than 7 files)"
fi
exit $rc
