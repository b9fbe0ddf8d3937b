# session 72 call 1: #14's e2e points (96 requests only where the card holds them) then the canonical `all`
export SPIN_COMMIT=$(cat .t/commit)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
pts=32x32768,64x32768; case "$gpu" in *H200*) pts=96x32768,32x32768;; esac
OUT=$OUT/e2eout timeout 200 bash benchmarks/h200_step.sh e2e $pts | grep -E "tok/s|spin-0|dense|x32768|Error" | cut -c1-160
ALL_TESTS=tests/ops/test_indexer_logits_triton.py ALL_TESTS_S=60 ALL_GRID_S=200 ALL_V32_S=90 timeout 380 bash benchmarks/h200_step.sh all
(cd $OUT && tar czf e2e.tgz e2eout && rm -rf e2eout)
