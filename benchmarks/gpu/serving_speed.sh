#!/usr/bin/env bash
# Decode speed of hybrid models through model.generate (default cache against KVpopCache, compiled where generate
# compiles) and generate_batch against static batches, one GPU, random bf16 weights.
# Usage: OUT=dir [HYBRID_S=250] [GPTOSS_S=100] [BATCH_S=130] KVPOP_GIT_COMMIT=<commit> bash benchmarks/gpu/serving_speed.sh
# Writes $OUT/hybrid_generate_speed.csv, $OUT/generate_batch.{csv,md} and the logs; each part has its own limit
# and keeps the rows it finished.
set -u
: "${OUT:?set OUT to an output directory}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu/lab_env.sh
COMMIT="${KVPOP_GIT_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}"
H="${HYBRID_S:-250}"; G="${GPTOSS_S:-100}"; BT="${BATCH_S:-130}"
timeout "$H" python3 benchmarks/hybrid_generate_speed.py --shapes gemma3-12b --caches default kvpop \
  --contexts 32768 131072 --compile auto --prefill-chunk 8192 --new-tokens 32 --warmup 4 --deadline $((H - 40)) \
  --commit "$COMMIT" --out "$OUT/hybrid_generate_speed.csv" 2>&1 | tee "$OUT/hybrid_gemma.log"
timeout "$G" python3 benchmarks/hybrid_generate_speed.py --shapes gpt-oss-20b --caches default kvpop \
  --contexts 32768 --compile auto --prefill-chunk 1024 --new-tokens 32 --warmup 4 --deadline $((G - 40)) \
  --commit "$COMMIT" --out "$OUT/hybrid_generate_speed.csv" 2>&1 | tee "$OUT/hybrid_gptoss.log"
timeout "$BT" python3 benchmarks/generate_batch_speed.py --device cuda --shape qwen3-8b --requests 32 \
  --prompt-min 2048 --prompt-max 8192 --new-min 64 --new-max 512 --rows 16 --static-batch 16 \
  --staticcache-batch 0 --pass-prompts 2 --pass-n 8 --pass-new 256 --pass-rows 16 \
  --out-prefix "$OUT/generate_batch" 2>&1 | tee "$OUT/generate_batch.log"
