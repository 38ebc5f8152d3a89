#!/usr/bin/env bash
# One device call: (1) pretrain the testbed teacher, (2) training-speed benchmark (issue 3),
# (3) a short real retrofit of the new teacher (boundary loss / recall curve).
# Usage on the GPU machine: OUT=/some/dir bash benchmarks/gpu/call1_teacher_speed_retrofit.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. TOKENIZERS_PARALLELISM=false
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi -L
stamp teacher
python3 training/pretrain_teacher.py --out "$OUT/teacher" --steps 100000 --time-budget "${TEACHER_S:-300}" \
  --seq-len 2048:4096 --batch-size 16 --lr 2e-3 --warmup 200 --seed 0 --hidden 256 --layers 6 --heads 8 \
  --kv-heads 2 --head-dim 32 --intermediate 768 --knob reasoning.steps=3 --knob reasoning.n_facts=12 \
  --reasoning-weight 0.6 --curriculum-frac 0.5 --curriculum-len 256:768 --workers 6 --log-every 100 \
  --eval-n 40 --eval-batch-size 80 > "$OUT/teacher.log" 2>&1
tail -5 "$OUT/teacher.log"
stamp speed
timeout "${SPEED_S:-150}" python3 benchmarks/training_speed.py --out "$OUT/training_speed_gpu" > "$OUT/training_speed.log" 2>&1
tail -30 "$OUT/training_speed.log"
if [ "${RETRO:-1}" = 1 ]; then
stamp retrofit
RETRO="training/retrofit.py --model $OUT/teacher --dataset testbed:reasoning --seq_len 2048 --sinks 4 --window 64
  --topk 188 --scorer mlstm --output_dir $OUT/retro --max_steps ${RETRO_STEPS:-80} --per_device_train_batch_size 4
  --learning_rate 1e-4 --scorer_learning_rate 3e-3 --bf16 --logging_steps 5 --report_to none --save_strategy no
  --disable_tqdm True"
timeout "${RETRO_S:-150}" python3 $RETRO > "$OUT/retrofit.log" 2>&1 || {
  stamp "retrofit failed, retrying with torch fallbacks"; tail -20 "$OUT/retrofit.log"
  timeout 120 python3 $RETRO --attention_backend reference --target_backend chunked --max_steps 30 > "$OUT/retrofit_fallback.log" 2>&1; }
grep -o "{'loss'[^}]*}" "$OUT/retrofit.log" | head -40
fi
stamp pack
cd "$OUT" && tar czf teacher.tgz teacher && { [ -d retro ] && tar czf retro.tgz --exclude=model.safetensors retro; true; }; rm -rf teacher retro
ls -la "$OUT"
stamp done
