#!/usr/bin/env bash
# How varied must retrofit data be (benchmarks/docs/retrofit_data.md): every call runs the next step of the whole
# experiment, read from what MF_WORK and LFO_WORK hold, so the same command is repeated until it says "done":
#
#   1. teacher rounds  benchmarks/gpu/many_family_teacher.sh STAGE=train, until the last round's quick check has
#                      dense EM >= QUICK_MIN on every family or MAX_ROUNDS rounds ran
#   2. teacher table   many_family_teacher.sh STAGE=eval (80 problems per family) -> MF_WORK/teacher_dense_em.md
#   3. baselines       benchmarks/gpu/leave_families_out.sh STAGE=baselines
#   4. per k of KS     leave_families_out.sh STAGE=train K=k, then STAGE=evaluate K=k
#   5. table           leave_families_out.sh STAGE=table -> LFO_WORK/tables/
#
# Usage: OUT=$OUT bash benchmarks/gpu/retrofit_variety.sh          (steps until DEADLINE, 570 s, on one GPU)
#        DRY=1 bash benchmarks/gpu/retrofit_variety.sh              (print the next step only)
# A call runs the next step, then the one after it while the time left covers it (a training step: its seconds,
# TB + 200 -- TB from the teacher's schedule, many_family_schedule.txt -- or CAP + 60; any other: MIN_STEP, 240 s)
# and OUT stays within the 8 files a device call returns; each step gets the time left as its DEADLINE. A step
# that leaves the folders as they were ends the call.
# On a fresh machine, carry what the step reads (benchmarks/docs/retrofit_data.md). Knobs: MF_WORK (out/many_family), LFO_WORK
# (out/leave_families_out), QUICK_MIN (0.9), MAX_ROUNDS (14), DEADLINE (570), MIN_STEP (240), and every knob of the
# two scripts (FAMILIES, KS, SEEDS, POLICIES, COMPRESSIONS, INIT, TB, CAP, STEPS, ...), passed through.
set -u
HERE=$(cd "$(dirname "$0")" && pwd)
MF=${MF_WORK:-out/many_family}; LW=${LFO_WORK:-out/leave_families_out}
FAMILIES=${FAMILIES:-reasoning,vt,niah_multikey,niah_multivalue,niah_multiquery,fwe}
KS=${KS:-1,2,4}; SEEDS=${SEEDS:-0 1}; POLICIES=${POLICIES:-kvpop dms}; COMPRESSIONS=${COMPRESSIONS:-88 94}

source "$(dirname "${BASH_SOURCE[0]}")/rounds.sh"  # latest_round DIR, schedule_knob FILE R KEY
SCHED=$(teacher_schedule)

quick_ok() {  # round: 0 when its quick check has dense EM >= QUICK_MIN on every family (or has no check to read)
  python3 - "$MF/round$1/quick/results.csv" "${QUICK_MIN:-0.9}" <<'EOF'
import csv, sys
try:
    ems = [float(r["em"]) for r in csv.DictReader(open(sys.argv[1])) if r["policy"] == "dense"]
except OSError:
    sys.exit(0)  # no quick check: the full evaluation decides
sys.exit(0 if ems and min(ems) >= float(sys.argv[2]) else 1)
EOF
}

pol_name() { [ "$1" = kvpop ] && echo kvpop_distill || echo dms; }

next_step() {
  local r k s p c fam
  if [ ! -f "$MF/final_teacher.txt" ]; then
    r=$(latest_round "$MF")
    if [ "$r" -gt 0 ] && { [ "$r" -ge "${MAX_ROUNDS:-14}" ] || quick_ok "$r"; }; then echo teacher-eval
    else echo teacher-train; fi
    return
  fi
  for fam in ${FAMILIES//,/ }; do
    [ -f "$LW/baselines/eval_$fam/results.csv" ] || { echo baselines; return; }
  done
  for k in ${KS//,/ }; do
    for s in $SEEDS; do for p in $POLICIES; do for c in $COMPRESSIONS; do
      [ -f "$LW/k$k/ckpt_s$s/$(pol_name "$p")_cr$c/lfo_training.json" ] || { echo "train $k"; return; }
    done; done; done
    for s in $SEEDS; do for p in $POLICIES; do
      [ -f "$LW/k$k/eval_$(pol_name "$p")_s${s}/results.csv" ] || { echo "evaluate $k"; return; }
    done; done
  done
  [ -f "$LW/tables/table.md" ] || { echo table; return; }
  echo done
}

files_of() {  # step: the most files it adds to OUT (pack.sh splits a tar of more than 15 MiB in parts)
  case "$1" in teacher-train) echo 3 ;; teacher-eval) echo 3 ;; baselines|evaluate*) echo 1 ;; train*) echo 4 ;;
    table) echo 6 ;; *) echo 0 ;; esac
}

