mkdir -p $OUT/r
nvidia-smi --query-gpu=name --format=csv,noheader > $OUT/r/gpu.txt
timeout -k 5 120 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_indexer_logits_cuda.py tests/indexer/test_spin.py -k "test_update_overlapped or cuda or without_block_max or float64" > $OUT/r/tests.log 2>&1; echo "tests exit $?"; tail -2 $OUT/r/tests.log | cut -c1-300; grep -E "^FAILED|logits off" $OUT/r/tests.log | head
timeout -k 5 200 python3 benchmarks/bench_mtp_logits.py --out $OUT/r/mtp --budget-s 110 --points 96x131072x4,32x524288x4,96x131072x3,48x393216x4,96x131072x2,32x524288x2 > $OUT/r/mtp.log 2>&1; echo "mtp exit $?"; grep -A16 "^## Targets" $OUT/r/mtp/mtp_logits.md | cut -c1-330
tar czf $OUT/r17e.tgz -C $OUT r
