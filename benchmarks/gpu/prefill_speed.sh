#!/usr/bin/env bash
# Chunked prefill, dense sdpa vs KVpopCache (16k-token chunks, median of 3 after a warm-up, profile of one
# chunk per scorer), then decode throughput at batch 8 and 32 at 32k tokens (caches filled synthetically;
# dense rows say where they run out of memory). Usage: OUT=dir bash benchmarks/gpu/prefill_speed.sh
# About 9 minutes: the batch rows compile the decode step once per batch size.
set -u
export PYTHONUNBUFFERED=1
source benchmarks/gpu/lab_env.sh
timeout ${LIMIT_PREFILL_S:-200} python3 benchmarks/generation_speed.py --device cuda --shape qwen3-8b \
  --contexts ${CONTEXTS:-16384 32768 65536} --rows dynamic kvpop --scorers knorm mlp mlstm --prefill-only \
  --prefill-repeats 3 --profile-prefill --out-prefix "$OUT/prefill_speed" 2>&1 | grep -v -i warn \
  | tee "$OUT/prefill_speed.log"
timeout ${LIMIT_BATCH_S:-380} python3 benchmarks/generation_speed.py --device cuda --shape qwen3-8b \
  --contexts 4096 --rows dynamic static kvpop --static-contexts --scorers mlstm --prefill-only \
  --batches ${BATCHES:-8 32} --batch-context 32768 --out-prefix "$OUT/batch_speed" 2>&1 | grep -v -i warn \
  | tee "$OUT/batch_speed.log"
