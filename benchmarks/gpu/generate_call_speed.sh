#!/usr/bin/env bash
# Decode through model.generate as a user calls it, on one H200 (Qwen3-8B shape, random bf16 weights):
# StaticCache and KVpopCache (knorm, mlp, mlstm) at 4k and 128k, batch 1, in two fresh processes sharing a
# compile cache (kvpop_hf.compile_cache), so the second process's first decode step shows what the cache saves.
# Batch rows at 32k: BATCH=1 (CONTEXTS="32768" BATCHES="1 8 32 64 128" STATIC_MAX_BATCH=8).
# Usage: OUT=dir [CONTEXTS="4096 131072"] [SCORERS="knorm mlp mlstm"] [LIMIT_S=590] bash benchmarks/gpu/generate_call_speed.sh
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout "${LIMIT_S:-590}" python3 benchmarks/generation_speed.py --via-generate --device cuda --shape qwen3-8b \
  --contexts ${CONTEXTS:-4096 131072} --batches ${BATCHES:-1} --scorers ${SCORERS:-knorm mlp mlstm} \
  --static-max-batch ${STATIC_MAX_BATCH:-1} --compile-reuse "${COMPILE_DIR:-/tmp/kvpop_compile_cache}" \
  --out-prefix "$OUT/h200_qwen3-8b_generate" 2>&1 | grep -v -i warn | tee "$OUT/generate_call_speed.log"
