# session 71 call 3: the proxy's sparse attention by chunk / warps / stages at 64 x 32K then the e2e with the fastest
# variant; the e2e at the shipped KB = 64 with this tree's quantization (one Triton launch) and with cb7a19a's
# (the torch references), paired in one call
export SPIN_COMMIT=$(cat .t/commit)
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/r
TEST_WORKERS=4 timeout 50 bash benchmarks/h200_step.sh tests tests/ops/test_kv_cache_triton.py tests/ops/test_kv_cache.py \
  tests/ops/test_summary_cache.py | tail -2
E="--random-weights --indexer-shape 64x128 --steps 24 --configs dense spin-0.4 spin-0.5 --points 64x32768"
bash benchmarks/h200_step.sh cmd "
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r src /tmp/old/ && cp .t/oldops/*.py /tmp/old/src/spin_indexer/ops/
OLD=\${PYTHONPATH/src:/\/tmp\/old\/src:}
timeout 45 python3 benchmarks/bench_e2e.py $E --out \$OUT/r/e2e64 > \$OUT/r/e2e64.log 2>&1; echo '== new'; tail -4 \$OUT/r/e2e64.log
PYTHONPATH=\$OLD timeout 45 python3 benchmarks/bench_e2e.py $E --out \$OUT/r/e2e64old > \$OUT/r/e2e64old.log 2>&1; echo '== old quantize'; tail -4 \$OUT/r/e2e64old.log
timeout 80 python3 benchmarks/topk_attention_variants.py --batch 64 --then-e2e $E --out \$OUT/r/e2e64best \
  > \$OUT/r/attn_variants64.log 2>&1; grep -E 'KB=|fastest|splits=|spin-0|dense ' \$OUT/r/attn_variants64.log | cut -c1-120
cd \$OUT && tar czf s71c.tgz r && rm -rf r"
