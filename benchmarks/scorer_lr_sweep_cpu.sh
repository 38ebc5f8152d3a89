#!/usr/bin/env bash
# Scorer variants of a scorer-only retrofit, on CPU: learning rate, delayed or immediate mLSTM readout, forget-gate
# bias. Retrofits of checkpoints/testbed-4k-teacher at 1024 tokens (the 4k testbed's knobs: 10 facts, 4 rules), compression
# CR (default 0.88: B = 123 = 4 + W + K), max target of the answer's queries, constant learning rate as in the GPU
# runs made before --lr_decay_by_time (their linear decay spanned 100000 steps); then kvpop-eval --analysis on
# held-out problems (oracle top-k recall against the max answer-query oracle, token and fact-lookup accuracy).
# Usage (torch installed, e.g. the README's venv active): OUT=results/scorer_lr_cpu bash benchmarks/scorer_lr_sweep_cpu.sh
#        RUNS="mlstm:3e-3 mlstm:1e-2 mlstm:3e-2 mlp:3e-3" STEPS=150 EVAL_N=8 W=32 CR=0.88 (the defaults)
# A run is scorer:lr[:option], option one of immediate (the mLSTM reads a token's score right after absorbing it,
# the paper's no-delay ablation), fb<x> (the mLSTM forget gate's initial bias, default 3), tok (the mLSTM readout's
# term of the read token's own features, token_readout) or ds<n> (the mLSTM state_dim, default 32):
# mlstm_kwargs of benchmarks/mlstm_options.sh.
set -u
: "${OUT:?set OUT to an output directory}"
export TOKENIZERS_PARALLELISM=false
source benchmarks/gpu/lab_env.sh
# shellcheck source=benchmarks/mlstm_options.sh
source "$(dirname "$0")/mlstm_options.sh"
STEPS=${STEPS:-150}; N=${EVAL_N:-8}; L=1024; W=${W:-32}; CR=${CR:-0.88}
B=$(python3 -c "print(round((1 - $CR) * $L))"); K=$((B - 4 - W))
RUNS=${RUNS:-mlstm:3e-3 mlstm:1e-2 mlstm:3e-2 mlp:3e-3}
mkdir -p "$OUT"
parse() {  # run -> SCORER LR NAME KW POL
  local opt=""
  IFS=: read -r SCORER LR opt <<< "$1"
  KW=$(mlstm_kwargs "$opt") || { echo "unknown option $opt in $1" >&2; exit 2; }
  [ "$SCORER" = mlp ] && [ -z "$opt" ] && KW='{}'  # the options are the mLSTM's
  NAME="${SCORER}_lr${LR}${opt:+_$opt}"
  POL=kvpop; [ "$opt" = immediate ] && POL=kvpop_immediate; [ "$SCORER" = mlp ] && POL=kvpop_mlp
}
for run in $RUNS; do
  parse "$run"
  python3 training/retrofit.py --model checkpoints/testbed-4k-teacher --dataset testbed:reasoning \
    --knob reasoning.n_facts=10 reasoning.steps=4 --seq_len $L --sinks 4 --window "$W" --topk $K --scorer "$SCORER" \
    --scorer_kwargs "$KW" --train_backbone False --learning_rate 1e-4 --scorer_learning_rate "$LR" \
    --lr_scheduler_type constant --output_dir "$OUT/ckpt/$NAME" --max_steps "$STEPS" --num_examples $((STEPS * 4)) \
    --per_device_train_batch_size 4 --target_queries labels --logging_steps 10 --report_to none --save_strategy no \
    --disable_tqdm True --use_cpu True --seed 0 > "$OUT/retrofit_$NAME.log" 2>&1
  echo "$NAME exit $?: $(grep -o "'target_topk_recall': '[0-9.]*'" "$OUT/retrofit_$NAME.log" | tail -1)"
done
# one evaluation per checkpoint (a policy name takes one checkpoint per budget)
for run in $RUNS; do
  parse "$run"
  python3 -m kvpop_lab.testbed.evaluate --model checkpoints/testbed-4k-teacher --out "$OUT/eval_$NAME" --length $L --n "$N" \
    --families reasoning --in-domain reasoning --knob reasoning.n_facts=10 --knob reasoning.steps=4 --sinks 4 \
    --window "$W" --compression "$CR" --policies "$POL" --scorer-checkpoint "$POL=$OUT/ckpt/$NAME" --skip-em \
    --analysis --analysis-n "$N" --oracle-kind max --oracle-queries target --batch-size "$N" --device cpu \
    --no-progress > "$OUT/eval_$NAME.log" 2>&1
  echo "eval $NAME exit $?"
done
