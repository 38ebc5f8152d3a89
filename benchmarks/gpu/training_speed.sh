#!/usr/bin/env bash
# Per-layer training-op timings on one GPU (results/training_layer_ops_h200.csv): the FlexAttention diagnostic
# (benchmarks/gpu/flex_diag.py: mask build vs kernel of the sparse student forward and the transposed target pass,
# against a plain compiled causal flex) and the per-layer training-speed table (benchmarks/training_speed.py:
# dense SDPA, running top-k, sparse forward/backward, target pass, materialised map at S = 4k and 16k, bf16,
# Qwen3-0.6B attention shapes).
# Writes $OUT/flex_diag.{md,log} and $OUT/training_speed_gpu.{md,csv} + $OUT/training_speed.log.
# Usage: OUT=dir bash benchmarks/gpu/training_speed.sh            (~5 min on one H200)
# The committed run used GPU 1 of a 2-GPU host while teacher recipes trained on GPU 0
# (benchmarks/gpu/teacher_recipe_sweep.sh, SET=G-J); CUDA_VISIBLE_DEVICES picks the GPU.
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=4
source benchmarks/gpu/lab_env.sh
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p "$OUT"
stamp "flex_diag"
timeout 170 python3 benchmarks/gpu/flex_diag.py --out "$OUT/flex_diag" > "$OUT/flex_diag.log" 2>&1
stamp "flex_diag exit $?"
timeout 150 python3 benchmarks/training_speed.py --out "$OUT/training_speed_gpu" > "$OUT/training_speed.log" 2>&1
stamp "training_speed exit $?"
grep -E "target pass|Ratio|FAILS|HOLDS" "$OUT/training_speed_gpu.md" | head -12
tail -25 "$OUT/flex_diag.log"
