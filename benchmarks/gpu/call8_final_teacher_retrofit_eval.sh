#!/usr/bin/env bash
# Session 3, call 3 (one H200). Input: INIT=<teacher folder> -- call 2's teacher B (fact lookup learned, EM 1.0
# below 896 tokens, 0.1 at exactly 1024: the old length sampler almost never drew the top of the range, so
# positions 896-1023 were unseen; fixed in pretrain_teacher.batch_length).
#  1. continue it at 256-1152 tokens (uniform over multiples of 128), every family: reasoning 0.4, drill 0.2,
#     the four RULER families 0.1 each; lr 7e-4
#  2. dense kvpop-eval on 30 reasoning problems of 1024 tokens
#  3. retrofit KVpop (mLSTM) and KVpop_mlp at 75% and 88% of 1024 tokens (scorer only, reasoning only)
#  4. kvpop-eval of every policy at both budgets on all five families (1024 tokens), in the time left
# Usage: INIT=out/t_B OUT=dir TB=210 bash benchmarks/gpu/call8_final_teacher_retrofit_eval.sh   (~9 min)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. TOKENIZERS_PARALLELISM=false
TB=${TB:-210}; L=1024; W=32; TK88=87; TK75=220; DEADLINE=${DEADLINE:-560}
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
TEACHER="$OUT/teacher"
OMP_NUM_THREADS=2 timeout $((TB + 80)) python3 training/pretrain_teacher.py --out "$TEACHER" --init-from "$INIT" \
  --steps 1000000 --time-budget $TB --seq-len 256:1152 --len-multiple 128 --warmup 100 --lr 7e-4 --seed 2 \
  --workers 12 --log-every 250 --probe-every 250 --probe-n 16 --probe-len $L --eval-n 30 --eval-batch-size 60 \
  --tokens-per-batch 32768 --knob lookup.n_facts=16 --reasoning-weight 0.4 --lookup-weight 0.2 \
  > "$OUT/teacher.log" 2>&1
stamp "teacher exit $?"; grep -E "trained|dense greedy EM" "$OUT/teacher.log"; grep -E "^probe step" "$OUT/teacher.log" | tail -3
timeout 100 python3 -m kvpop_hf.testbed.evaluate --model "$TEACHER" --out "$OUT/eval_dense" \
  --length $L --n 30 --families reasoning --in-domain reasoning --policies dense --budgets 0.75 --window $W \
  --batch-size 30 --no-progress > "$OUT/eval_dense.log" 2>&1
stamp "dense eval exit $?"; grep -E "^\| dense" "$OUT/eval_dense/table1.md"
retro() {  # name scorer topk
  local name=$1 scorer=$2 topk=$3
  OMP_NUM_THREADS=3 timeout 150 python3 training/retrofit.py --model "$TEACHER" \
    --dataset testbed:reasoning --seq_len $L --sinks 4 --window $W --topk $topk --train_backbone False --scorer $scorer \
    --output_dir "$OUT/ckpt/$name" --max_steps 1000 --num_examples 4000 --max_train_seconds ${RS:-70} \
    --per_device_train_batch_size 8 --learning_rate 1e-4 --scorer_learning_rate 3e-3 --bf16 --logging_steps 10 \
    --report_to none --save_strategy no --disable_tqdm True --seed 0 > "$OUT/retrofit_$name.log" 2>&1
  stamp "retrofit $name exit $?"; grep -o "{'loss'[^}]*}" "$OUT/retrofit_$name.log" | sed -n '$p' | cut -c1-200
}
retro kvpop_cr88 mlstm $TK88 & retro kvpop_cr75 mlstm $TK75 &
retro kvpop_mlp_cr88 mlp $TK88 & retro kvpop_mlp_cr75 mlp $TK75 &
wait
for d in "$OUT"/ckpt/*; do rm -f "$d/model.safetensors" "$d/training_args.bin"; done
(cd "$OUT" && tar czf ckpt.tgz ckpt retrofit_*.log && rm -f retrofit_*.log)
LEFT=$(( DEADLINE - ($(date +%s) - T0) )); stamp "full eval with ${LEFT}s"
if [ $LEFT -gt 30 ]; then
  timeout $LEFT python3 -m kvpop_hf.testbed.evaluate --model "$TEACHER" --out "$OUT/eval" --length $L --n ${EVAL_N:-20} \
    --sinks 4 --window $W --budgets 0.75,0.88 --policies dense,streaming,knorm,random,kvpop_mlp,kvpop \
    --checkpoints-dir "$OUT/ckpt" --batch-size 40 > "$OUT/eval.log" 2>&1
  stamp "full eval exit $?"; tail -n 22 "$OUT/eval.log" | grep -E "^\|"
fi
cd "$OUT"
tar czf teacher.tgz teacher && rm -rf teacher ckpt
tar czf logs.tgz teacher.log eval_dense eval_dense.log eval eval.log 2>/dev/null; rm -rf teacher.log eval_dense eval_dense.log eval eval.log
ls -la; stamp done
