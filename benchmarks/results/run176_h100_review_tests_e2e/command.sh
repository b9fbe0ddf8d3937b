# session 73 (H100): the review FP8 store steps on CUDA, the e2e at HEAD
export SPIN_COMMIT=$(cat .t/commit)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
pts=32x32768,64x32768; case "$gpu" in *H200*) pts=96x32768,32x32768;; esac
TEST_WORKERS=8 OUT=$OUT/t timeout 70 bash benchmarks/h200_step.sh tests tests/model/test_decode_triton.py tests/ops/test_kv_cache_triton.py tests/ops/test_summary_cache.py tests/ops/test_topk_attention.py | tail -3
OUT=$OUT/e2eout timeout 130 bash benchmarks/h200_step.sh e2e $pts | grep -E "tok/s|spin-0|dense|x32768|Error" | cut -c1-160
(cd $OUT && tar czf e2e.tgz e2eout t && rm -rf e2eout t)
