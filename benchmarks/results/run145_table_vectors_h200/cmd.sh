mkdir -p $OUT/r; R=$OUT/r; nvidia-smi --query-gpu=name,clocks.max.sm,power.limit --format=csv,noheader > $R/gpu.txt; cat $R/gpu.txt
timeout 100 python3 -m pytest -q -p no:cacheprovider -n 8 tests/predictor/test_plan_triton.py tests/predictor/test_window_diag_max.py > $R/gputests.log 2>&1; tail -1 $R/gputests.log
timeout 120 python3 benchmarks/select_ab.py --variant .t/plan_old.py --layers 61 --points 96x524288,96x131072,8x131072 --rounds 9 --calls 2 --out $R/ab61.json > $R/ab61.log 2>&1; tail -4 $R/ab61.log
timeout 60 python3 benchmarks/bench_v32_step.py --points 96x131072 --out $R/v32 > $R/v32.log 2>&1; tail -2 $R/v32.log | cut -c1-200
if grep -q H200 $R/gpu.txt; then timeout 90 python3 benchmarks/update_overlap.py --points 96x524288x1 --sparsities 0.4 --variants spin --rounds 11 --out $R/ab > $R/ab.log 2>&1; grep -E "^B=|dense / variant" $R/ab.log; fi
tar czf $OUT/r.tgz -C $OUT r && rm -rf $R
