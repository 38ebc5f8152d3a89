#!/usr/bin/env bash
# One device call: retrofit the testbed teacher (KVpop mLSTM at 88% and 75% compression, KVpop_mlp at 88%)
# on the reasoning family, then evaluate every policy at both budgets, then re-time the training layer ops.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
L=${L:-2048}; W=${W:-64}; TK88=${TK88:-178}; TK75=${TK75:-444}
retro() {  # name scorer topk seconds extra...
  local name=$1 scorer=$2 topk=$3 secs=$4; shift 4
  stamp "retrofit $name"
  local cmd="training/retrofit.py --model checkpoints/teacher --dataset testbed:reasoning --seq_len $L --sinks 4
    --window $W --topk $topk --train_backbone False --scorer $scorer --output_dir $OUT/ckpt/$name --max_steps 400 --num_examples 1600
    --max_train_seconds $secs --per_device_train_batch_size 4 --learning_rate 1e-4 --scorer_learning_rate 3e-3
    ${PREC:---bf16} --logging_steps 10 --report_to none --save_strategy no --disable_tqdm True --seed 0 $*"
  timeout $((secs + 60)) python3 $cmd > "$OUT/retrofit_$name.log" 2>&1 || {
    stamp "retrofit $name failed; torch fallbacks"; grep -E "Error|error" "$OUT/retrofit_$name.log" | tail -5
    timeout $((secs + 60)) python3 $cmd --attention_backend reference --target_backend chunked \
      > "$OUT/retrofit_${name}_fallback.log" 2>&1; }
  grep -o "{'loss'[^}]*}" "$OUT/retrofit_$name.log" | sed -n '1p;$p'
}
retro kvpop_cr88 mlstm $TK88 "${R1:-75}"
retro kvpop_mlp_cr88 mlp $TK88 "${R2:-45}"
retro kvpop_cr75 mlstm $TK75 "${R3:-45}"
stamp eval
timeout "${EVAL_S:-140}" python3 -m kvpop_hf.testbed.evaluate --model checkpoints/teacher --out "$OUT/eval" \
  --length $L --n "${EVAL_N:-10}" --sinks 4 --window $W --budgets 0.75,0.88 \
  --policies dense,streaming,knorm,random,kvpop_mlp,kvpop \
  --scorer-checkpoint kvpop@cr88=$OUT/ckpt/kvpop_cr88 --scorer-checkpoint kvpop@cr75=$OUT/ckpt/kvpop_cr75 \
  --scorer-checkpoint kvpop_mlp=$OUT/ckpt/kvpop_mlp_cr88 --batch-size 10 --analysis --analysis-n 2 --no-progress \
  > "$OUT/eval.log" 2>&1
tail -40 "$OUT/eval.log"
if [ "${SPEED_S:-0}" -gt 0 ]; then stamp speed
timeout "${SPEED_S}" python3 benchmarks/training_speed.py --out "$OUT/training_speed_gpu_bf16target" \
  --repeats 5 --warmup 2 > "$OUT/training_speed2.log" 2>&1; grep -E "target pass|\(c\)|\(b\) " "$OUT/training_speed2.log" | tail -8; fi
stamp pack
cd "$OUT" && for d in ckpt/*; do rm -f "$d/model.safetensors" "$d/training_args.bin"; done
tar czf ckpt.tgz ckpt; tar czf eval.tgz eval; tar czf logs.tgz *.log training_speed* 2>/dev/null
rm -rf ckpt eval retrofit_*.log training_speed*
ls -la
stamp done
