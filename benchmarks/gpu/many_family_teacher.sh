#!/usr/bin/env bash
# A testbed teacher that knows many task families at 4096 tokens: reasoning, variable tracking and the
# RULER-style needles and word extractions, dense EM >= 0.9 wanted on every one. One GPU, in calls of under ten
# minutes that resume from what WORK holds (a later call continues where the last one stopped).
#
#   STAGE=train  one training round of benchmarks/kvpop_lab/pretrain_teacher.py, TB seconds, continuing the latest
#                teacher in WORK (WORK/round<r>/teacher, r highest) or, for round 1, INIT: a teacher folder (default
#                checkpoints/testbed-4k-teacher, the shipped 5.76M-parameter 4k teacher) or INIT=scratch (a
#                larger Qwen3, HIDDEN x LAYERS below, about 15.6M parameters with the defaults); with GROW (the size
#                flags of python -m kvpop_lab.grow_teacher, e.g. "--layers 12 --heads 16 --kv-heads 4"), round 1
#                starts from INIT grown to that size, computing what INIT computes (-> WORK/grown). Mixture: the
#                families of FAMILIES (or the round's TRAIN_FAMILIES), reasoning REASONING_WEIGHT, the lookup
#                drill LOOKUP_WEIGHT (16 facts), any FAMILY_WEIGHTS, the rest split evenly; reasoning with the 4k
#                knobs (10 facts, 4 steps). Round r takes its seconds, lengths, learning rate and mixture from line r of
#                SCHEDULE (default benchmarks/gpu/many_family_schedule.txt, the recipe of the many-family teacher;
#                with GROW many_family_grown_schedule.txt; none from scratch), a knob given in the environment winning
#                over it; without a schedule, round r trains at the r-th length range of LENS and learning rate of LRS
#                (the last one for later rounds).
#                Then a quick dense kvpop-eval on QUICK_N problems per family at LEN tokens (seeds 2^48 + 9000 + i,
#                never the final ones), to decide on another round.
#                -> WORK/round<r>/{teacher/, teacher.log, quick/}; OUT/teacher_r<r>.tar (split in 15 MiB parts
#                   teacher_r<r>.tar.part-aa, -ab, ... when larger) and OUT/logs_r<r>.tar
#   STAGE=eval   the latest teacher (or TEACHER=folder): dense kvpop-eval on EVAL_N problems of every family at LEN
#                tokens (seeds SEED_BASE + i, default 2^48 + 5000 + i; one process per family), then the per-family
#                table (python -m kvpop_lab.bench.leave_families_out teacher).
#                -> WORK/eval/<family>/, WORK/teacher_dense_em.{csv,md}, WORK/final_teacher.txt (the folder
#                   evaluated); OUT/teacher_dense_em.{csv,md}, OUT/eval.tar
#   STAGE=all    train, then eval (when DEADLINE leaves the time).
#
# Usage (one H100/H200; each call ~9 min):
#   OUT=$OUT bash benchmarks/gpu/many_family_teacher.sh                      round 1 from the shipped teacher
#   OUT=$OUT bash benchmarks/gpu/many_family_teacher.sh                      round 2 (same WORK: same warm machine),
#                                                                            and so on down the schedule
#   OUT=$OUT STAGE=eval bash benchmarks/gpu/many_family_teacher.sh           the table
#   INIT=scratch OUT=$OUT WORK=out/mf_scratch bash benchmarks/gpu/many_family_teacher.sh   (3 rounds: 256-1024,
#                                                                            1024-2048, then 1024-4096 tokens)
# A fresh machine holds nothing of the last: unpack OUT's teacher_r<r>.tar (cat the parts) into WORK here and name
# WORK/round<r> in the device run's carry; the next call then continues from it.
# Knobs: WORK (out/many_family; /out is git-ignored), INIT, GROW (round 1 only, as INIT), FROM (ROUND:FOLDER: round
# ROUND continues the teacher in FOLDER, e.g. one trained further on the CPU, instead of round ROUND-1's; later rounds
# continue as usual), SCHEDULE ("" for none), FAMILIES (reasoning,vt,niah_multikey,niah_multivalue,niah_multiquery,
# fwe: the families evaluated, and trained on unless the schedule's TRAIN_FAMILIES says otherwise), REASONING_WEIGHT
# (0.3), LOOKUP_WEIGHT (0.1), FAMILY_WEIGHTS ("" e.g. "vt=0.15 fwe=0.1"),
# TB (training seconds per round, 400), LRS (learning rate per round: "7e-4", from scratch "2e-3 1e-3 7e-4"), LENS
# (length range per round: "1024:4096", from scratch "256:1024 1024:2048 1024:4096"), CURRICULUM (the share of a
# round at its low end up to CLEN tokens, 0; CLEN 2560), HIDDEN/LAYERS/HEADS/KV_HEADS/HEAD_DIM/INTERMEDIATE (from
# scratch only: 384/8/12/4/32/1152), DATA_KNOBS (family knobs FAMILY.KEY=VALUE, space-separated, given to the
# training and every evaluation, e.g. "niah_multikey.adjacent_key=True niah_multikey.restate_key=True"; none),
# MAX_MIB (64), LEN (4096), QUICK_N (16), EVAL_N (80), SEED_BASE (2^48 + 5000), EBS (evaluation batch size, 40),
# WORKERS (data workers, 12), DEVICE (cuda), DEADLINE (seconds, 570), TEACHER (STAGE=eval: the folder to evaluate),
# WINDOW (the evaluations' window, 64: dense keeps every token, but kvpop-eval checks its default budgets against it).
# A CPU smoke test (tests/test_leave_families_out_pipeline.py): DEVICE=cpu INIT=scratch HIDDEN=64 LAYERS=1 HEADS=4
# KV_HEADS=2 HEAD_DIM=16 INTERMEDIATE=128 LENS=512:512 LEN=512 TB=3 QUICK_N=1 EVAL_N=2 WORKERS=0 WINDOW=16.
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source benchmarks/gpu/lab_env.sh
source "$(dirname "${BASH_SOURCE[0]}")/rounds.sh"  # latest_round DIR, schedule_knob FILE R KEY
EXPLICIT=" "  # the round knobs given in the environment: they win over the schedule
for v in TB LRS LENS REASONING_WEIGHT LOOKUP_WEIGHT FAMILY_WEIGHTS TRAIN_FAMILIES; do
  [ -n "${!v+x}" ] && EXPLICIT+="$v "
