# session 69 call 2: the e2e with the DSA models' indexer shape (a random 64 x 128 head, 132 B a cached token) beside
# the shipped 4 x 64 head, its kernel profile, then the step's kernels at 96 x 128K n = 2 s = 0.2 (the own-work miss)
export SPIN_COMMIT=$(cat .t/commit)
gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader); echo "$gpu"
big=96; case "$gpu" in *H100*) big=64;; esac   # 96 x 32K with the 64 x 128 head needs ~85 GB of caches
bash benchmarks/h200_step.sh cmd "
timeout 170 python3 benchmarks/bench_e2e.py --random-weights --indexer-shape 64x128 --points ${big}x32768,32x32768 --steps 24 \
  --out \$OUT/e2e64 --configs dense spin-0.4 spin-0.5 > \$OUT/e2e64.log 2>&1; tail -8 \$OUT/e2e64.log | cut -c1-200
timeout 60 python3 benchmarks/profile_e2e.py --random-weights --indexer-shape 64x128 --points ${big}x32768 --configs dense spin-0.4 spin-0.5 \
  --top 16 --out /tmp/prof64 > \$OUT/profile_e2e64.txt 2>&1; grep -E '^==|_update_blocks|_select_set|_threshold|paged|logits|_topk' \$OUT/profile_e2e64.txt | cut -c1-110
timeout 110 python3 benchmarks/bench_e2e.py --random-weights --points 96x32768,32x32768 --steps 24 --out \$OUT/e2e \
  --configs dense spin-0.4 spin-0.5 > \$OUT/e2e.log 2>&1; tail -8 \$OUT/e2e.log | cut -c1-200
timeout 80 python3 benchmarks/profile_step.py --points 96x131072x2 --sparsity 0.2 --parts kernels --out \$OUT/prof > \$OUT/profile.log 2>&1; head -60 \$OUT/profile.log | cut -c1-130
ls -R \$OUT | head -40"
