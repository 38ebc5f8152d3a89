#!/usr/bin/env bash
# Leave-families-out retrofits: on a teacher that knows every family (benchmarks/gpu/many_family_teacher.sh),
# KVpop and DMS retrofitted on the first k families of ORDER (k in KS: 1, 2, 4), two seeds, the same STEPS at every
# k, evaluated beside SnapKV, StreamingLLM and dense at 88% and 94% on every family; then held-out EM against k.
# One GPU, in calls of under ten minutes; every stage reads and writes WORK (layout: kvpop_lab/bench/
# leave_families_out.py), so a later call continues:
#
#   STAGE=baselines  kvpop-eval of BASE_POLICIES (dense,snapkv,streaming) at COMPRESSIONS on EVAL_N problems of
#                    every family, one process per family -> WORK/baselines/eval_<family>/; OUT/baselines.tar
#   STAGE=train K=k  side by side, every (seed of SEEDS, policy of POLICIES, compression of COMPRESSIONS) retrofit on
#                    the split's families (--dataset testbed:<first k of ORDER>, the families in turn), STEPS steps
#                    of BS sequences of LEN tokens, learning rate decaying linearly to 0 over the steps, a rank-8 LoRA
#                    merged afterwards, stored as a weight delta of TEACHER (a few MB); a run past CAP seconds is
#                    killed and leaves no checkpoint.
#                      kvpop: delayed mLSTM with the token term, distilled (boundary loss + KL), max answer-query
#                             target (kvpop_hf.cli.retrofit);
#                      dms:   gates + LoRA distilled, one-sided penalty of weight DMS_WEIGHTS (88:3 94:1, as tuned for
#                             the 4k table of record), compression ramped over the first half of the steps
#                             (kvpop_hf.cli.train_dms).
#                    Each run through `python -m kvpop_lab.bench.leave_families_out train`, which records its steps
#                    and seconds (lfo_training.json) -> WORK/k<k>/ckpt_s<seed>/<policy>_cr<NN>/,
#                    WORK/k<k>/train_*.log; OUT/ckpt_k<k>.tar (parts of 15 MiB when larger), OUT/train_logs_k<k>.tar
#   STAGE=evaluate K=k  kvpop-eval of the split's checkpoints, one process per (policy, seed), on every family
#                    (HELDOUT_ONLY=1: the held-out ones only; --in-domain: the retrofit families)
#                    -> WORK/k<k>/eval_<policy>_s<seed>/; OUT/eval_k<k>.tar
#   A stage skips what WORK already holds (a checkpoint with its lfo_training.json, an evaluation with its
#   results.csv): a call cut short is finished by the same call again.
#   STAGE=table      python -m kvpop_lab.bench.leave_families_out table -> WORK/tables/ (per_seed.csv, held_out.csv,
#                    curve.csv, curve.png, verdict.json, table.md); OUT/ the same files
#
# Usage (each call ~9 min on one H100/H200; TEACHER: the folder many_family_teacher.sh evaluated):
#   T=$(cat out/many_family/final_teacher.txt)
#   TEACHER=$T OUT=$OUT STAGE=baselines bash benchmarks/gpu/leave_families_out.sh
#   for k in 1 2 4: TEACHER=$T OUT=$OUT STAGE=train K=$k ...; TEACHER=$T OUT=$OUT STAGE=evaluate K=$k ...
#   TEACHER=$T OUT=$OUT STAGE=table bash benchmarks/gpu/leave_families_out.sh          (CPU is enough)
# A fresh machine holds nothing of the last: unpack OUT's tar files into WORK here and name TEACHER and the WORK
# folders a stage reads (WORK/plan.json, WORK/k<k>) in the device run's carry.
# Knobs: TEACHER (required), WORK (out/leave_families_out), FAMILIES (reasoning,vt,niah_multikey,niah_multivalue,
# niah_multiquery,fwe), ORDER (reasoning,vt,niah_multikey,fwe), KS (1,2,4) -- the plan, fixed at WORK's first
# call --, SEEDS ("0 1"), POLICIES ("kvpop dms"), COMPRESSIONS ("88 94"), STEPS (400), BS (4), CAP (seconds a
# training may run, 480), DMS_WEIGHTS ("88:3 94:1"), BASE_POLICIES (dense,snapkv,streaming), LEN (4096), WINDOW
# (64), EVAL_N (80), SEED_BASE (2^48 + 5000: the problems of the teacher's table), EBS (40; DEBS for DMS, 20),
# HELDOUT_ONLY (0), THREADS (torch threads per process, 1), DEVICE (cuda), DEADLINE (seconds, 570), DATA_KNOBS
# (family knobs FAMILY.KEY=VALUE, space-separated: every evaluation, and the retrofits of a split holding the family;
# the teacher's, e.g. "niah_multikey.adjacent_key=True niah_multikey.restate_key=True"; part of the plan when set).