done
STAGE=${STAGE:-train}; WORK=${WORK:-out/many_family}; INIT=${INIT:-checkpoints/testbed-4k-teacher}
SCHEDULE=$(teacher_schedule)
FAMILIES=${FAMILIES:-reasoning,vt,niah_multikey,niah_multivalue,niah_multiquery,fwe}
L=${LEN:-4096}; DEVICE=${DEVICE:-cuda}; DEADLINE=${DEADLINE:-570}; TB=${TB:-400}; EBS=${EBS:-40}
if [ "$INIT" = scratch ]; then LRS=${LRS:-2e-3 1e-3 7e-4}; LENS=${LENS:-256:1024 1024:2048 1024:4096}
else LRS=${LRS:-7e-4}; LENS=${LENS:-1024:4096}; fi
KNOBS=(--knob reasoning.n_facts=10 --knob reasoning.steps=4)
for k in ${DATA_KNOBS:-}; do KNOBS+=(--knob "$k"); done  # family knobs for training and every evaluation
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
left() { local s=$(( DEADLINE - ($(date +%s) - T0) )); echo $(( s > 1 ? s : 1 )); }
case "$STAGE" in train|eval|all) ;; *) echo "STAGE must be train, eval or all, got $STAGE" >&2; exit 2 ;; esac
python3 -c "import sys
from kvpop_lab.pretrain_teacher import check_families
from kvpop_lab.testbed.evaluate import check_knobs
try:
    check_families(sys.argv[1].split(','))
except ValueError as err:
    sys.exit(f'FAMILIES={sys.argv[1]}: {err}')
try:
    check_knobs(sys.argv[3:], int(sys.argv[2]))
