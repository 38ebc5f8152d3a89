#!/usr/bin/env bash
# The 4k-token testbed on one GPU: reasoning problems of 4096 tokens with the knobs of the 1024-token ones
# (10 facts, 4 steps: ~110 tokens of the context are needed, the rest is filler and z-distractors), window 64
# (the operating point: the answer-query oracle keeps 0.95 of the dense EM at 88% with it, 0.925 with 32).
#
#   STAGE=teacher  continue INIT (required: a 1024-token teacher) to 4096 tokens, two learning
#                  rates side by side (A 7e-4, B 1.2e-3), lengths 1024-2560 for the first 35% of the run, then
#                  1024-4096 (multiples of 256); mix: reasoning 0.6, lookup drill 0.3 (16 facts), the RULER
#                  families 0.1; teacher-forced lookup probe on 16 problems of 4096 tokens every 500 steps.
#                  Dense kvpop-eval of both at 4096 and 1024 tokens (EVAL_N problems, the same knobs); the higher
#                  EM at 4096 is copied to $OUT/teacher (ties: A). Then, side by side until DEADLINE: oracle
#                  eviction (mean and max future attention) and kvpop-eval of the heuristics at 75/88/94%.
#                  -> $OUT/teacher_4k/ (logs, evals), $OUT/teacher/, $OUT/oracle_{mean,max}/, $OUT/eval_heuristics/
#   STAGE=retrofit meanwhile, the oracle from the answer's queries only (oracle_eviction.py --queries target, max
#                  and mean); retrofit KVpop (mLSTM, delayed) and KVpop_mlp on TEACHER side by side, RS seconds
#                  each, all on the target from the answer's queries (--target_queries labels): scorer only with
#                  the max target at 88% and 94%, scorer only with the mean target at 88%, and distillation +
#                  boundary loss with a LoRA backbone merged into the weights (max target, 88%); then kvpop-eval
#                  of the learned policies at 75/88/94% (a variant without its own 94% checkpoint uses the 88% one,
#                  every 75% row the 88% one) with --analysis (oracle top-k recall against the max answer-query
#                  oracle, retention heatmap).
#                  Every retrofit's learning rates decay linearly to 0 over its RS seconds (--lr_decay_by_time;
#                  LR_DECAY=0 keeps them constant, as the runs made before that flag). A variant written
#                  <variant>@<option> sets an mLSTM option and is saved (and evaluated) apart: @fb<x> (the forget
#                  gate's initial bias x), @tok (token_readout: the read token's own term in the readout), @ds<n>
#                  (state_dim n), @immediate (no delayed readout); benchmarks/mlstm_options.sh. A name part _p<x>_
#                  (kvpop_p4_distill_cr88) trains on the power mean of order x of the future attention instead of
#                  the max, saved to ckpt[_<option>]_p<x>/ under the name without it.
#                  A name part _dlse_ (kvpop_dlse_distill_cr88) trains on the exact target (--target_lse dense:
#                  the dense pass's log-sum-exp, as the oracle has) instead of the student's sparse one, saved to
#                  ckpt[_<option>][_p<x>]_dlse/.
#                  -> $OUT/oracle_{max,mean}_target/, $OUT/ckpt/<policy>_cr<NN>/, $OUT/retrofit_*.log,
#                     $OUT/eval_learned/ ($OUT/ckpt_<option>/, $OUT/eval_learned_<option>/ for @<option> variants)
#   STAGE=evaluate the evaluation above of existing checkpoint folders: CKPT_DIRS="dir ..." -> $OUT/eval_<dir name>/
#
# Usage: OUT=dir bash benchmarks/gpu/testbed_4k.sh                                   (STAGE=teacher, ~9 min)
#        OUT=dir STAGE=retrofit TEACHER=checkpoints/testbed-4k-teacher bash benchmarks/gpu/testbed_4k.sh   (~9 min)
# Knobs: TB (teacher training seconds, 240), RS (retrofit seconds, 200), WINDOW (the protected window, 64;
# WINDOW=32 gives the window-32 runs, study 'testbed_4k (window 32)' in results/studies.csv), VARIANTS (the retrofits to run, default
# the eight above, e.g. "kvpop_cr88 kvpop_distill_cr88"; a policy is evaluated when its _cr88 or _cr94 run exists; one with a _cr94 run alone needs EVAL_COMPRESSION=0.94),
# ORACLE=0 (skip the answer-query oracles), EVAL=0 (retrofit only: no evaluation), BASE_POLICIES (the untrained rows of the evaluation, dense,streaming), EVAL_N (problems per evaluation, 40),
# MERGE_LORA=0 (the distilled students saved as LoRA adapters + scorer instead of merged weights; kvpop-eval loads either),
# DEADLINE (seconds after start by which the last evaluations are cut, 540), THREADS (torch threads per process, 2),
# EVAL_FAMILIES (families evaluated, "reasoning"; e.g. "reasoning vt"), SEED_BASE (problem i of an evaluation has seed
# SEED_BASE + i, 2^48), EVAL_COMPRESSION (the learned policies' compression ratios, 0.75,0.88,0.94), ANALYSIS_N (problems of the
# recall analysis, 8). STAGE=teacher also takes INIT, LRS (runs side by side as NAME:LR, "A:7e-4 B:1.2e-3"),
# REASONING_WEIGHT (0.6), LOOKUP_WEIGHT (0.3), FAMILY_WEIGHTS (e.g. "vt=0.3": pretrain_teacher.py --family-weight),
# CURRICULUM (the share of the run at CLEN tokens at most, 0.35), POST=0 (stop after picking the teacher: no
# oracle, no heuristics; the pick is the run with the highest mean dense EM at LEN over EVAL_FAMILIES).
# For a CPU smoke test of the script:
# DEVICE=cpu LEN=768 LO=512 CLEN=640 TB=10 RS=5 EVAL_N=2 WORKERS=1 NEX=8 WINDOW=32 (at 768 tokens a 64-token window
# leaves no long-range slot at 94%).
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source benchmarks/gpu/lab_env.sh
# shellcheck source=benchmarks/mlstm_options.sh
source "$(dirname "$0")/../mlstm_options.sh"
STAGE=${STAGE:-teacher}; L=${LEN:-4096}; LO=${LO:-1024}; CLEN=${CLEN:-2560}; W=${WINDOW:-64}; N=${EVAL_N:-40}
DEADLINE=${DEADLINE:-540}; DEVICE=${DEVICE:-cuda}; TH=${THREADS:-2}; EVAL_FAMILIES=${EVAL_FAMILIES:-reasoning}
SEED_BASE=${SEED_BASE:-281474976710656}
if [ "$DEVICE" = cpu ]; then TRAIN_DEV="--use_cpu True"; else TRAIN_DEV="--bf16"; fi
KNOBS="--knob reasoning.n_facts=10 --knob reasoning.steps=4"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) )); }
topk() {  # topk of a compression ratio at length L
  python3 -c "from kvpop_hf.policies import parse_budgets as p
print(p(compression='$1', length=$L, sinks=4, window=$W)[0].topk)"; }
mkdir -p "$OUT"

evaluate() {  # out-dir seconds args...  (kvpop-eval of reasoning problems with the 4k knobs)
  local d=$1 s=$2; shift 2
  OMP_NUM_THREADS=$TH timeout "$s" python3 -m kvpop_lab.testbed.evaluate --out "$d" --n "$N" \
    --families "${EVAL_FAMILIES// /,}" --in-domain reasoning --seed-base "$SEED_BASE" --sinks 4 --window $W $KNOBS \
    --batch-size 40 --device "$DEVICE" --no-progress "$@" > "$d.log" 2>&1
  local rc=$?; stamp "eval ${d##*/} exit $rc"; grep -E "^\| [a-z]" "$d/table1.md" 2>/dev/null
}

stage_teacher() {
  local D="$OUT/teacher_4k" TB=${TB:-240}
  : "${INIT:?STAGE=teacher needs INIT=<a 1024-token teacher folder> (benchmarks/gpu/pretrain_teacher.sh writes one)}"
  mkdir -p "$D"
  train() {  # name lr
    local fw=() f
    for f in ${FAMILY_WEIGHTS:-}; do fw+=(--family-weight "$f"); done
    OMP_NUM_THREADS=2 timeout $((TB + 100)) python3 training/pretrain_teacher.py --out "$D/t_$1" \
      --init-from "$INIT" --steps 1000000 --time-budget "$TB" --seq-len $LO:$L \
      --len-multiple 256 --curriculum-frac "${CURRICULUM:-0.35}" --curriculum-len $LO:$CLEN --warmup 100 --lr "$2" \
      --seed 2 --workers "${WORKERS:-6}" --log-every 250 --probe-every 500 --probe-n 16 --probe-len $L --eval-n 0 \
      --tokens-per-batch 32768 --knob reasoning.n_facts=10 --knob reasoning.steps=4 --knob lookup.n_facts=16 \
      --reasoning-weight "${REASONING_WEIGHT:-0.6}" --lookup-weight "${LOOKUP_WEIGHT:-0.3}" "${fw[@]}" \
      > "$D/teacher_$1.log" 2>&1
    stamp "teacher $1 exit $?"; grep -E "^probe step" "$D/teacher_$1.log" | tail -2
  }
  local run names=""
  for run in ${LRS:-A:7e-4 B:1.2e-3}; do train "${run%%:*}" "${run#*:}" & names+=" ${run%%:*}"; done
  wait
  for n in $names; do for EL in $L $LO; do
    evaluate "$D/eval_dense_${n}_L$EL" 120 --model "$D/t_$n" --length $EL --policies dense --compression 0.88 &
  done; done
  wait
  local pick  # the run with the highest mean dense EM at L over the families evaluated (ties: the first)
  pick=$(python3 - "$D" "$L" $names <<'EOF'
import csv, sys
d, L, names = sys.argv[1], sys.argv[2], sys.argv[3:]
em = {}
for n in names:
    try:
        rows = list(csv.DictReader(open(f"{d}/eval_dense_{n}_L{L}/results.csv")))
        vals = [float(r["em"]) for r in rows if r["policy"] == "dense"]
        em[n] = sum(vals) / len(vals)
    except (OSError, ValueError, ZeroDivisionError):
        em[n] = -1.0
print(max(names, key=lambda n: (em[n], -names.index(n))))
EOF
)
  echo "$pick" > "$D/picked.txt"; stamp "picked teacher $pick"
  cp -r "$D/t_$pick" "$OUT/teacher"
  [ "${POST:-1}" = 1 ] || { stamp "stage teacher done (POST=0: no oracle or heuristics)"; return; }
  local CR="0.75,0.88,0.94"
  for kind in mean max; do
    timeout "$(left)" python3 benchmarks/oracle_eviction.py --model "$OUT/teacher" --out "$OUT/oracle_$kind" \
      --kind $kind --length $L --n "$N" --compression $CR --window $W $KNOBS --device "$DEVICE" \
      > "$OUT/oracle_$kind.log" 2>&1 && grep -E "^\| oracle" "$OUT/oracle_$kind/table.md" &
  done
  evaluate "$OUT/eval_heuristics" "$(left)" --model "$OUT/teacher" --length $L --compression $CR \
    --policies dense,streaming,knorm,random,keydiff,lagkv,tova,h2o,snapkv &
  wait
  stamp "stage teacher done"
}

stage_retrofit() {
  local TEACHER=${TEACHER:?set TEACHER to the 4k teacher} RS=${RS:-200}
  local K88 K94 CR="0.75,0.88,0.94"
  K88=$(topk 0.88); K94=$(topk 0.94)
  for kind in $( [ "${ORACLE:-1}" = 1 ] && echo max mean ); do  # the oracle from the answer's queries only
    timeout $((RS + 200)) python3 benchmarks/oracle_eviction.py --model "$TEACHER" --out "$OUT/oracle_${kind}_target" \
      --kind $kind --queries target --length $L --n "$N" --compression $CR --window $W $KNOBS --device "$DEVICE" \
      > "$OUT/oracle_${kind}_target.log" 2>&1 && grep -E "^\| oracle" "$OUT/oracle_${kind}_target/table.md" &
  done
  retro() {  # ckpt-folder name scorer topk args...
    local folder=$1 name=$2 scorer=$3 k=$4; shift 4
    OMP_NUM_THREADS=$TH timeout $((RS + 150)) python3 training/retrofit.py --model "$TEACHER" \
      --dataset testbed:reasoning --knob reasoning.n_facts=10 reasoning.steps=4 --seq_len $L --sinks 4 --window $W \
      --topk "$k" --scorer "$scorer" --output_dir "$folder/$name" --max_steps 100000 --num_examples "${NEX:-1200}" \
      --max_train_seconds "$RS" --scorer_learning_rate 3e-3 $TRAIN_DEV \
      --target_queries labels --logging_steps 10 --report_to none --save_strategy no --disable_tqdm True \
      "$@" > "$OUT/retrofit_${name}${folder##*/ckpt}.log" 2>&1
    local rc=$?; stamp "retrofit $name${folder##*/ckpt} exit $rc"
    grep -o "{'loss'[^}]*}" "$OUT/retrofit_${name}${folder##*/ckpt}.log" | sed -n '$p' | cut -c1-240
  }
  local ONLY="--train_backbone False --learning_rate 1e-4"
  local LORA="--train_backbone True --lora_rank 8 --merge_lora $([ "${MERGE_LORA:-1}" = 1 ] && echo True || echo False)"
  LORA+=" --distill_weight 1.0 --learning_rate 1e-3"
  local DECAY=""; [ "${LR_DECAY:-1}" = 1 ] && DECAY="--lr_decay_by_time True"
  # a variant's name says what it trains: kvpop (mLSTM) or kvpop_mlp, _mean (the mean target, else the max one),
  # _distill (distillation + boundary loss with a LoRA backbone, else scorer only), _cr<NN> (its budget);
  # a suffix @<option> sets an mLSTM option and puts the checkpoint in ckpt_<option>/: @fb<x> the forget gate's
  # initial bias (default 3), @tok the readout's term of the read token's own features, @ds<n> the state_dim,
  # @immediate no delayed readout (mlstm_kwargs, benchmarks/mlstm_options.sh)
  # A name part _p<x>_ (e.g. kvpop_p4_distill_cr88) trains on the power mean of order x of the future attention
  # (--target_reduce p<x>); it is dropped from the checkpoint's name, which goes to ckpt[_<option>]_p<x>/.
  # A name part _dlse_ (kvpop_dlse_distill_cr88) normalises the target by the dense pass's log-sum-exp, the exact
  # future attention that the oracle and the recall use (--target_lse dense), instead of the student's sparse
  # one (the paper's approximation); ckpt[_<option>][_p<x>]_dlse/.
  # A name part _bs<n>_ (kvpop_bs8_distill_cr88) trains with batches of n sequences instead of 4 (folder part _bs<n>);
  # a suffix :<seed> (kvpop_distill_cr88@tok:1) is a further training with another seed (--seed <seed> and
  # training problems drawn from --problem_seed 1234 + <seed>; folder part _s<seed>; default seed 0).
  local entry v opt sc target mode folder kw ptag lse bs seed
  for entry in ${VARIANTS:-kvpop_cr88 kvpop_cr94 kvpop_mean_cr88 kvpop_distill_cr88 kvpop_mlp_cr88 kvpop_mlp_cr94 \
              kvpop_mlp_mean_cr88 kvpop_mlp_distill_cr88}; do
    seed=""; case "$entry" in *:*) seed=${entry##*:}; entry=${entry%:*} ;; esac
    case "$seed" in ""|[0-9]|[0-9][0-9]) ;; *) echo "seed of $entry must be a number, got $seed" >&2; exit 2 ;; esac
    v=${entry%%@*}; opt=""; [ "$v" != "$entry" ] && opt=${entry#*@}
    bs=$(echo "$v" | grep -oE '_bs[0-9]+_' | tr -dc 0-9)
    [ -n "$bs" ] && v=${v/_bs${bs}_/_}
    case "$v" in kvpop_mlp*) sc=mlp ;; kvpop*) sc=mlstm ;; *) echo "unknown variant $v" >&2; exit 2 ;; esac
    ptag=$(echo "$v" | grep -oE '_p[0-9]+(\.[0-9]+)?_' | tr -d _)
    [ -n "$ptag" ] && v=${v/_${ptag}_/_}
    lse=""; case "$v" in *_dlse_*) lse=dlse; v=${v/_dlse_/_} ;; esac
    case "$v" in *_mean_*) target=mean ;; *) target=${ptag:-max} ;; esac
    case "$v" in *_distill_*) mode=$LORA ;; *) mode=$ONLY ;; esac
    kw=$(mlstm_kwargs "$opt") || { echo "unknown option @$opt in $entry (fb<x>, tok, ds<n>, immediate)" >&2; exit 2; }
    [ "$sc" = mlp ] && [ -z "$opt" ] && kw='{}'  # the options are the mLSTM's
    folder="$OUT/ckpt${opt:+_$opt}${ptag:+_$ptag}${lse:+_$lse}${bs:+_bs$bs}${seed:+_s$seed}"
    # shellcheck disable=SC2086
    retro "$folder" "$v" "$sc" "$(topk "0.${v##*_cr}")" $mode $DECAY --target_reduce $target --scorer_kwargs "$kw" \
      --target_lse "$([ -n "$lse" ] && echo dense || echo sparse)" --per_device_train_batch_size "${bs:-4}" \
      --seed "${seed:-0}" --problem_seed $((1234 + ${seed:-0})) &
  done
  wait
  [ "${EVAL:-1}" = 1 ] || { stamp "stage retrofit done (EVAL=0: no evaluation)"; return; }
  for d in "$OUT"/ckpt*; do eval_checkpoints "$d" "$OUT/eval_learned${d##*/ckpt}" & done
  wait
  stamp "stage retrofit done"
}

