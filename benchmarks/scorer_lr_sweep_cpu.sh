#!/usr/bin/env bash
# Scorer learning rate of a scorer-only retrofit, on CPU: does the mLSTM scorer learn faster with a larger step?
# Retrofits of checkpoints/teacher_4k at 1024 tokens (the 4k testbed's knobs: 10 facts, 4 rules), 88% compression
# (B = 123 = 4 + 32 + 87), max target of the answer's queries, constant learning rate as in the GPU runs (their
# linear decay spans 100000 steps); then kvpop-eval --analysis on held-out problems (oracle top-k recall against the
# max answer-query oracle, token and fact-lookup accuracy).
# Usage (torch installed, e.g. the README's venv active): OUT=results/scorer_lr_cpu bash benchmarks/scorer_lr_sweep_cpu.sh
#        RUNS="mlstm:3e-3 mlstm:1e-2 mlstm:3e-2 mlp:3e-3" STEPS=150 EVAL_N=8 (the defaults)
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONPATH=. TOKENIZERS_PARALLELISM=false
STEPS=${STEPS:-150}; N=${EVAL_N:-8}; L=1024; W=32; K=87
mkdir -p "$OUT"
for run in ${RUNS:-mlstm:3e-3 mlstm:1e-2 mlstm:3e-2 mlp:3e-3}; do
  scorer=${run%%:*}; lr=${run##*:}; name=${scorer}_lr${lr}
  python3 training/retrofit.py --model checkpoints/teacher_4k --dataset testbed:reasoning \
    --knob reasoning.n_facts=10 reasoning.steps=4 --seq_len $L --sinks 4 --window $W --topk $K --scorer "$scorer" \
    --train_backbone False --learning_rate 1e-4 --scorer_learning_rate "$lr" --lr_scheduler_type constant \
    --output_dir "$OUT/ckpt/$name" --max_steps "$STEPS" --num_examples $((STEPS * 4)) --per_device_train_batch_size 4 \
    --target_queries labels --logging_steps 10 --report_to none --save_strategy no --disable_tqdm True --use_cpu True \
    --seed 0 > "$OUT/retrofit_$name.log" 2>&1
  echo "$name exit $?: $(grep -o "'teacher_topk_recall': '[0-9.]*'" "$OUT/retrofit_$name.log" | tail -1)"
  rm -f "$OUT/ckpt/$name/model.safetensors" "$OUT/ckpt/$name/training_args.bin"  # the unchanged teacher
done
# one evaluation per checkpoint (a policy name takes one checkpoint per budget)
for run in ${RUNS:-mlstm:3e-3 mlstm:1e-2 mlstm:3e-2 mlp:3e-3}; do
  scorer=${run%%:*}; lr=${run##*:}; name=${scorer}_lr${lr}
  pol=$([ "$scorer" = mlp ] && echo kvpop_mlp || echo kvpop)
  python3 -m kvpop_hf.testbed.evaluate --model checkpoints/teacher_4k --out "$OUT/eval_$name" --length $L --n "$N" \
    --families reasoning --in-domain reasoning --knob reasoning.n_facts=10 --knob reasoning.steps=4 --sinks 4 \
    --window $W --budgets 0.88 --policies "$pol" --scorer-checkpoint "$pol=$OUT/ckpt/$name" --skip-em \
    --analysis --analysis-n "$N" --oracle-kind max --oracle-queries target --batch-size "$N" --device cpu \
    --no-progress > "$OUT/eval_$name.log" 2>&1
  echo "eval $name exit $?"
done
