export SPIN_COMMIT=e4e08dd ALL_TESTS_S=170 ALL_GRID_S=250 ALL_V32_S=115
export ALL_TESTS="tests/ops/test_indexer_logits_cuda.py tests/ops/test_history.py tests/ops/test_indexer_logits_triton.py tests/ops/test_topk_triton.py tests/ops/test_topk_positions.py tests/ops/test_deepgemm.py tests/ops/test_deepgemm_schedule.py tests/predictor/test_plan_triton.py tests/predictor/test_step_guard.py tests/indexer/test_spin.py tests/ops/test_topk_attention.py tests/model/test_rope_triton.py tests/ops/test_summary_cache.py tests/predictor/test_plan_summary_triton.py tests/indexer/test_spin_cuda.py"
bash benchmarks/h200_step.sh all
tar xzf $OUT/h200_all.tgz -O all/gputests.log | grep -E "passed|failed|^FAILED" | head -20 | cut -c1-300
