#!/usr/bin/env bash
# DMS on the CPU testbed (learned per-head eviction gates, delayed eviction, ragged memory; kvpop_hf/baselines/dms):
# the teacher's LoRA backbone distilled with the gate at each target compression, merged and saved under
# checkpoints/dms_cr<NN> (a model directory with dms_config.json + dms_gate.safetensors).
#   STEPS=80 bash benchmarks/dms_cpu.sh train    # three trainings, logs in results/dms_cpu/
#   bash benchmarks/dms_cpu.sh eval              # kvpop-eval of dms (+ compression.json), then the heatmap
# OUT (results folder) and CKPTS (folder of the dms_cr<NN> models) change where they go; PENALTY=two_sided holds the
# eviction rate at the target (default one_sided, DMS's max(0, target - mean alpha)); WEIGHT: its weight (10);
# RAMP: the fraction of the steps over which the target rate ramps up (0.5).
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-results/dms_cpu}
CKPTS=${CKPTS:-checkpoints}
STEPS=${STEPS:-80}
PENALTY=${PENALTY:-one_sided}
WEIGHT=${WEIGHT:-10}
RAMP=${RAMP:-0.5}
PY=${PYTHON:-python}
TEACHER=${TEACHER:?set TEACHER to a 1024-token testbed teacher (benchmarks/gpu/pretrain_teacher.sh writes one)}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}
mkdir -p "$OUT"
if [[ "${1:-train}" == train ]]; then
  for cr in 75 88 94; do
    nice -n 10 "$PY" training/train_dms.py --model "$TEACHER" --dataset testbed:reasoning --seq_len 1024 \
      --compression "0.$cr" --sinks 4 --window 32 --lora_rank 8 --penalty "$PENALTY" --compression_weight "$WEIGHT" \
      --ramp_fraction "$RAMP" --output_dir "$CKPTS/dms_cr$cr" \
      --max_steps "$STEPS" --per_device_train_batch_size 2 --learning_rate 1e-3 --logging_steps 8 --report_to none \
      --save_strategy no --seed 0 --disable_tqdm True --use_cpu 2>&1 | grep -v "Loading weights\|Writing model" \
      | tee "$OUT/train_cr$cr.log"
  done
else
  nice -n 10 "$PY" -m kvpop_lab.testbed.evaluate --model "$TEACHER" --out "$OUT" --length 1024 --n 10 \
    --families reasoning --in-domain reasoning --sinks 4 --window 32 --compression 0.75,0.88,0.94 --policies dms \
    --scorer-checkpoint "dms@cr75=$CKPTS/dms_cr75" --scorer-checkpoint "dms@cr88=$CKPTS/dms_cr88" \
    --scorer-checkpoint "dms@cr94=$CKPTS/dms_cr94" --batch-size 10 --device cpu --no-progress
  "$PY" -m kvpop_hf.baselines.dms.heatmap "$OUT/compression.json" "$OUT/eviction_ratio_heatmap.png"
fi
