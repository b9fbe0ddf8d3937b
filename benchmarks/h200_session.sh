#!/usr/bin/env bash
# The H200 runs of the model-level results, one stage per device call on one warm machine.
#
# The GPU box has no registry, lacks `gguf` and the RULER generators, and takes at most 64 MiB per call
# (the working tree counts), so the 94 MiB SmolLM2 GGUF travels in three parts over the first three calls
# (each copied to /tmp, which lives as long as the warm machine) and the RULER prompts come pre-generated
# (SPIN_INDEXER_PROMPT_CACHE, made here with `ruler.cache_prompts`). Prepare on the CPU machine:
#   G=$(python -c "from spin_indexer.model import loader; print(loader.find_gguf())")
#   mkdir -p runs/x3/p0 runs/x3/p1 runs/x3/p2 && split -n 3 -d "$G" runs/x3/gguf_part_
#   mv runs/x3/gguf_part_00 runs/x3/p0/; mv runs/x3/gguf_part_01 runs/x3/p1/; mv runs/x3/gguf_part_02 runs/x3/p2/
#   pip download --no-deps gguf==0.19.0 -d runs/x3/p2
#   SPIN_INDEXER_PROMPT_CACHE=runs/prompts python -c "...ruler.cache_prompts(tasks, contexts, seeds, tok)"
# Then, as device calls (carry in brackets), back to back so the machine stays warm:
#   1. [runs/x3/p0, runs/prompts]  benchmarks/h200_session.sh v32        V3.2-shape step (no model needed)
#   2. [runs/x3/p1]                benchmarks/h200_session.sh gputests   CUDA test suite
#   3. [runs/x3/p2]                benchmarks/h200_session.sh traces     traces 8K-32K (+ MTP 8K), kept in /tmp
#   4. []                          benchmarks/h200_session.sh replay     GPU replay of /tmp/traces -> fidelity tgz
#   5. []                          benchmarks/h200_session.sh e2e        tokens/s and ITL
#   6. []                          benchmarks/h200_session.sh quality    RULER 8K-32K (QUALITY_SECONDS each)
# The long-context head (second session, 2026-11-29 16:36-17:02 UTC; 27 of the 30 device minutes):
#   1. [runs/x3/p0, runs/prompts] gputests    2. [runs/x3/p1, runs/prompts2] parts (prompts2: seeds 4-9)
#   3. [runs/x3/p2, runs/distill16k] distill16k  -> /tmp/head16k.safetensors (329 s)
#   4. [] QUALITY_WEIGHTS=/tmp/head16k.safetensors QUALITY_SECONDS=530 QUALITY_PROCS=3 QUALITY_SAMPLES=2 ... quality
#   5. [] the same with QUALITY_SECONDS=520 QUALITY_PROCS=4 QUALITY_SAMPLES=1 QUALITY_SEED0=6 (74 prompts in all)
# Measured 2026-11-29: v32 52 s, gputests 34 s, traces ~420 s, replay ~220 s, e2e 86 s, distill16k 329 s,
# quality as allowed (9-12 processes: ~4 prompts x 12 configs each in 530 s, B = 1 decoding).
# Every stage writes under $OUT (what comes back) and tolerates a missing earlier stage where it can.
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export SPIN_INDEXER_GGUF=/tmp/smol.gguf SPIN_INDEXER_PROMPT_CACHE=/tmp/prompts
export PYTHONPATH=/tmp/site:src:benchmarks
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53

take_part() {  # copy carried GGUF parts and prompts to /tmp (kept while the machine is warm)
    for f in runs/x3/p*/gguf_part_*; do [ -f "$f" ] && cp "$f" /tmp/; done
    mkdir -p /tmp/prompts
    for d in runs/prompts*/; do [ -d "$d" ] && cp "$d"*.json /tmp/prompts/; done
    ls -l /tmp/gguf_part_* 2>/dev/null; echo "prompts: $(ls /tmp/prompts 2>/dev/null | wc -l)"
}

assemble() {  # the GGUF from its parts (checked) and the gguf wheel
    if [ ! -f /tmp/smol.gguf ]; then
        cat /tmp/gguf_part_00 /tmp/gguf_part_01 /tmp/gguf_part_02 > /tmp/smol.gguf || return 1
    fi
    echo "$GGUF_SHA  /tmp/smol.gguf" | sha256sum -c - || { rm -f /tmp/smol.gguf; return 1; }
    if [ ! -d /tmp/site/gguf ]; then
        python3 -m pip install -q --no-index --no-deps --target /tmp/site runs/x3/p2/gguf-*.whl || return 1
    fi
}

stage=${1:?usage: h200_session.sh parts|v32|gputests|traces|replay|distill16k|e2e|quality}
take_part
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
case $stage in
parts)  # only the copy above: a call that carries one more GGUF part or prompt folder
    ;;
v32)
    timeout 420 python3 benchmarks/bench_v32_step.py --out "$OUT/v32" 2>&1 | tee "$OUT/v32.log"
    ;;
gputests)
    timeout 300 python3 -m pytest -q -x -p no:cacheprovider tests/indexer/test_spin_cuda.py tests/ops \
        tests/predictor/test_predictor_triton.py 2>&1 | tail -25 | tee "$OUT/gputests.log"
    ;;