# A CPU smoke test (tests/test_leave_families_out_pipeline.py): DEVICE=cpu LEN=512 WINDOW=16 STEPS=2 BS=1 EVAL_N=2
# EBS=2 DEBS=2 SEEDS=0 with a tiny teacher.
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source benchmarks/gpu/lab_env.sh
STAGE=${STAGE:-}; WORK=${WORK:-out/leave_families_out}; L=${LEN:-4096}; W=${WINDOW:-64}; N=${EVAL_N:-80}
FAMILIES=${FAMILIES:-reasoning,vt,niah_multikey,niah_multivalue,niah_multiquery,fwe}
ORDER=${ORDER:-reasoning,vt,niah_multikey,fwe}; KS=${KS:-1,2,4}; SEEDS=${SEEDS:-0 1}; POLICIES=${POLICIES:-kvpop dms}
COMPRESSIONS=${COMPRESSIONS:-88 94}; STEPS=${STEPS:-400}; BS=${BS:-4}; CAP=${CAP:-480}; EBS=${EBS:-40}
DEVICE=${DEVICE:-cuda}; TH=${THREADS:-1}; DEADLINE=${DEADLINE:-570}
SEED_BASE=${SEED_BASE:-$((2 ** 48 + 5000))}
LFO="python3 -m kvpop_lab.bench.leave_families_out"
if [ "$DEVICE" = cpu ]; then TRAIN_DEV=(--use_cpu True); else TRAIN_DEV=(--bf16); fi
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
left() { local s=$(( DEADLINE - ($(date +%s) - T0) )); echo $(( s > 1 ? s : 1 )); }

# -- checks, before any work ----------------------------------------------------------------------------------
case "$STAGE" in baselines|train|evaluate|table) ;;
  *) echo "STAGE must be baselines, train, evaluate or table, got '$STAGE'" >&2; exit 2 ;; esac
for c in $COMPRESSIONS; do
  case "$c" in [0-9][0-9]) ;; *) echo "COMPRESSIONS holds two-digit percentages (88 94), got $c" >&2; exit 2 ;; esac
done
for p in $POLICIES; do
  case "$p" in kvpop|dms) ;; *) echo "POLICIES holds kvpop and/or dms, got $p" >&2; exit 2 ;; esac
done
for s in $SEEDS; do
  case "$s" in [0-9]|[0-9][0-9]) ;; *) echo "SEEDS holds numbers, got $s" >&2; exit 2 ;; esac
done
if [ "$STAGE" != table ]; then
  : "${TEACHER:?set TEACHER to the many-family teacher (benchmarks/gpu/many_family_teacher.sh writes one)}"
  [ -f "$TEACHER/config.json" ] || { echo "TEACHER=$TEACHER holds no model (config.json)" >&2; exit 2; }
