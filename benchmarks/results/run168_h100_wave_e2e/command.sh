# session 70 call 4 (less device time left: the e2e only on an H100): #14's canonical grid + V3.2 at this tree (only on an H200: run 167 has the H100's), then the e2e with the DSA
# indexer shape paired new / old (fad7fa5's indexer_logits_triton.py: the block-count chunk) and its profile
export SPIN_COMMIT=$(cat .t/commit)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
big=96; case "$gpu" in *H100*) big=64;; esac
[ $big = 96 ] && ALL_TESTS="tests/ops/test_indexer_logits_triton.py" ALL_TESTS_S=20 \
  ALL_WARM_S=140 ALL_GRID_S=60 ALL_V32_S=1 bash benchmarks/h200_step.sh all | grep -E "passed|failed|^- (B=|every|SPIN own|GPU)|paired|vs_dense|spin-0.5 " | cut -c1-200
[ $big = 64 ] || exit 0
mkdir -p $OUT/r
bash benchmarks/h200_step.sh cmd "
R=\$OUT/r
rm -rf /tmp/old && mkdir -p /tmp/old && cp -r src /tmp/old/ && cp .t/oldops/*.py /tmp/old/src/spin_indexer/ops/
OLD=\${PYTHONPATH/src:/\/tmp\/old\/src:}
for v in new old; do
  P=\$PYTHONPATH; [ \$v = old ] && P=\$OLD
  PYTHONPATH=\$P timeout 50 python3 benchmarks/bench_e2e.py --random-weights --indexer-shape 64x128 --points ${big}x32768 \
    --steps 24 --out \$R/e2e64_\$v --configs dense spin-0.4 spin-0.5 > \$R/e2e64_\$v.log 2>&1; echo \"== \$v\"; tail -7 \$R/e2e64_\$v.log | cut -c1-110
done
timeout 45 python3 benchmarks/profile_e2e.py --random-weights --indexer-shape 64x128 --points ${big}x32768 --configs dense spin-0.4 spin-0.5 \
  --top 30 --out /tmp/prof64 > \$R/profile_e2e64.txt 2>&1; grep -E '^==|bound|_update_blocks|paged' \$R/profile_e2e64.txt | cut -c1-110
cd \$OUT && tar czf s70c.tgz r && rm -rf r; ls \$OUT"
