#!/usr/bin/env bash
# The runs behind the 4k testbed's table of record (results/quality_4k_record.csv), on one GPU, in two phases of under
# ten minutes each (the checkpoints stay in WORK between them; the second phase must run on the same machine):
#
#   PHASE=train     side by side, RS seconds each, window 64, all distilled with a rank-8 LoRA merged afterwards,
#                   learning rates decaying to 0 over the seconds:
#                   * KVpop (delayed mLSTM with the token term, max answer-query target) at 88%: seeds 0 and 1 with
#                     batches of 4 sequences (the recipe of checkpoints/testbed-4k-kvpop-cr88) and seeds 0 and 1 with 8;
#                   * StreamingLLM+ and DMS at 88% (testbed_4k_baselines.sh, same window, seconds and batch of 4);
#                   * meanwhile the 4k teacher continued TB seconds on a mix with variable tracking (vt 0.3, reasoning
#                     0.5, lookup drill 0.15) for the out-of-domain table, dense EM on vt and reasoning at 4096 tokens.
#                   -> WORK/kv/ckpt_tok{,_s1,_bs8,_bs8_s1}/, WORK/bl/ckpt/, WORK/vt/teacher/; logs and the
#                      checkpoints as tar files in OUT (the machine may not be kept until PHASE=evaluate)
#   PHASE=evaluate  on EVAL_N fresh problems (seeds FRESH + i, never used to pick a checkpoint or a setting):
#                   * each KVpop checkpoint at 75 / 88 / 94% (its 88% checkpoint at every budget) with StreamingLLM,
#                     the oracle top-k recall against the max answer-query oracle on 8 problems;
#                   * StreamingLLM+ at 88 and 94% (its 88% checkpoint), DMS at 88% with its achieved compression;
#                   * out of domain: KVpop retrofitted on the vt teacher with reasoning problems only (seeds 0 and 1,
#                     OOD_RS seconds), evaluated on vt and reasoning at 75 / 88 / 94% beside StreamingLLM, K-Norm,
#                     KeyDiff, LagKV and SnapKV.
#                   -> OUT/eval_*/ (kvpop-eval folders), OUT/ood/, as tar files of results.
#
# Usage: OUT=dir PHASE=train bash benchmarks/gpu/testbed_4k_record.sh       (~9.5 min)
#        OUT=dir PHASE=evaluate bash benchmarks/gpu/testbed_4k_record.sh    (~9.5 min, right after, same machine)
# Knobs: WORK (/tmp/kvpop_record), RS (training seconds, 400), TB (teacher seconds, 380), OOD_RS (300), EVAL_N (80),
# FRESH (2^48 + 5000), DEADLINE (seconds, 585), COMPRESSION (the compression ratios of the evaluations,
# 0.75,0.88,0.94), SP_COMPRESSION (StreamingLLM+'s, 0.88,0.94). A CPU smoke test: DEVICE=cpu LEN=768 LO=512 RS=5 TB=10 OOD_RS=5 EVAL_N=2 NEX=8
# COMPRESSION=0.88 SP_COMPRESSION=0.88 DEADLINE=1500 TRAIN_SLACK=900 (at 768 tokens a 64-token window leaves no slot at 94%).
set -u
: "${OUT:?set OUT to an output directory}"
PHASE=${PHASE:?set PHASE to train or evaluate}
HERE=$(cd "$(dirname "$0")" && pwd)
WORK=${WORK:-/tmp/kvpop_record}; RS=${RS:-400}; TB=${TB:-380}; OOD_RS=${OOD_RS:-300}; N=${EVAL_N:-80}
FRESH=${FRESH:-$((2 ** 48 + 5000))}; DL=${DEADLINE:-585}; T=checkpoints/testbed-4k-teacher
COMPRESSION=${COMPRESSION:-0.75,0.88,0.94}; export EVAL_COMPRESSION=$COMPRESSION
export KNOB_ARGS="--knob reasoning.n_facts=10 --knob reasoning.steps=4"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p "$OUT" "$WORK"

pack() {  # name dir...: a tar of the given folders in OUT (one file each: OUT returns at most 8 files)
  local name=$1; shift
  tar -cf "$OUT/$name.tar" "$@" 2>/dev/null && stamp "packed $name.tar ($(du -h "$OUT/$name.tar" | cut -f1))"
}

train() {
  OUT=$WORK/vt STAGE=teacher INIT=$T TB=$TB CURRICULUM=0 LRS="A:5e-4" REASONING_WEIGHT=0.5 LOOKUP_WEIGHT=0.15 \
    FAMILY_WEIGHTS="vt=0.3" EVAL_FAMILIES="reasoning vt" EVAL_N=40 POST=0 WORKERS=${WORKERS:-3} \
    bash "$HERE/testbed_4k.sh" > "$WORK/stage_teacher_vt.log" 2>&1 &
  OUT=$WORK/kv STAGE=retrofit TEACHER=$T WINDOW=64 ORACLE=0 EVAL=0 RS=$RS NEX=${NEX:-3000} THREADS=1 \
    VARIANTS="kvpop_distill_cr88@tok kvpop_distill_cr88@tok:1 kvpop_bs8_distill_cr88@tok kvpop_bs8_distill_cr88@tok:1" \
    bash "$HERE/testbed_4k.sh" > "$WORK/stage_retrofit.log" 2>&1 &
  OUT=$WORK/bl WINDOW=64 RS=$RS COMPRESSION_PCT=88 UNTRAINED=0 LR_DECAY=1 DBS=4 NEX=${NEX:-3000} THREADS=1 EVAL=0 \
    DEADLINE=$DL bash "$HERE/testbed_4k_baselines.sh" > "$WORK/stage_baselines.log" 2>&1 &
  wait
  stamp "trained"; cat "$WORK"/stage_*.log
  (cd "$WORK" && pack logs ./*.log kv/*.log bl/*.log vt/teacher_4k/*.log vt/teacher_4k/eval_dense_* \
     vt/teacher_4k/picked.txt vt/teacher/manifest.json)
  (cd "$WORK" && for d in kv/ckpt_* bl/ckpt/*; do pack "${d##*/}" "$d"; done; pack teacher_vt vt/teacher)
}