fi
if [ "$STAGE" != table ]; then  # written at WORK's first call (DATA_KNOBS checked), checked against at every later one
  $LFO plan "$WORK" --families "$FAMILIES" --order "$ORDER" --ks "$KS" --setting "length=$L" --setting "window=$W" \
    --setting "eval_n=$N" --setting "seed_base=$SEED_BASE" --setting "steps=$STEPS" --setting "batch_size=$BS" \
    ${DATA_KNOBS:+--setting "data_knobs=$DATA_KNOBS"} || exit 2
fi
if [ "$STAGE" = train ] || [ "$STAGE" = evaluate ]; then
  : "${K:?STAGE=$STAGE needs K=<number of retrofit families, one of KS=$KS>}"
  RETRO=$($LFO split "$WORK" --k "$K" --field retrofit) || exit 2
  HELD=$($LFO split "$WORK" --k "$K" --field heldout) || exit 2
  D=$WORK/k$K
  mkdir -p "$D"
fi
mkdir -p "$OUT"

source benchmarks/gpu/pack.sh  # pack NAME PATTERNS...

DKNOBS=(); for k in ${DATA_KNOBS:-}; do DKNOBS+=(--knob "$k"); done

evaluate() {  # out-dir batch-size families in-domain args...  (kvpop-eval with the 4k knobs and DATA_KNOBS)
  local d=$1 bs=$2 fams=$3 ind=$4; shift 4
  OMP_NUM_THREADS=$TH timeout "$(left)" python3 -m kvpop_lab.testbed.evaluate --model "$TEACHER" --out "$d" \
    --length $L --n "$N" --seed-base "$SEED_BASE" --families "$fams" --in-domain "$ind" --sinks 4 --window $W \
    --knob reasoning.n_facts=10 --knob reasoning.steps=4 "${DKNOBS[@]}" --batch-size "$bs" --device "$DEVICE" \
    --no-progress "$@" > "$d.log" 2>&1
  local rc=$?; stamp "eval ${d#"$WORK"/} exit $rc"; grep -hE "^\| [a-z]" "$d"/table[12].md 2>/dev/null | head -8
}

comps() { local c out=""; for c in $COMPRESSIONS; do out+="0.$c,"; done; echo "${out%,}"; }

