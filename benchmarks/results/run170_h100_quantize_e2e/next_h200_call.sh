# session 71 call 2 (H200 only: the e2e at 96 requests needs ~85 GB): the e2e with the DSA indexer shape at 96 x 32K
# (bf16 projections), then #14's canonical grid + V3.2 at this tree
export SPIN_COMMIT=$(cat .t/commit); T0=$(date +%s)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
case "$gpu" in *H200*) ;; *) echo "not an H200: nothing run"; exit 0;; esac
mkdir -p $OUT/r
bash benchmarks/h200_step.sh cmd "timeout 90 python3 benchmarks/bench_e2e.py --random-weights --indexer-shape 64x128 --steps 24 \
  --configs dense spin-0.4 spin-0.5 --points 96x32768 --out \$OUT/r/e2e96 > \$OUT/r/e2e96.log 2>&1; tail -5 \$OUT/r/e2e96.log | cut -c1-110"
echo "t=$SECONDS"
ALL_TESTS="tests/ops/test_indexer_logits_triton.py" ALL_TESTS_S=150 ALL_WARM_S=180 ALL_GRID_S=110 ALL_V32_S=50 \
  bash benchmarks/h200_step.sh all | grep -E "passed|failed|^- (B=|every|SPIN own|GPU)|paired|vs_dense|spin-0.5 " | cut -c1-220
echo "t=$SECONDS"
if [ $SECONDS -lt 320 ]; then
  bash benchmarks/h200_step.sh cmd "timeout 60 python3 benchmarks/topk_attention_variants.py --batch 96 > \$OUT/r/attn_variants.log 2>&1; \
    grep -E 'KB=|fastest|splits=' \$OUT/r/attn_variants.log | cut -c1-120"
fi
cd $OUT && tar czf s71b.tgz r && rm -rf r; ls $OUT
