#!/usr/bin/env bash
# StreamingLLM+ on the CPU testbed (KVpop, arXiv:2607.05061): sinks + window only (k = 0, scorer "streaming"),
# the teacher's LoRA backbone distilled at each budget, merged and saved under checkpoints/streaming_plus_cr<NN>.
#   STEPS=64 bash benchmarks/streaming_plus_cpu.sh train    # three retrofits, logs in results/streaming_plus_cpu/
#   bash benchmarks/streaming_plus_cpu.sh eval              # kvpop-eval of streaming and streaming_plus
# OUT (results folder) and CKPTS (folder of the streaming_plus_cr<NN> models) change where they go.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/streaming_plus_cpu}
CKPTS=${CKPTS:-checkpoints}
STEPS=${STEPS:-64}
PY=${PYTHON:-python}
TEACHER=${TEACHER:?set TEACHER to a 1024-token testbed teacher (benchmarks/gpu/pretrain_teacher.sh writes one)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
mkdir -p "$OUT"
if [[ "${1:-train}" == train ]]; then
  for pair in 75:252 88:119 94:57; do
    cr=${pair%%:*}; w=${pair##*:}
    nice -n 10 "$PY" training/retrofit.py --model "$TEACHER" --dataset testbed:reasoning --seq_len 1024 \
      --sinks 4 --window "$w" --topk 0 --scorer streaming --lora_rank 8 --merge_lora True \
      --output_dir "$CKPTS/streaming_plus_cr$cr" --max_steps "$STEPS" --per_device_train_batch_size 2 \
      --learning_rate 1e-3 --logging_steps 8 --report_to none --save_strategy no --seed 0 --disable_tqdm True \
      --use_cpu 2>&1 | grep -v "Loading weights\|Writing model" | tee "$OUT/train_cr$cr.log"
  done
else
  nice -n 10 "$PY" -m kvpop_lab.testbed.evaluate --model "$TEACHER" --out "$OUT" --length 1024 --n 10 \
    --families reasoning --in-domain reasoning --sinks 4 --window 32 --compression 0.75,0.88,0.94 \
    --policies dense,streaming,streaming_plus --checkpoints-dir "$CKPTS" --batch-size 10 --device cpu --no-progress
fi
