mkdir -p $OUT/r
timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_indexer_logits_cuda.py tests/indexer/test_spin.py -k "test_update_overlapped or cuda or without_block_max or float64" --deselect "tests/ops/test_indexer_logits_cuda.py::test_matches_float64_over_wide_ranges" > $OUT/r/tests.log 2>&1; echo "tests exit $?"; tail -2 $OUT/r/tests.log | cut -c1-300
timeout -k 5 120 python3 benchmarks/cuda_logits_probe.py --out $OUT/r/probe3 --points 96x131072x3 --variants cuda,relu > $OUT/r/probe3.log 2>&1; grep -E "^point" $OUT/r/probe3.log | cut -c1-400
timeout -k 5 170 python3 benchmarks/bench_mtp_logits.py --out $OUT/r/mtp --budget-s 90 --points 96x131072x4,96x131072x3,32x524288x4,96x131072x2,32x524288x2 > $OUT/r/mtp.log 2>&1; echo "mtp exit $?"; grep -A12 "^## Targets" $OUT/r/mtp/mtp_logits.md | cut -c1-300
tar czf $OUT/r17c.tgz -C $OUT r
