# session 70 call 2: #14's canonical grid + V3.2 at this tree (the wave chunk, block grain's window programs, the
# maxima fix, the in-launch update; run 162 had none of them) with the GPU tests of the changed kernels
export SPIN_COMMIT=$(cat .t/commit)
nvidia-smi --query-gpu=name --format=csv,noheader
ALL_TESTS="tests/ops/test_history_block.py tests/indexer/test_spin_cuda.py tests/ops/test_deepgemm.py tests/ops/test_indexer_logits_triton.py" ALL_TESTS_S=120 \
  ALL_WARM_S=200 ALL_GRID_S=190 ALL_V32_S=100 bash benchmarks/h200_step.sh all
