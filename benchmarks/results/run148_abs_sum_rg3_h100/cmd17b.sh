mkdir -p $OUT/r
timeout -k 5 150 python3 .t/err_probe.py > $OUT/r/err.log 2>&1; echo "err exit $?"; cat $OUT/r/err.log | grep -v Warn | tail -10
timeout -k 5 200 python3 benchmarks/cuda_logits_probe.py --out $OUT/r/probe --points 96x131072x3,96x131072x4 --variants cuda,relu,rg > $OUT/r/probe.log 2>&1; echo "probe exit $?"; grep -E "^point|failed" $OUT/r/probe.log | head -20 | cut -c1-400
tar czf $OUT/r17b.tgz -C $OUT r