eval_checkpoints() {  # ckpt-folder out-dir: kvpop-eval of the learned policies found in the folder, with --analysis
  local C=$1 CR=${EVAL_COMPRESSION:-0.75,0.88,0.94} specs=() policies=${BASE_POLICIES:-dense,streaming} p
  for p in kvpop kvpop_mlp kvpop_mean kvpop_mlp_mean kvpop_distill kvpop_mlp_distill kvpop_mean_distill \
           kvpop_mlp_mean_distill; do
    if [ -d "$C/${p}_cr88" ]; then
      policies+=",$p"
      specs+=(--scorer-checkpoint "$p@cr75=$C/${p}_cr88")
      [ ! -d "$C/${p}_cr94" ] && specs+=(--scorer-checkpoint "$p@cr94=$C/${p}_cr88")
    elif [ -d "$C/${p}_cr94" ]; then
      policies+=",$p"  # a 94% checkpoint alone serves 94% only: EVAL_COMPRESSION=0.94
    fi
  done
  evaluate "$2" "$(left)" --model "$TEACHER" --length $L --compression "$CR" --policies "$policies" \
    --checkpoints-dir "$C" "${specs[@]}" --analysis --analysis-n "${ANALYSIS_N:-8}" --oracle-kind max --oracle-queries target
}

stage_evaluate() {  # CKPT_DIRS: folders of <policy>_cr<NN> checkpoints (as ckpt*/ of a retrofit stage)
  local TEACHER=${TEACHER:?set TEACHER to the 4k teacher} d
  for d in ${CKPT_DIRS:?set CKPT_DIRS to checkpoint folders}; do eval_checkpoints "$d" "$OUT/eval_${d##*/}" & done
  wait
  stamp "stage evaluate done"
}

case "$STAGE" in
  teacher) stage_teacher ;;
  retrofit) stage_retrofit ;;
  evaluate) stage_evaluate ;;
  *) echo "STAGE must be teacher, retrofit or evaluate, got $STAGE" >&2; exit 2 ;;
esac
