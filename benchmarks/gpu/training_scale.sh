#!/usr/bin/env bash
# Whole-model training step at real scale on one GPU (results/training_scale_h200.csv): benchmarks/training_scale.py with
# the Qwen3-8B shape (random bf16 weights), every row (lora_sft, lora_distill, kvpop_scorer_only, kvpop_distill
# with mlstm and mlp), a profiled step per row (component shares) and an allocator history of the mlstm
# kvpop_distill step; then the running top-k backends side by side (benchmarks/running_topk_speed.py).
# Usage: OUT=dir [SEQ_LENS=16384,32768] [ROWS=...] [STEPS=3] [LIMIT_S=540] bash benchmarks/gpu/training_scale.sh
# ROWS items are trainer[:scorer][@seq_len] (run in that order; without @ at every SEQ_LENS), e.g.
# ROWS=kvpop_distill:mlstm@65536,lora_distill@65536. A call adds its rows to the h200_qwen3-8b* files already in
# $OUT (a row of the same key replaces the old one).
# KVPOP_GIT_COMMIT names the commit in the results when the tree travels without its git history.
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=8
source benchmarks/gpu/lab_env.sh
SEQ_LENS=${SEQ_LENS:-16384,32768}
ROWS=${ROWS:-lora_sft,lora_distill,kvpop_scorer_only:mlstm,kvpop_distill:mlstm,kvpop_distill:mlp}
LIMIT_S=${LIMIT_S:-540}
mkdir -p "$OUT"
if [ "${TOPK_SPEED:-1}" = 1 ]; then
  timeout 90 python3 benchmarks/running_topk_speed.py --device cuda --seq-lens "${TOPK_LENS:-16384,32768,65536}" \
    --repeats 5 --out "$OUT/running_topk_speed.md" \
    > "$OUT/running_topk_speed.log" 2>&1
  echo "running_topk_speed exit $?"; tail -12 "$OUT/running_topk_speed.md"
fi
timeout "$LIMIT_S" python3 benchmarks/training_scale.py --shape qwen3-8b --seq-lens "$SEQ_LENS" --rows "$ROWS" \
  --steps "${STEPS:-3}" --profile --memory-snapshot "${SNAPSHOT:-kvpop_distill:mlstm@32768}" \
  --max-seconds $(( LIMIT_S - ${ROW_RESERVE_S:-150} )) \
  --out-prefix "$OUT/h200_qwen3-8b" > "$OUT/training_scale.log" 2>&1
echo "training_scale exit $?"
grep -E "@ |out of memory|error" "$OUT/training_scale.log" | tail -30
