# session 68 call 1 (no DeepGEMM): block grain's window_subtiles + in-topk 32-block sub-tile on a GPU for the first
# time: tests, the e2e + its profile, the grid's one-request points (guard), the update A/B at the e2e's shape
export SPIN_COMMIT=$(cat .t/commit)
bash benchmarks/h200_step.sh cmd '
nvidia-smi --query-gpu=name --format=csv,noheader
timeout 70 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_history_block.py tests/ops/test_history.py tests/indexer/test_spin_cuda.py \
  "tests/indexer/test_spin.py::test_update_overlapped_with_the_topk_equals_the_update_in_series" > $OUT/gputests.log 2>&1
tail -1 $OUT/gputests.log; grep -E "^FAILED|^E  " $OUT/gputests.log | head -10 | cut -c1-250
timeout 110 python3 benchmarks/bench_e2e.py --random-weights --points 96x32768,32x32768 --steps 24 --out /tmp/e2e \
  --configs dense spin-0.4 spin-0.5 spin-0.5-slot > $OUT/e2e.log 2>&1; tail -9 $OUT/e2e.log | cut -c1-200
timeout 45 python3 benchmarks/profile_e2e.py --random-weights --points 96x32768 --configs dense spin-0.4 spin-0.5 --top 16 \
  --out /tmp/prof > $OUT/profile_e2e.txt 2>&1; grep -E "^==|_update_blocks|_select_set|_threshold|_paged_indexer|_topk" $OUT/profile_e2e.txt | cut -c1-110
timeout 170 python3 benchmarks/run_all.py --out /tmp/grid --phases grid --budget-s 150 --sparsities 0.5,0.4,0.3,0.2 \
  --points 1x262144x1,1x65536x1,1x131072x1,1x524288x2,96x131072x2,1x262144x2,8x262144x1 > $OUT/grid.log 2>&1; tail -40 $OUT/grid.log | cut -c1-220
timeout 70 python3 benchmarks/update_overlap.py --rounds 7 --out /tmp/ov --points 96x32768x1,96x131072x1,1x131072x1 \
  --sparsities 0.5 --variants spin,block,blocktopk > $OUT/overlap.log 2>&1; grep -E "^B=|dense / variant|Error|GPU" $OUT/overlap.log
cd /tmp && tar czf $OUT/s68a.tgz e2e grid prof ov 2>/dev/null; ls $OUT'