traces)
    assemble || exit 1
    T=/tmp/traces
    for ctx in 8192 16384 32768; do
        timeout 200 python3 -m spin_indexer.cli.capture --task niah_single_2 --context $ctx --steps 64 --k 256 \
            --indexer lightning,oracle --prompts 3 --device cuda --quiet --out $T/$ctx 2>&1 | tail -9
    done
    timeout 120 python3 -m spin_indexer.cli.capture --task niah_single_2 --context 8192 --steps 48 --k 256 \
        --indexer lightning --prompts 3 --next-n 3 --draft-noise 0.2 --device cuda --quiet --out $T/mtp8192 2>&1 | tail -5
    du -sh $T/* | tee "$OUT/trace_sizes.txt"
    ;;
replay)
    T=/tmp/traces
    E="python3 -m spin_indexer.cli.eval --device cuda --name ruler-smollm2 --quiet"
    for ctx in 8192 16384 32768; do
        [ -d $T/$ctx ] || continue
        timeout 150 $E --traces $T/$ctx --sweep main --out /tmp/fid/$ctx/main 2>&1 | tail -3
        timeout 100 $E --traces $T/$ctx --sweep exploration --policy explore-none explore-staleness \
            explore-block-age --no-table1 --out /tmp/fid/$ctx/exploration 2>&1 | tail -2
        timeout 100 $E --traces $T/$ctx --sweep pooling --policy a0 a1-mean a1-top4 a2-max-sum --no-table1 \
            --no-plots --out /tmp/fid/$ctx/pooling 2>&1 | tail -2
        tar czf "$OUT/fidelity_real.tgz" -C /tmp fid  # after every bin: a timeout keeps what finished
    done
    [ -d $T/mtp8192 ] && timeout 100 $E --traces $T/mtp8192 --sweep mtp --no-table1 --out /tmp/fid/mtp8192/mtp \
        2>&1 | tail -3
    tar czf "$OUT/fidelity_real.tgz" -C /tmp fid && ls -l "$OUT"
    ;;
distill16k)
    # fine-tune a head on 16K windows with plain RoPE (the same rotation at every length). The 2026-11-29 run
    # started from the 4K head then shipped (git show 4bcf7af:src/spin_indexer/weights/smollm2_indexer.safetensors
    # > runs/head4k.safetensors; carry it and set DISTILL_INIT to reproduce); its result is the head shipped now.
    # Corpus: spin-indexer distill --data runs/distill16k/corpus.pt --corpus-only --seq-len 16384 (CPU, 30 s).
    # Evaluated by the quality stage and on the CPU (distill --eval-only), not here.
    assemble || exit 1
    timeout 580 python3 -m spin_indexer.cli.distill --data runs/distill16k/corpus.pt --seq-len 16384 --batch 1 \
        --target max --init ${DISTILL_INIT:-src/spin_indexer/weights/smollm2_indexer.safetensors} --indexer-rope plain \
        --lr ${DISTILL_LR:-1e-3} --minutes ${DISTILL_MINUTES:-5} --no-eval --device cuda --out "$OUT/distill16k" \
        2>&1 | grep -v clean_up | tee "$OUT/distill16k.log"
    cp "$OUT/distill16k/smollm2_indexer.safetensors" /tmp/head16k.safetensors && ls -l /tmp/head16k.safetensors
    ;;
e2e)
    assemble || exit 1
    timeout 560 python3 benchmarks/bench_e2e.py --points 32x16384,96x16384,32x32768,96x32768 --steps 32 \
        --out "$OUT/e2e" 2>&1 | grep -v clean_up | tee "$OUT/e2e.log"
    ;;
quality)
    assemble || exit 1
    Q="python3 -m spin_indexer.cli.main quality --device cuda --topk 512 --quiet"
    [ -n "${QUALITY_WEIGHTS:-}" ] && Q="$Q --indexer-weights $QUALITY_WEIGHTS"
    CONFIGS=${QUALITY_CONFIGS:-"dense all-keep spin-0.2 spin-0.3 spin-0.4 spin-0.5 spin-0.2-noexp spin-0.3-noexp \
spin-0.4-noexp spin-0.5-noexp mtp3-all-keep mtp3-spin-0.4"}
    # QUALITY_PROCS processes per context length, each QUALITY_SAMPLES seeds from QUALITY_SEED0 on: B = 1
    # decoding is launch-bound, so several processes share the GPU well (16 CPU cores)
    S=${QUALITY_SAMPLES:-2}
    for ctx in ${QUALITY_CONTEXTS:-8192 16384 32768}; do
        for j in $(seq 0 $((${QUALITY_PROCS:-3} - 1))); do
            seed=$((${QUALITY_SEED0:-0} + j * S))
            timeout ${QUALITY_SECONDS:-480} $Q --contexts $ctx --samples $S --first-seed $seed --configs $CONFIGS \
                --shard h200-$ctx-s$seed --out /tmp/quality/$ctx-s$seed > /tmp/quality_$ctx-s$seed.log 2>&1 &
        done
    done
    wait
    tail -n 3 /tmp/quality_*.log
    wc -l /tmp/quality/*/samples-*.jsonl
    tar czf "$OUT/quality.tgz" -C /tmp quality $(cd /tmp && ls quality_*.log)
    ;;
*)
    echo "unknown stage $stage"; exit 2
    ;;
esac
