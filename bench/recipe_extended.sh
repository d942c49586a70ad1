#!/usr/bin/env bash
# The extended draft recipe of BENCHMARKS.md ("More traces for the deep draft"), in one command:
#
#   bash bench/recipe_extended.sh [RUN_DIR]        # default runs/extended; needs ../shared (manifest + MT-bench)
#
# F (configs/train.default.json on the traces of 512 prompts), then the same draft trained on in stages as the
# traces grow: F2 = F + 200 steps on 1,536 traces (lr 3e-4), F3 = F2 + 150 steps on 3,072 traces, then F3 packed
# with GPTQ calibrated on those traces (packF3g, what ships); each scored on all MT-bench points. About 3 hours on
# 2 cores. Finished training, pack and eval steps are skipped and the traces/validation stages resume, so the
# script can be rerun after an interruption (a killed training step restarts from its last checkpoint).
# QAT_STEPS=40 also runs the earlier shipped form, G3 = F3 + 40 QAT steps (configs/train.qat.json), plain-packed.
set -euo pipefail

RUN=${1:-runs/extended}
SPECDRAFT=${SPECDRAFT:-.venv/bin/specdraft}
MT_BENCH=${MT_BENCH:-../shared/data/dev/mt_bench.jsonl}
# Sizes, overridable only to smoke-test the chain in minutes (the recipe is the defaults):
read -r N1 N2 N3 <<< "${TRACES:-512 1536 3072}"            # prompts traced for F, F2, F3
read -r STEPS_F STEPS_F2 STEPS_F3 <<< "${STEPS:-200 200 150}"
HELDOUT_PROMPTS=${HELDOUT_PROMPTS:-24}                        # MT-bench prompts for checkpoint selection
EVAL_ARGS=${EVAL_ARGS:-}                                      # e.g. "--limit 32"
# The measured run used one thread per job (2 jobs side by side); other thread counts change float rounding, so
# greedy ties and the numbers can differ slightly.
export OMP_WAIT_POLICY=PASSIVE OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

done_file() { [ -f "$1" ]; }
traces_upto() {  # traces of the first $1 prompts in their own file (each training stage records its own sha256);
    # always run: the stage resumes (a finished file: "0 to decode")
    local n=$1 prev=$2 out="$RUN/traces$1/traces.jsonl"
    mkdir -p "$RUN/traces$n"
    if [ -n "$prev" ] && [ ! -f "$out" ]; then
        cp "$prev" "$out"  # the smaller set's rows are this one's first rows: decode only the new prompts
    fi
    "$SPECDRAFT" traces --prompts "$RUN/prompts/prompts.jsonl" --out "$out" --limit "$n" --batch-size 64 \
        --max-new-tokens 128
}
train() {  # train OUT INIT TRACES CONFIG extra-args...
    local out=$1 init=$2 traces=$3 config=$4
    shift 4
    done_file "$RUN/$out/train_meta.json" && return 0
    "$SPECDRAFT" train --traces "$traces" --init "$init" --out "$RUN/$out" --config "$config" \
        --heldout-traces "$RUN/val24/traces.jsonl" --heldout-fraction 0 --heldout-max "$HELDOUT_PROMPTS" "$@"
}
score() {  # score MODEL_DIR NAME compute extra-args...
    local model=$1 name=$2 compute=$3
    shift 3
    done_file "$RUN/eval_$name/report.json" && return 0
    "$SPECDRAFT" eval --validation "$RUN/val80/validation.jsonl" --model-dir "$model" --compute "$compute" \
        --out "$RUN/eval_$name" $EVAL_ARGS "$@"
}

done_file "$RUN/prompts/prompts.jsonl" || "$SPECDRAFT" prompts --manifest configs/manifest.shared.json \
    --out "$RUN/prompts/prompts.jsonl" --eval-set "$MT_BENCH"
"$SPECDRAFT" validation --prompts "$MT_BENCH" --out "$RUN/val80/validation.jsonl" --max-new-tokens 192 \
    ${VAL_PROMPTS:+--limit "$VAL_PROMPTS"}
"$SPECDRAFT" traces --prompts "$MT_BENCH" --out "$RUN/val24/traces.jsonl" --limit "$HELDOUT_PROMPTS" \
    --max-new-tokens 192

traces_upto "$N1" ""
train runF truncate:embedded:smollm2-135m-instruct:0,1,2,3,4,5,6,7,8,9,10,11,12,13,14,15,22,23,24,25,26,27,28,29 \
    "$RUN/traces$N1/traces.jsonl" configs/train.default.json --eval-every 50 --max-steps "$STEPS_F" --epochs 100
traces_upto "$N2" "$RUN/traces$N1/traces.jsonl"
train runF2 "$RUN/runF" "$RUN/traces$N2/traces.jsonl" configs/train.default.json \
    --lr 3e-4 --eval-every 50 --max-steps "$STEPS_F2" --epochs 100
traces_upto "$N3" "$RUN/traces$N2/traces.jsonl"
train runF3 "$RUN/runF2" "$RUN/traces$N3/traces.jsonl" configs/train.default.json \
    --lr 3e-4 --eval-every 50 --max-steps "$STEPS_F3" --epochs 100
done_file "$RUN/packF3g/draft.qd4" || "$SPECDRAFT" pack --checkpoint "$RUN/runF3" --out "$RUN/packF3g" \
    --fit gptq --calibration "$RUN/traces$N3/traces.jsonl"

score "$RUN/runF3" runF3_f32 float32
score "$RUN/packF3g" packF3g_int4 int4
score "$RUN/packF3g" packF3g_hybrid int4 --hybrid-min-ngram 2
if [ -n "${QAT_STEPS:-}" ]; then
    train runG3 "$RUN/runF3" "$RUN/traces$N3/traces.jsonl" configs/train.qat.json --max-steps "$QAT_STEPS"
    done_file "$RUN/packG3/draft.qd4" || "$SPECDRAFT" pack --checkpoint "$RUN/runG3" --out "$RUN/packG3"
    score "$RUN/packG3" packG3_int4 int4
fi
done_file "$RUN/eval_lookup/report.json" || "$SPECDRAFT" eval --validation "$RUN/val80/validation.jsonl" --lookup \
    --out "$RUN/eval_lookup" $EVAL_ARGS
grep -h "pooled" "$RUN"/eval_*/eval.log | tail -n 5
