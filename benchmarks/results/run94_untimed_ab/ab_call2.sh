set -u; mkdir -p $OUT/ab; export PYTHONUNBUFFERED=1
for c in 53281ee d1b9dd1 HEAD; do rm -rf .t/$c; mkdir -p .t/$c; cp -r src .t/$c/src; [ -d .t/ov/$c ] && cp -r .t/ov/$c/src/. .t/$c/src/; done
for rep in 1 2; do for c in 53281ee d1b9dd1 HEAD; do
  echo "=== $c rep $rep"; PYTHONPATH=.t/$c/src:benchmarks python3 benchmarks/update_overlap.py --out $OUT/ab/$c.$rep --points 96x524288x1,96x131072x1,96x1048576x1 --sparsities 0.4 --rounds 21 --variants spin,no_update > $OUT/ab/$c.$rep.log 2>&1
  grep -E "^B=|dense / variant" $OUT/ab/$c.$rep/update_overlap.txt; grep -E "_update_pass_kernel|_update_history_kernel|_gather_kernel" $OUT/ab/$c.$rep/update_overlap.txt | tail -6
done; done
tar czf $OUT/ab.tgz -C $OUT ab && rm -rf $OUT/ab
