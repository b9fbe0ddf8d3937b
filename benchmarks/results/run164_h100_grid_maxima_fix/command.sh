# session 69 call 1: the maxima pass alone by configuration (the rounding fix against the old grid 32:9:4:64), then
# #14's canonical grid (block grain's update in the threshold launch, the maxima fix) with the new GPU tests
export SPIN_COMMIT=$(cat .t/commit)
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/pre
bash benchmarks/h200_step.sh cmd '
timeout 45 python3 benchmarks/maxima_pass_configs.py --out $OUT/pre --shapes 192x131072x0.8,192x131072x1.0,64x524288x0.8 \
  --configs 32:8:4:64,32:9:4:64,32:16:4:64,16:8:4:64 > $OUT/pre/maxima.log 2>&1; grep -v "^{" $OUT/pre/maxima.log | cut -c1-120'
ALL_TESTS="tests/ops/test_deepgemm.py tests/ops/test_maxima_triton.py tests/indexer/test_dense.py" ALL_TESTS_S=170 \
  ALL_WARM_S=200 ALL_GRID_S=190 ALL_V32_S=1 bash benchmarks/h200_step.sh all
