#!/usr/bin/env bash
# One device call on nvidia-h200-x2 (the session's last):
#  1. two testbed teachers trained at 256-1024 tokens side by side (GPU0: reasoning only, GPU1: the family mix),
#  2. the better one retrofitted with KVpop (mLSTM) and KVpop_mlp at 75% and 88% of 1024 tokens,
#  3. kvpop-eval of every policy at both budgets (1024-token problems),
#  4. the issue-5 multi-GPU benchmark (1 GPU vs DDP vs FSDP2).
# Each stage packs its own outputs as soon as it ends, so a late stage running out of time loses only itself.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
TB=${TB:-130}; L=1024; W=32; TK88=87; TK75=220
teacher() {  # gpu name args...
  local gpu=$1 name=$2; shift 2
  CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=2 timeout $((TB + 70)) python3 training/pretrain_teacher.py \
    --out "$OUT/teacher_$name" --steps 1000000 --time-budget $TB --seq-len 256:$L --len-multiple 128 --warmup 150 \
    --seed 0 --workers 8 --log-every 250 --eval-n 20 --eval-batch-size 40 --lr 2e-3 --tokens-per-batch 32768 \
    --hidden 256 --layers 6 --heads 8 --kv-heads 2 --head-dim 32 --intermediate 768 "$@" > "$OUT/teacher_$name.log" 2>&1
  stamp "teacher $name exit $?"
}
teacher 0 reason --reasoning-weight 1.0 &
teacher 1 mix --reasoning-weight 0.6 &
wait
for n in reason mix; do grep -oE "step [0-9]+ loss [0-9.]+ .* it/s [0-9.]+" "$OUT/teacher_$n.log" | awk 'NR%3==1' | tail -4
  grep -E "trained|dense greedy EM" "$OUT/teacher_$n.log"; done
PICK=$(python3 - "$OUT" <<'PY'
import json, sys
em = {}
for n in ("reason", "mix"):
    try:
        em[n] = json.load(open(f"{sys.argv[1]}/teacher_{n}/manifest.json"))["eval"]["em"]["reasoning"]
    except Exception:
        em[n] = -1
print("mix" if em["mix"] >= 0.9 or em["mix"] >= em["reason"] else "reason")
PY
)
TEACHER="$OUT/teacher_$PICK"; stamp "picked teacher_$PICK"
mkdir -p "$OUT/teacher"; cp -r "$TEACHER"/. "$OUT/teacher/"
(cd "$OUT" && for n in reason mix; do [ -d teacher_$n ] && tar czf teacher_$n.tgz teacher_$n && rm -rf teacher_$n; done
 echo "$PICK" > picked.txt; tar czf teacher_logs.tgz teacher_*.log picked.txt; rm -f teacher_*.log picked.txt)
retro() {  # gpu name scorer topk
  local gpu=$1 name=$2 scorer=$3 topk=$4
  CUDA_VISIBLE_DEVICES=$gpu OMP_NUM_THREADS=4 timeout 95 python3 training/retrofit.py --model "$OUT/teacher" \
    --dataset testbed:reasoning --seq_len $L --sinks 4 --window $W --topk $topk --train_backbone False --scorer $scorer \
    --output_dir "$OUT/ckpt/$name" --max_steps 600 --num_examples 2400 --max_train_seconds ${RS:-45} \
    --per_device_train_batch_size 8 --learning_rate 1e-4 --scorer_learning_rate 3e-3 ${PREC:---bf16} --logging_steps 10 \
    --report_to none --save_strategy no --disable_tqdm True --seed 0 > "$OUT/retrofit_$name.log" 2>&1
  stamp "retrofit $name exit $?"; grep -o "{'loss'[^}]*}" "$OUT/retrofit_$name.log" | sed -n '1p;$p'
}
retro 0 kvpop_cr88 mlstm $TK88 & retro 0 kvpop_cr75 mlstm $TK75 &
retro 1 kvpop_mlp_cr88 mlp $TK88 & retro 1 kvpop_mlp_cr75 mlp $TK75 &
wait
stamp eval
CUDA_VISIBLE_DEVICES=0 timeout ${EVAL_S:-90} python3 -m kvpop_hf.testbed.evaluate --model "$OUT/teacher" --out "$OUT/eval" \
  --length $L --n ${EVAL_N:-30} --sinks 4 --window $W --budgets 0.75,0.88 \
  --policies dense,streaming,knorm,random,kvpop_mlp,kvpop --checkpoints-dir "$OUT/ckpt" \
  --batch-size 30 --analysis --analysis-n 2 --no-progress > "$OUT/eval.log" 2>&1
stamp "eval exit $?"; tail -30 "$OUT/eval.log"
(cd "$OUT" && for d in ckpt/*; do rm -f "$d/model.safetensors" "$d/training_args.bin"; done
 tar czf ckpt.tgz ckpt retrofit_*.log; tar czf eval.tgz eval eval.log; rm -rf teacher ckpt eval retrofit_*.log eval.log)
[ "${SKIP_MG:-0}" = 1 ] && exit 0; stamp multi-gpu
mkdir -p "$OUT/mg"; OUT="$OUT/mg" bash benchmarks/gpu/multi_gpu.sh > "$OUT/multi_gpu_stage.log" 2>&1
tail -30 "$OUT/multi_gpu_stage.log"
(cd "$OUT" && tar czf multi_gpu.tgz mg multi_gpu_stage.log && rm -rf mg multi_gpu_stage.log)
ls -la "$OUT"; stamp done
