#!/usr/bin/env bash
# kvpop-eval of every policy (dense, StreamingLLM, K-Norm, Random, KVpop_mlp, KVpop) at 75% and 88% compression on
# all five testbed families (reasoning, vt, niah_multikey, cwe, fwe), EVAL_N problems of 1024 tokens each, on one
# GPU: Table 1 (reasoning) and Table 2 (the other families), results.csv, outputs.jsonl, quality-vs-budget plot.
# Writes $OUT/eval/ and $OUT/eval.log.
# Usage: OUT=dir TEACHER=dir/final/teacher SCORERS=dir/ckpt bash benchmarks/gpu/evaluate_testbed.sh
# Knobs: TEACHER (required: a 1024-token teacher), SCORERS (required: a folder of scorer checkpoints,
# benchmarks/gpu/retrofit_scorers.sh writes one), EVAL_N (default 20), LIMIT_S (time limit, default 300 s).
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source benchmarks/gpu/lab_env.sh
TEACHER=${TEACHER:?set TEACHER to a 1024-token testbed teacher (benchmarks/gpu/pretrain_teacher.sh writes one)}; SCORERS=${SCORERS:?set SCORERS to a folder of scorer checkpoints}; L=1024; W=32
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p "$OUT"
timeout ${LIMIT_S:-300} python3 -m kvpop_lab.testbed.evaluate --model "$TEACHER" --out "$OUT/eval" --length $L \
  --n ${EVAL_N:-20} --sinks 4 --window $W --compression 0.75,0.88 --policies dense,streaming,knorm,random,kvpop_mlp,kvpop \
  --checkpoints-dir "$SCORERS" --batch-size 40 > "$OUT/eval.log" 2>&1
stamp "eval exit $?"; tail -n 22 "$OUT/eval.log" | grep -E "^\|"
