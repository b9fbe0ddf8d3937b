# session 72 call 3: the fused proxy decode kernels: GPU tests (bf16 too), then the e2e paired with 33740ce (torch forms)
export SPIN_COMMIT=$(cat .t/commit)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
pts=32x32768,64x32768; case "$gpu" in *H200*) pts=96x32768,32x32768;; esac
mkdir -p $OUT/r
TEST_WORKERS=8 timeout 120 bash benchmarks/h200_step.sh tests tests/model/test_decode_triton.py tests/model/test_rope_triton.py \
  tests/model/test_decode.py tests/ops/test_kv_cache_triton.py | tail -3
E="--random-weights --indexer-shape 64x128 --steps 24 --configs dense spin-0.4 spin-0.5 --points $pts"
bash benchmarks/h200_step.sh cmd "
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r src /tmp/old/ && rm /tmp/old/src/spin_indexer/model/decode_triton.py && cp .t/oldmodel/*.py /tmp/old/src/spin_indexer/model/
OLD=\${PYTHONPATH/src:/\/tmp\/old\/src:}
timeout 170 python3 benchmarks/bench_e2e.py $E --out \$OUT/r/e2e_new > \$OUT/r/e2e_new.log 2>&1; echo '== new'; tail -7 \$OUT/r/e2e_new.log
PYTHONPATH=\$OLD timeout 170 python3 benchmarks/bench_e2e.py $E --out \$OUT/r/e2e_old > \$OUT/r/e2e_old.log 2>&1; echo '== old (33740ce)'; tail -7 \$OUT/r/e2e_old.log
grep -h 'same tokens' \$OUT/r/e2e_new.log \$OUT/r/e2e_old.log | awk '{print \$NF}' | sort | uniq -c
timeout 90 python3 benchmarks/profile_e2e.py --random-weights --indexer-shape 64x128 --points 32x32768 --configs dense spin-0.5 --top 40 --out \$OUT/r/p > \$OUT/r/profile32.log 2>&1; grep -E '^==|indexer logits' \$OUT/r/profile32.log
cd \$OUT && tar czf s72b.tgz r && rm -rf r"