except ValueError as err:
    sys.exit(f'DATA_KNOBS: {err}')" "$FAMILIES" "$L" ${DATA_KNOBS:-} || exit 2
if [ -n "${GROW:-}" ] && [ "$INIT" = scratch ]; then
  echo "GROW=$GROW grows a trained teacher: set INIT to its folder (INIT=scratch has nothing to grow)" >&2; exit 2
fi
if [ "$INIT" != scratch ] && [ "$STAGE" != eval ] && [ "$(latest_round "$WORK")" = 0 ] && [ ! -f "$INIT/config.json" ]
then  # read by round 1 only: later rounds continue the last one, and need INIT no more
  echo "INIT=$INIT holds no model (config.json): a teacher folder or INIT=scratch" >&2; exit 2
fi
FROM=${FROM:-}; FROM_ROUND=${FROM%%:*}; FROM_DIR=${FROM#*:}
if [ -n "$FROM" ] && { ! [[ "$FROM_ROUND" =~ ^[1-9][0-9]*$ ]] || [ ! -f "$FROM_DIR/config.json" ]; }; then
  echo "FROM=$FROM: give ROUND:FOLDER, a round number and the teacher folder (config.json) that round continues," \
    "e.g. FROM=8:out/many_family/cpu/teacher" >&2; exit 2
fi
schedule_knob "$SCHEDULE" 1 TB > /dev/null || exit 2  # the whole schedule is checked: a bad one stops before any work
mkdir -p "$OUT" "$WORK"

nth() {  # index list...: the index-th word (1-based), or the last one
  local i=$1; shift
  [ "$i" -le $# ] && echo "${!i}" || echo "${!#}"
}

source benchmarks/gpu/pack.sh  # pack NAME PATTERNS...

dense_eval() {  # out-dir n seed-base families teacher
  OMP_NUM_THREADS=2 timeout "$(left)" python3 -m kvpop_lab.testbed.evaluate --model "$5" --out "$1" --length $L \
    --n "$2" --seed-base "$3" --families "$4" --in-domain "$4" --policies dense --sinks 4 --window "${WINDOW:-64}" "${KNOBS[@]}" --batch-size "$EBS" \
    --device "$DEVICE" --no-progress > "$1.log" 2>&1
  local rc=$?; stamp "dense eval ${1#"$WORK"/} exit $rc"; return $rc
}

round_knob() {  # round env-name schedule-key fallback: the environment's value when given there, else the
  local v=""    # schedule's for the round, else the fallback
  if [[ "$EXPLICIT" != *" $2 "* ]]; then v=$(schedule_knob "$SCHEDULE" "$1" "$3"); fi
  echo "${v:-$4}"
}

stage_train() {
  local prev r D lr lens lo hi init fw=() f arch=() tb rw lw fws tfs
  prev=$(latest_round "$WORK"); r=$((prev + 1)); D=$WORK/round$r
  lr=$(round_knob $r LRS LR "$(nth $r $LRS)"); lens=$(round_knob $r LENS LENS "$(nth $r $LENS)")
  lo=${lens%%:*}; hi=${lens#*:}; tb=$(round_knob $r TB TB "$TB")
  rw=$(round_knob $r REASONING_WEIGHT REASONING_WEIGHT "${REASONING_WEIGHT:-0.3}")
  lw=$(round_knob $r LOOKUP_WEIGHT LOOKUP_WEIGHT "${LOOKUP_WEIGHT:-0.1}")
  fws=$(round_knob $r FAMILY_WEIGHTS FAMILY_WEIGHTS "${FAMILY_WEIGHTS:-}")
  tfs=$(round_knob $r TRAIN_FAMILIES TRAIN_FAMILIES "${TRAIN_FAMILIES:-$FAMILIES}")
  if [ -n "$FROM" ] && [ "$r" = "$FROM_ROUND" ]; then init=(--init-from "$FROM_DIR")
  elif [ "$prev" -gt 0 ]; then init=(--init-from "$WORK/round$prev/teacher")
  elif [ -n "${GROW:-}" ]; then  # round 1 continues INIT grown (kvpop_lab.grow_teacher, GROW its size flags)
    mkdir -p "$D"
    python3 -m kvpop_lab.grow_teacher --src "$INIT" --out "$WORK/grown" $GROW > "$D/grow.log" 2>&1 \
      || { cat "$D/grow.log"; return 1; }
    tail -1 "$D/grow.log"; init=(--init-from "$WORK/grown")
  elif [ "$INIT" != scratch ]; then init=(--init-from "$INIT")
  else init=(); arch=(--hidden "${HIDDEN:-384}" --layers "${LAYERS:-8}" --heads "${HEADS:-12}" --kv-heads "${KV_HEADS:-4}"
    --head-dim "${HEAD_DIM:-32}" --intermediate "${INTERMEDIATE:-1152}"); fi
  for f in ${fws//,/ }; do fw+=(--family-weight "$f"); done
  mkdir -p "$D"
  stamp "round $r from ${init[1]:-scratch}: $lens tokens, lr $lr, $tb s, reasoning $rw, lookup $lw${fws:+, $fws}," \
    "on $tfs"
  timeout $((tb + 150)) python3 training/pretrain_teacher.py --out "$D/teacher" "${init[@]}" "${arch[@]}" \
    --max-weights-mib "${MAX_MIB:-64}" --steps 1000000 --time-budget "$tb" --seq-len "$lo:$hi" --len-multiple 256 \
    --curriculum-frac "${CURRICULUM:-0}" --curriculum-len "$lo:${CLEN:-2560}" --warmup 100 --lr "$lr" --seed "$r" \
    --workers "${WORKERS:-12}" --log-every 250 --probe-every 500 --probe-n 16 --probe-len "$hi" --eval-n 0 \
    --tokens-per-batch 32768 "${KNOBS[@]}" --knob lookup.n_facts=16 --families "$tfs" \
    --reasoning-weight "$rw" --lookup-weight "$lw" "${fw[@]}" \
    --device "$DEVICE" > "$D/teacher.log" 2>&1
  local rc=$?; stamp "round $r exit $rc"; grep -E "^model:|^trained|^probe step" "$D/teacher.log" | tail -4
  if [ $rc != 0 ] || [ ! -f "$D/teacher/config.json" ]; then
    tail -20 "$D/teacher.log"; pack "logs_r$r" "round$r/teacher.log"; return 1
  fi
  dense_eval "$D/quick" "${QUICK_N:-16}" $((2 ** 48 + 9000)) "$FAMILIES" "$D/teacher"
  grep -E "^\| dense" "$D/quick/table1.md" 2>/dev/null
  pack "teacher_r$r" "round$r/teacher"
  pack "logs_r$r" "round$r/teacher.log" "round$r/quick.log" "round$r/quick/*.csv" "round$r/quick/*.md" \
    "round$r/quick/meta.json" "round$r/teacher/manifest.json"
}

stage_eval() {
  local T=${TEACHER:-} r fam dirs=()
  if [ -z "$T" ]; then r=$(latest_round "$WORK"); T=$WORK/round$r/teacher; fi
  [ -f "$T/config.json" ] || { echo "no teacher to evaluate ($T): run STAGE=train first or set TEACHER" >&2; return 2; }
  mkdir -p "$WORK/eval"
  for fam in ${FAMILIES//,/ }; do
    dense_eval "$WORK/eval/$fam" "${EVAL_N:-80}" "${SEED_BASE:-$((2 ** 48 + 5000))}" "$fam" "$T" &
    dirs+=("$WORK/eval/$fam")
  done
  wait
  echo "$T" > "$WORK/final_teacher.txt"
  python3 -m kvpop_lab.bench.leave_families_out teacher "${dirs[@]}" --out "$WORK"
  cp "$WORK"/teacher_dense_em.{csv,md} "$OUT/" 2>/dev/null
  pack eval eval final_teacher.txt
}

case "$STAGE" in
  train) stage_train ;;
  eval) stage_eval ;;
  all) stage_train && [ "$(left)" -gt 120 ] && stage_eval ;;
esac
rc=$?
stamp "done (exit $rc)"
exit $rc
