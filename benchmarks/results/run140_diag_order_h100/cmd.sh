mkdir -p $OUT/r; R=$OUT/r; nvidia-smi --query-gpu=name --format=csv,noheader > $R/gpu.txt
timeout 90 python3 -m pytest -q -p no:cacheprovider -n 8 tests/predictor/test_plan_triton.py tests/predictor/test_plan_summary_triton.py > $R/gputests.log 2>&1; tail -1 $R/gputests.log
P=96x131072,8x131072,1x131072,96x16384,8x8192
timeout 80 python3 benchmarks/bench_summary.py --points $P --parts 1 --out $R/new.json > $R/new.log 2>&1; tail -6 $R/new.log | cut -c1-200
if grep -q H200 $R/gpu.txt; then timeout 80 python3 benchmarks/update_overlap.py --points 96x524288x1,96x131072x1 --sparsities 0.4,0.5 --variants spin --rounds 11 --out $R/ab > $R/ab.log 2>&1; grep -E "^B=|dense / variant" $R/ab.log; fi
timeout 70 python3 benchmarks/bench_v32_step.py --points 96x131072 --out $R/v32new > $R/v32new.log 2>&1; tail -3 $R/v32new.log | cut -c1-260
cp .t/old/plan_triton.py src/spin_indexer/predictor/
timeout 70 python3 benchmarks/bench_v32_step.py --points 96x131072 --out $R/v32old > $R/v32old.log 2>&1; tail -3 $R/v32old.log | cut -c1-260
timeout 80 python3 benchmarks/bench_summary.py --points $P --parts 1 --out $R/old.json > $R/old.log 2>&1; tail -6 $R/old.log | cut -c1-200
cp $OUT/deepgemm_build.log $R/ 2>/dev/null; tar czf $OUT/r.tgz -C $OUT r && rm -rf $R
