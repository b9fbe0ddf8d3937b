# session 70 call 1 (needs the H200's memory: 96 x 32K with the 64 x 128 head needs ~85 GB of caches): the compact
# logits' wave chunk (89353fc) against the block-count rule: ptxas / places with the device's triton, the launch by
# chunk, then the e2e with the DSA indexer shape paired new / old (fad7fa5's indexer_logits_triton.py), its profile
export SPIN_COMMIT=$(cat .t/commit)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
big=96; case "$gpu" in *H100*) big=64;; esac
mkdir -p $OUT/r
bash benchmarks/h200_step.sh cmd "
R=\$OUT/r
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r src /tmp/old/ && cp .t/oldops/*.py /tmp/old/src/spin_indexer/ops/
OLD=\${PYTHONPATH/src:/\/tmp\/old\/src:}
timeout 60 python3 benchmarks/logits_registers.py --next-n 1 > \$R/registers.log 2>&1; grep -E 'g1w4s3 |g1w4s3p ' \$R/registers.log | cut -c1-60
timeout 45 python3 -m pytest -q -p no:cacheprovider tests/ops/test_indexer_logits_triton.py -k 'active_width or compacted or wave' > \$R/gputests.log 2>&1; tail -1 \$R/gputests.log
for s in 0.5 0.2; do
  pts=64x32768,32x32768,8x131072,96x32768,1x1048576,8x1048576,1x524288,8x65536; [ \$s = 0.2 ] && pts=8x131072,32x32768,1x1048576,96x32768
  timeout 90 python3 benchmarks/logits_chunks.py --points \$pts --sparsity \$s --chunks 8,16,32 --configs s3p,s3 > \$R/chunks_\$s.log 2>&1
  grep -E '^\\|' \$R/chunks_\$s.log | grep -v -- '---' | grep -E 'production|deepgemm' | cut -c1-110
done
for v in new old; do
  P=\$PYTHONPATH; [ \$v = old ] && P=\$OLD
  PYTHONPATH=\$P timeout 100 python3 benchmarks/bench_e2e.py --random-weights --indexer-shape 64x128 --points ${big}x32768,32x32768 \
    --steps 24 --out \$R/e2e64_\$v --configs dense spin-0.4 spin-0.5 > \$R/e2e64_\$v.log 2>&1; echo \"== \$v\"; tail -7 \$R/e2e64_\$v.log | cut -c1-110
done
timeout 60 python3 benchmarks/profile_e2e.py --random-weights --indexer-shape 64x128 --points ${big}x32768 --configs dense spin-0.4 spin-0.5 \
  --top 30 --out /tmp/prof64 > \$R/profile_e2e64.txt 2>&1; grep -E '^==|bound|_update_blocks|paged' \$R/profile_e2e64.txt | cut -c1-110
cd \$OUT && tar czf s70a.tgz r && rm -rf r; ls \$OUT"
