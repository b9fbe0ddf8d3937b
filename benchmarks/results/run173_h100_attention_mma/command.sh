# session 72 call 5 (H100): fused-kernel and attention tests on CUDA; e2e at the tree (index_queries split over heads);
# the attention variants at 32 x 32K (QK_MMA among them), then the e2e with the fastest
export SPIN_COMMIT=$(cat .t/commit)
nvidia-smi --query-gpu=name --format=csv,noheader
mkdir -p $OUT/r
TEST_WORKERS=8 timeout 100 bash benchmarks/h200_step.sh tests tests/model/test_decode_triton.py tests/ops/test_topk_attention.py | tail -2
E="--random-weights --indexer-shape 64x128 --steps 24 --configs dense spin-0.4 spin-0.5 --points 32x32768,64x32768"
bash benchmarks/h200_step.sh cmd "
timeout 150 python3 benchmarks/bench_e2e.py $E --out \$OUT/r/e2e > \$OUT/r/e2e.log 2>&1; echo '== tree'; tail -7 \$OUT/r/e2e.log
timeout 220 python3 benchmarks/topk_attention_variants.py --batch 32 --then-e2e $E --out \$OUT/r/e2e_best > \$OUT/r/attn_variants32.log 2>&1
grep -E 'KB=|fastest|splits=|spin-0|dense ' \$OUT/r/attn_variants32.log | cut -c1-120
grep -h 'same tokens' \$OUT/r/e2e.log \$OUT/r/attn_variants32.log | awk '{print \$NF}' | sort | uniq -c
cd \$OUT && tar czf s72d.tgz r && rm -rf r"