stage_baselines() {
  local fam
  mkdir -p "$WORK/baselines"
  for fam in ${FAMILIES//,/ }; do
    [ -f "$WORK/baselines/eval_$fam/results.csv" ] && { stamp "baselines $fam: done before"; continue; }
    evaluate "$WORK/baselines/eval_$fam" "$EBS" "$fam" "$fam" --policies "${BASE_POLICIES:-dense,snapkv,streaming}" \
      --compression "$(comps)" &
  done
  wait
  pack baselines baselines
}

train_one() {  # policy seed NN
  local p=$1 s=$2 c=$3 name ck knob=() limit k
  case ",$RETRO," in *,reasoning,*) knob=(reasoning.n_facts=10 reasoning.steps=4) ;; esac
  for k in ${DATA_KNOBS:-}; do  # the knobs of the split's families
    case ",$RETRO," in *,"${k%%.*}",*) knob+=("$k") ;; esac
  done
  [ ${#knob[@]} -gt 0 ] && knob=(--knob "${knob[@]}")
  name=$([ "$p" = kvpop ] && echo kvpop_distill || echo dms)_cr$c
  ck=$D/ckpt_s$s/$name
  if [ -f "$ck/lfo_training.json" ] && [ -f "$ck/model_delta.json" ]; then stamp "train $name seed $s: done before"; return; fi
  local common=(--model "$TEACHER" --dataset "testbed:$RETRO" "${knob[@]}" --seq_len $L --sinks 4 --window $W
    --lora_rank 8 --merge_lora True --learning_rate 1e-3 --per_device_train_batch_size "$BS" --max_steps "$STEPS"
    --output_dir "$ck" --logging_steps 10 --report_to none --save_strategy no --disable_tqdm True --seed "$s"
    --problem_seed $((1234 + s)) "${TRAIN_DEV[@]}")
  limit=$(left); [ "$limit" -gt "$CAP" ] && limit=$CAP
  if [ "$p" = kvpop ]; then
    local topk
    topk=$(python3 -c "from kvpop_hf.policies import parse_budgets as p; print(p(compression='0.$c', length=$L, sinks=4, window=$W)[0].topk)")
    OMP_NUM_THREADS=$TH timeout "$limit" $LFO train kvpop "${common[@]}" --topk "$topk" --scorer mlstm \
      --scorer_kwargs '{"token_readout": true}' --train_backbone True --distill_weight 1.0 \
      --scorer_learning_rate 3e-3 --target_reduce max --target_queries labels > "$D/train_${name}_s$s.log" 2>&1
  else
    local dw=3 pair
    for pair in ${DMS_WEIGHTS:-88:3 94:1}; do [ "${pair%%:*}" = "$c" ] && dw=${pair#*:}; done
    OMP_NUM_THREADS=$TH timeout "$limit" $LFO train dms "${common[@]}" --compression "0.$c" --penalty one_sided \
      --compression_weight "$dw" --ramp_fraction 0.5 > "$D/train_${name}_s$s.log" 2>&1
  fi
  local rc=$?
  if [ $rc = 0 ] && [ -f "$ck/model.safetensors" ]; then  # the merged student as the tensors that differ
    python3 -c "import sys; from kvpop_lab.testbed.weight_delta import save_weight_delta as s; print(s(*sys.argv[1:]))" \
      "$ck" "$TEACHER" >> "$D/train_${name}_s$s.log" 2>&1 || rc=$?
  fi
  [ $rc = 124 ] && stamp "train $name seed $s: killed at $limit s, no checkpoint (SEEDS=$s alone, or fewer STEPS)"
  stamp "train $name seed $s on $RETRO exit $rc $(tr -d '\n ' 2>/dev/null < "$ck/lfo_training.json" | cut -c1-60)"
}

stage_train() {
  local s p c
  for s in $SEEDS; do for p in $POLICIES; do for c in $COMPRESSIONS; do train_one "$p" "$s" "$c" & done; done; done
  wait
  pack "ckpt_k$K" "k$K/ckpt_s*"
  pack "train_logs_k$K" "k$K/train_*.log"
}

stage_evaluate() {
  local s p pol specs c fams=$FAMILIES bs
  [ "${HELDOUT_ONLY:-0}" = 1 ] && fams=$HELD
  for s in $SEEDS; do for p in $POLICIES; do
    pol=$([ "$p" = kvpop ] && echo kvpop_distill || echo dms); specs=(); c=""
    for nn in $COMPRESSIONS; do
      [ -d "$D/ckpt_s$s/${pol}_cr$nn" ] || continue
      specs+=(--scorer-checkpoint "$pol@cr$nn=$D/ckpt_s$s/${pol}_cr$nn"); c+="0.$nn,"
    done
    if [ -z "$c" ]; then stamp "no $pol checkpoint of seed $s in $D: skipped"; continue; fi
    if [ -f "$D/eval_${pol}_s$s/results.csv" ]; then stamp "eval ${pol}_s$s: done before"; continue; fi
    bs=$EBS; [ "$p" = dms ] && bs=${DEBS:-20}
    evaluate "$D/eval_${pol}_s$s" "$bs" "$fams" "$RETRO" --policies "$pol" --compression "${c%,}" "${specs[@]}" &
  done; done
  wait
  pack "eval_k$K" "k$K/eval_*"
}

stage_table() {
  $LFO table "$WORK" --out "$WORK/tables" || return $?
  cp "$WORK"/tables/{table.md,held_out.csv,curve.csv,verdict.json} "$OUT/" 2>/dev/null
  cp "$WORK/tables/curve.png" "$OUT/" 2>/dev/null
  pack tables tables
}

"stage_$STAGE"
rc=$?
stamp "done (exit $rc)"
exit $rc