evaluate() {
  local d missing=0
  for d in "$WORK"/kv/ckpt_tok "$WORK"/bl/ckpt "$WORK"/vt/teacher; do
    [ -d "$d" ] || { echo "missing $d: run PHASE=train on this machine first" >&2; missing=1; }
  done
  [ $missing = 0 ] || exit 2
  # KVpop checkpoints, fresh problems, 75/88/94 with recall (testbed_4k.sh STAGE=evaluate)
  OUT=$OUT/kv STAGE=evaluate TEACHER=$T WINDOW=64 EVAL_N=$N SEED_BASE=$FRESH DEADLINE=$DL THREADS=1 \
    CKPT_DIRS="$(echo "$WORK"/kv/ckpt_*)" bash "$HERE/testbed_4k.sh" > "$OUT/stage_evaluate_kv.log" 2>&1 &
  # the trained baselines on the same problems
  local E="python3 -m kvpop_lab.testbed.evaluate --length ${LEN:-4096} --seed-base $FRESH --in-domain reasoning --sinks 4 --window 64 $KNOB_ARGS --device ${DEVICE:-cuda} --no-progress"
  mkdir -p "$OUT/bl"
  (OMP_NUM_THREADS=1 timeout $((DL - 20)) $E --model $T --n $N --families reasoning \
    --out "$OUT/bl/eval_streaming_plus" --compression "${SP_COMPRESSION:-0.88,0.94}" \
    --policies streaming_plus --batch-size 20 --scorer-checkpoint "streaming_plus@cr88=$WORK/bl/ckpt/streaming_plus_cr88" \
    --scorer-checkpoint "streaming_plus@cr94=$WORK/bl/ckpt/streaming_plus_cr88" > "$OUT/bl/eval_streaming_plus.log" 2>&1
   stamp "eval streaming_plus exit $?") &
  (OMP_NUM_THREADS=1 timeout $((DL - 20)) $E --model $T --n $N --families reasoning \
    --out "$OUT/bl/eval_dms" --compression 0.88 --policies dms --batch-size 10 \
    --scorer-checkpoint "dms@cr88=$WORK/bl/ckpt/dms_cr88" > "$OUT/bl/eval_dms.log" 2>&1
   stamp "eval dms exit $?") &
  # out of domain: the untrained policies on the vt teacher at once; KVpop retrofitted on reasoning only, then both
  # on vt and reasoning
  mkdir -p "$OUT/ood"
  (OMP_NUM_THREADS=1 timeout $((DL - 20)) $E --model "$WORK/vt/teacher" --n $((N / 2)) \
    --families vt,reasoning --out "$OUT/ood/eval_heuristics" --compression "$COMPRESSION" --batch-size 40 \
    --policies dense,streaming,knorm,keydiff,lagkv,snapkv > "$OUT/ood/eval_heuristics.log" 2>&1
   stamp "eval ood heuristics exit $?") &
  (OUT=$WORK/ood STAGE=retrofit TEACHER=$WORK/vt/teacher WINDOW=64 ORACLE=0 EVAL=0 RS=$OOD_RS NEX=${NEX:-3000} \
     THREADS=1 VARIANTS="kvpop_distill_cr88@tok kvpop_distill_cr88@tok:1" bash "$HERE/testbed_4k.sh"
   OUT=$OUT/ood STAGE=evaluate TEACHER=$WORK/vt/teacher WINDOW=64 EVAL_FAMILIES="vt reasoning" EVAL_N=$((N / 2)) \
     SEED_BASE=$FRESH BASE_POLICIES=dense DEADLINE=$((DL - $(date +%s) + T0)) THREADS=1 CKPT_DIRS="$(echo "$WORK"/ood/ckpt_*)" \
     bash "$HERE/testbed_4k.sh") > "$OUT/stage_ood.log" 2>&1 &
  wait
  stamp "evaluated"; cat "$OUT"/stage_*.log
  cp "$WORK"/ood/*.log "$OUT/ood/" 2>/dev/null
  (cd "$OUT" && pack results kv bl ood ./*.log && rm -rf kv bl ood)
  (cd "$WORK/ood" && for d in ckpt_*; do pack "ood_$d" "$d"; done)
}

case "$PHASE" in
  train) train ;;
  evaluate) evaluate ;;
  *) echo "PHASE must be train or evaluate, got $PHASE" >&2; exit 2 ;;
esac
stamp done