seconds_of() {  # step: the time left it needs to start in a call that already ran a step
  local tb=${TB:-$(schedule_knob "$SCHED" $(( $(latest_round "$MF") + 1 )) TB)}
  case "$1" in teacher-train) echo $(( ${tb:-400} + 200 )) ;; train*) echo $(( ${CAP:-480} + 60 )) ;;
    *) echo "${MIN_STEP:-240}" ;; esac
}

run_step() {  # step deadline
  case "$1" in
    teacher-train) DEADLINE=$2 WORK=$MF STAGE=train bash "$HERE/many_family_teacher.sh" ;;
    teacher-eval) DEADLINE=$2 WORK=$MF STAGE=eval bash "$HERE/many_family_teacher.sh" ;;
    baselines|table) DEADLINE=$2 WORK=$LW TEACHER=$(cat "$MF/final_teacher.txt") STAGE=$1 \
        bash "$HERE/leave_families_out.sh" ;;
    train*|evaluate*) DEADLINE=$2 WORK=$LW TEACHER=$(cat "$MF/final_teacher.txt") STAGE=${1% *} K=${1#* } \
        bash "$HERE/leave_families_out.sh" ;;
  esac
}

teacher_note() {
  if [ -f "$MF/teacher_dense_em.csv" ] && grep -q ",False$" "$MF/teacher_dense_em.csv"; then
    echo "note: the teacher's dense EM is below 0.9 on $(grep ",False$" "$MF/teacher_dense_em.csv" | cut -d, -f1 | paste -sd,);" \
      "for more rounds remove $MF/final_teacher.txt and raise MAX_ROUNDS"
  fi
}

step=$(next_step)
echo "next step: $step"
teacher_note
[ "${DRY:-0}" = 1 ] && exit 0
: "${OUT:?set OUT to an output directory}"
export FAMILIES KS SEEDS POLICIES COMPRESSIONS
mkdir -p "$OUT"
T0=$(date +%s); BUDGET=${DEADLINE:-570}
left() { echo $(( BUDGET - ($(date +%s) - T0) )); }
state() { find "$MF" "$LW" -type f 2>/dev/null | sort | cksum; }  # the folders' files, by name
rc=0; ran=0; before=""
while [ "$step" != done ]; do
  if [ $ran -gt 0 ]; then
    n_out=$(find "$OUT" -maxdepth 1 -type f | wc -l)
    if [ "$(state)" = "$before" ]; then echo "step $prev left the folders as they were: the call ends here"; break; fi
    if [ "$(left)" -lt "$(seconds_of "$step")" ]; then
      echo "next step: $step needs $(seconds_of "$step") s, $(left) s left: the next call runs it"; break
    fi
    if [ $((n_out + $(files_of "$step"))) -gt 8 ]; then
      echo "next step: $step could take OUT past 8 files ($n_out there): the next call runs it"; break
    fi
    echo "next step: $step ($(left) s left)"
  fi
  before=$(state)
  run_step "$step" "$(left)"; rc=$?
  ran=$((ran + 1)); prev=$step
  [ $rc = 0 ] || { echo "step $step exit $rc: the call ends here"; break; }
  step=$(next_step)
done
if [ "$step" = done ]; then
  teacher_note
  echo "every step has run: $LW/tables/table.md, $MF/teacher_dense_em.md"
fi
exit $rc
