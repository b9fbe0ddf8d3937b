# session 69 call 3: block grain's window programs (new) against d0aa36b's in-tile loop (.t/old/src), paired in one
# call: tests, the e2e's kernels and tokens/s with the 64 x 128 head; the compact logits' configs at the e2e shapes
export SPIN_COMMIT=$(cat .t/commit)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
big=96; case "$gpu" in *H100*) big=64;; esac   # 96 x 32K with the 64 x 128 head needs ~85 GB of caches
mkdir -p $OUT/r
bash benchmarks/h200_step.sh cmd "
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r src /tmp/old/ && cp .t/oldops/*.py /tmp/old/src/spin_indexer/ops/
R=\$OUT/r; OLD=\${PYTHONPATH/src:/\/tmp\/old\/src:}; echo \$PYTHONPATH; echo \$OLD
timeout 60 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_history_block.py tests/indexer/test_spin_cuda.py \
  'tests/indexer/test_spin.py::test_update_overlapped_with_the_topk_equals_the_update_in_series' > \$R/gputests.log 2>&1
tail -1 \$R/gputests.log; grep -E '^FAILED|^E  ' \$R/gputests.log | head -8 | cut -c1-250
for v in new old; do
  P=\$PYTHONPATH; [ \$v = old ] && P=\$OLD
  PYTHONPATH=\$P timeout 35 python3 benchmarks/profile_e2e.py --random-weights --indexer-shape 64x128 --points ${big}x32768 \
    --configs dense spin-0.4 spin-0.5 --top 12 --out /tmp/p_\$v > \$R/profile_e2e64_\$v.txt 2>&1
  echo \"== \$v\"; grep -E '^==|_update_blocks|_paged_indexer' \$R/profile_e2e64_\$v.txt | cut -c1-100
done
for v in new old; do
  P=\$PYTHONPATH; [ \$v = old ] && P=\$OLD
  PYTHONPATH=\$P timeout 60 python3 benchmarks/bench_e2e.py --random-weights --indexer-shape 64x128 --points ${big}x32768,32x32768 \
    --steps 24 --out \$R/e2e64_\$v --configs dense spin-0.4 spin-0.5 > \$R/e2e64_\$v.log 2>&1; echo \"== \$v\"; tail -7 \$R/e2e64_\$v.log | cut -c1-100
done
for s in 0.5; do
  timeout 45 python3 benchmarks/logits_chunks.py --points ${big}x32768,32x32768 --sparsity \$s --chunks 8,16,32 \
    --configs s3,s3p,s4,s4p > \$R/chunks_\$s.log 2>&1; grep -E '^\\|' \$R/chunks_\$s.log | grep -v -- '---' | cut -c1-100
done
cd \$OUT && tar czf s69c.tgz r && rm -rf r; ls \$OUT"
