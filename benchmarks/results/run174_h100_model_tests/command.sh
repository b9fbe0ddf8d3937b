# session 72 call (H100): the model / eval / attention tests on CUDA at the shipped defaults (fused decode kernels,
# attention KB = 128 with QK_MMA)
export SPIN_COMMIT=$(cat .t/commit)
nvidia-smi --query-gpu=name --format=csv,noheader
TEST_WORKERS=12 timeout 200 bash benchmarks/h200_step.sh tests tests/model tests/eval tests/ops/test_topk_attention.py | tail -6
