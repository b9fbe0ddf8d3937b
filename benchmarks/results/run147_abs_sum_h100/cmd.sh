mkdir -p $OUT/r
timeout -k 5 170 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_indexer_logits_cuda.py tests/indexer/test_spin.py -k "test_update_overlapped or cuda or without_block_max or wide_ranges or float64" > $OUT/r/tests.log 2>&1; echo "tests exit $?"; tail -3 $OUT/r/tests.log | cut -c1-300
timeout -k 5 170 python3 benchmarks/cuda_logits_probe.py --out $OUT/r/probe --points 96x131072x4,96x131072x3,96x131072x2,32x524288x2 --variants cuda,relu > $OUT/r/probe.log 2>&1; echo "probe exit $?"; grep -E "^point|vs_cuda|failed" $OUT/r/probe.log | head -20 | cut -c1-300; cat $OUT/r/probe/cuda_probe.md 2>/dev/null | tail -30
timeout -k 5 170 python3 benchmarks/bench_mtp_logits.py --out $OUT/r/mtp --budget-s 90 --points 96x131072x4,96x131072x3,32x524288x2,96x131072x2,32x524288x4 > $OUT/r/mtp.log 2>&1; echo "mtp exit $?"; grep -A12 "^## Targets" $OUT/r/mtp/mtp_logits.md | cut -c1-400
tar czf $OUT/r17.tgz -C $OUT r
