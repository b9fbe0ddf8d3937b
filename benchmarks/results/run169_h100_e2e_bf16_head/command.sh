# session 71 call 1: the GPU tests of the capture guard and row_span; on an H200 #14's canonical grid + V3.2 at
# this tree; the e2e with the DSA indexer shape (bf16 projections, the new default; float32 paired) at 96 / 64 and
# 32 requests, with DeepGEMM's logits forced, its profile, then the compact logits' chunks
export SPIN_COMMIT=$(cat .t/commit); T0=$(date +%s)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
T="tests/ops/test_indexer_logits_cuda.py tests/ops/test_history.py tests/ops/test_history_block.py \
tests/ops/test_indexer_logits_triton.py tests/ops/test_topk_triton.py tests/ops/test_topk_positions.py \
tests/ops/test_deepgemm.py tests/ops/test_deepgemm_schedule.py tests/predictor/test_plan_triton.py tests/predictor/test_step_guard.py \
tests/indexer/test_spin.py tests/ops/test_topk_attention.py tests/model/test_rope_triton.py \
tests/ops/test_summary_cache.py tests/predictor/test_plan_summary_triton.py tests/indexer/test_spin_cuda.py"
case "$gpu" in
  *H200*) big=96; small=32
    ALL_TESTS="$T" ALL_TESTS_S=200 ALL_WARM_S=200 ALL_GRID_S=120 ALL_V32_S=60 bash benchmarks/h200_step.sh all \
      | grep -E "passed|failed|^- (B=|every|SPIN own|GPU)|paired|vs_dense|spin-0.5 " | cut -c1-220 ;;
  *) big=64; small=32
    bash benchmarks/h200_step.sh tests tests/ops/test_indexer_logits_triton.py tests/ops/test_history_block.py \
      tests/ops/test_topk_triton.py | tail -3 ;;
esac
echo "t=$SECONDS"
mkdir -p $OUT/r
export T0=$T0
bash benchmarks/h200_step.sh cmd "
R=\$OUT/r
E='python3 benchmarks/bench_e2e.py --random-weights --indexer-shape 64x128 --steps 24 --configs dense spin-0.4 spin-0.5'
el() { echo \$(( \$(date +%s) - T0 )); }
run() { lim=\$1; name=\$2; shift 2; [ \$(el) -lt \$lim ] || { echo \"skip \$name at \$(el) s\"; return; }
  timeout 75 \"\$@\" > \$R/\$name.log 2>&1; echo \"== \$name t=\$(el)\"; tail -5 \$R/\$name.log | cut -c1-110; }
run 999 e2e${big} \$E --points ${big}x32768 --out \$R/e2e${big}
run 420 e2e${small} \$E --points ${small}x32768 --out \$R/e2e${small}
run 430 e2e${big}f32 \$E --points ${big}x32768 --out \$R/e2e${big}f32 --indexer-dtype float32
run 440 profile_e2e${big} python3 benchmarks/profile_e2e.py --random-weights --indexer-shape 64x128 --points ${big}x32768 --configs dense spin-0.4 spin-0.5 --top 30 --out /tmp/prof64
grep -E '^==|bound|_update_blocks|paged' \$R/profile_e2e${big}.log 2>/dev/null | cut -c1-110
run 440 e2e${big}dg env SPIN_INDEXER_LOGITS=deepgemm \$E --points ${big}x32768 --out \$R/e2e${big}dg
run 440 logits_chunks python3 benchmarks/logits_chunks.py --points ${big}x32768,32x32768,8x131072,96x131072,1x1048576
grep -i production \$R/logits_chunks.log 2>/dev/null | head -12 | cut -c1-160
cd \$OUT && tar czf s71a.tgz r && rm -rf r; ls \$OUT"
