#!/usr/bin/env bash
# Does a learned scorer keep another task family's answers when that family is in its retrofit data? On the
# 1024-token testbed, whose teacher (TEACHER, required: the 1024-token teacher of benchmarks/gpu/pretrain_teacher.sh) solves reasoning and variable tracking (vt), two KVpop
# retrofits side by side for RS seconds each: on reasoning problems only, and on reasoning and vt alternating
# (retrofit.py --dataset testbed:reasoning,vt). Both: delayed mLSTM with the token term, distilled with a rank-8 LoRA
# merged afterwards, max answer-query target, 88%, window 32, learning rate decaying over the seconds. Then
# kvpop-eval of both beside dense, StreamingLLM, LagKV and SnapKV on EVAL_N fresh problems of each family at 75%
# and 88%.
#   -> $OUT/ckpt_<arm>/kvpop_distill_cr88, $OUT/retrofit_<arm>.log, $OUT/eval_<arm>/ (kvpop-eval folders; the
#      baselines are in the first arm's), $OUT/eval_<arm>.log; the arms are reasoning and mix unless ARMS says
# Usage: OUT=dir bash benchmarks/gpu/retrofit_data_mix.sh                      (~4 min on one H200)
# Knobs: RS (training seconds, 110), EVAL_N (problems per family, 40), SEED_BASE (2^48 + 5000), DEVICE (cuda),
# ARMS (the retrofits, "name:families:scorer[:knobs] ...", scorer tok = delayed mLSTM with the token term or plain =
# the paper's delayed mLSTM, knobs = generator knobs of the retrofit problems joined by "+", e.g.
# reasoning.distractor_density=0+reasoning.n_facts=20; the evaluation problems keep the defaults; default
# "reasoning:reasoning:tok mix:reasoning,vt:tok"), EVAL_COMPRESSION (the evaluated compression ratios, 0.75,0.88),
# BASELINES (evaluated beside the first arm, dense,streaming,lagkv,snapkv); a CPU smoke test: DEVICE=cpu RS=5
# EVAL_N=2 NEX=8.
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source benchmarks/gpu/lab_env.sh
T=${TEACHER:?set TEACHER to a 1024-token testbed teacher (benchmarks/gpu/pretrain_teacher.sh writes one)}; L=1024; W=32; RS=${RS:-110}; N=${EVAL_N:-40}; DEVICE=${DEVICE:-cuda}
SEED_BASE=${SEED_BASE:-$((2 ** 48 + 5000))}
if [ "$DEVICE" = cpu ]; then TRAIN_DEV="--use_cpu True"; else TRAIN_DEV="--bf16"; fi
NAMES=(); FAMS=(); SCORERS=(); KNOBS=()
for arm in ${ARMS:-"reasoning:reasoning:tok mix:reasoning,vt:tok"}; do  # parsed and checked before any work
  IFS=: read -r name fams scorer knobs <<< "$arm"
  if [ -z "$name" ] || [ -z "$fams" ] || { [ "$scorer" != tok ] && [ "$scorer" != plain ]; }; then
    echo "ARMS entry '$arm' must be name:families:scorer[:knobs] with scorer tok or plain (e.g." \
      "rplain:reasoning:plain)" >&2
    exit 2
  fi
  if [ -n "$knobs" ] && ! python3 -c "import sys; from kvpop_lab.testbed.evaluate import parse_knobs as p
p(sys.argv[1].split('+'))" "$knobs" 2> /dev/null; then
    echo "ARMS entry '$arm': its knobs must be FAMILY.KEY=VALUE items joined by + (e.g." \
      "reasoning.distractor_density=0+reasoning.n_facts=20)" >&2
    exit 2
  fi
  NAMES+=("$name"); FAMS+=("$fams"); SCORERS+=("$scorer"); KNOBS+=("${knobs//+/ }")
done
[ -f "$T/config.json" ] || { echo "TEACHER=$T holds no model (config.json)" >&2; exit 2; }
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
K88=$(python3 -c "from kvpop_hf.policies import parse_budgets as p
print(p(compression='0.88', length=$L, sinks=4, window=$W)[0].topk)") \
  || { echo "python3 cannot import kvpop_hf" >&2; exit 2; }
mkdir -p "$OUT"

retro() {  # name families scorer knobs
  local kw='{"token_readout": true}'; [ "$3" = plain ] && kw='{"token_readout": false}'
  local knob=(); [ -n "$4" ] && knob=(--knob $4)
  OMP_NUM_THREADS=2 timeout $((RS + 150)) python3 training/retrofit.py --model $T --dataset "testbed:$2" --seq_len $L \
    --sinks 4 --window $W --topk "$K88" --scorer mlstm --scorer_kwargs "$kw" \
    --train_backbone True --lora_rank 8 --merge_lora True --distill_weight 1.0 --learning_rate 1e-3 \
    --scorer_learning_rate 3e-3 --target_reduce max --target_queries labels --max_train_seconds "$RS" \
    --lr_decay_by_time True --per_device_train_batch_size 8 --num_examples "${NEX:-4000}" --max_steps 100000 \
    --output_dir "$OUT/ckpt_$1/kvpop_distill_cr88" --logging_steps 10 --report_to none --save_strategy no \
    --disable_tqdm True --seed 0 "${knob[@]}" $TRAIN_DEV > "$OUT/retrofit_$1.log" 2>&1
  local rc=$?; stamp "retrofit $1 ($2) exit $rc"
  grep -o "{'loss'[^}]*}" "$OUT/retrofit_$1.log" | sed -n '$p' | cut -c1-200
}
for i in "${!NAMES[@]}"; do retro "${NAMES[$i]}" "${FAMS[$i]}" "${SCORERS[$i]}" "${KNOBS[$i]}" & done
wait
evaluate() {  # arm policies
  timeout 300 python3 -m kvpop_lab.testbed.evaluate --model $T --out "$OUT/eval_$1" --length $L --n "$N" \
    --seed-base "$SEED_BASE" --families vt,reasoning --in-domain reasoning --sinks 4 --window $W --compression "${EVAL_COMPRESSION:-0.75,0.88}" \
    --policies "$2" --scorer-checkpoint "kvpop_distill=$OUT/ckpt_$1/kvpop_distill_cr88" --batch-size 40 \
    --device "$DEVICE" --no-progress > "$OUT/eval_$1.log" 2>&1
  stamp "eval $1 exit $?"
}
FIRST_POLICIES=${BASELINES-dense,streaming,lagkv,snapkv}
FIRST_POLICIES=${FIRST_POLICIES:+$FIRST_POLICIES,}kvpop_distill
for i in "${!NAMES[@]}"; do
  if [ "$i" = 0 ]; then evaluate "${NAMES[0]}" "$FIRST_POLICIES" & else evaluate "${NAMES[$i]}" dense,kvpop_distill & fi
done
wait
for f in "$OUT"/eval_*/table[12].md; do echo "== $f"; grep -E "^\| [a-z]" "$f"; done
