# session 64 call 2: the CUDA update pass's tests, its A/B in SPIN's step (update_overlap: spin = Triton pass, cudapass,
# the CUDA pass) paired with the dense step
cd "$(dirname "$0")/.."
nvidia-smi --query-gpu=name --format=csv,noheader
SPIN_INDEXER_UPDATE=cuda timeout 110 python3 -m pytest -q -p no:cacheprovider -n 8 tests/ops/test_history_cuda.py tests/indexer/test_spin_cuda.py \
    tests/predictor/test_step_guard.py > $OUT/gputests.log 2>&1
tail -2 $OUT/gputests.log; grep -E "^FAILED|^E  " $OUT/gputests.log | head -20 | cut -c1-300
ov() { timeout $1 python3 benchmarks/update_overlap.py --rounds 11 --out $OUT/$2 --points $3 --sparsities $4 --variants $5 \
    > $OUT/$2.log 2>&1; grep -E "^B=|dense / variant|Error" $OUT/$2.log | cut -c1-500; }
ov 120 ov512 96x524288x1 0.4 spin,cudapass
cd $OUT && tar czf s64a.tgz *.log ov* 2>/dev/null; rm -rf ov512 ov128n2; ls
