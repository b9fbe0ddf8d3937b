# session 72 (H100): the e2e at 32 / 64 requests with the shipped defaults (h200_step.sh e2e), then the step's kernels at 32 x 32K
export SPIN_COMMIT=$(cat .t/commit)
nvidia-smi --query-gpu=name --format=csv,noheader
OUT=$OUT/r timeout 120 bash benchmarks/h200_step.sh e2e 32x32768,64x32768 | grep -E "spin-0|dense|x32768|Error" | cut -c1-160
mkdir -p $OUT/r/p; PYTHONPATH=src:benchmarks timeout 80 python3 benchmarks/profile_e2e.py --random-weights --indexer-shape 64x128 --points 32x32768 \
  --configs dense spin-0.5 --top 30 --out $OUT/r/p > $OUT/r/profile32.log 2>&1; grep -E '^==|indexer logits' $OUT/r/profile32.log
cd $OUT && tar czf s72f.tgz r && rm -rf r
