#!/usr/bin/env bash
# Prepared for the next session (not run yet): the mission's long-context speed/memory comparison on one H200.
# A random-init Qwen3-0.6B shape (28 layers, hidden 1024, 16 query / 8 KV heads of 128), bf16, contexts
# 8k / 32k / 128k: DynamicCache (sdpa) vs KVpopCache (knorm, mlstm) at B = 4 + 256 + 1788 = 2048 entries
# per head; chunked prefill, then decode steps measured side by side (benchmarks/cache_speed.py).
# Usage: OUT=dir bash benchmarks/gpu/long_context_128k.sh   (budget ~6 min; each stage guarded by timeout)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
SHAPE="--hidden 1024 --intermediate 3072 --layers 28 --heads 16 --kv-heads 8 --head-dim 128 --vocab 32000"
timeout ${LC_S:-330} python3 benchmarks/cache_speed.py --device cuda --dtype bfloat16 \
  --contexts ${CONTEXTS:-8192 32768 131072} --steps 32 --repeats 5 --warmup 4 --prefill-chunk ${CHUNK:-4096} \
  --sinks 4 --window 256 --topk 1788 --scorers knorm mlstm $SHAPE --out-prefix "$OUT/cache_speed_h200" \
  > "$OUT/cache_speed_h200.log" 2>&1
stamp "cache_speed exit $?"; tail -25 "$OUT/cache_speed_h200.log"
ls -la "$OUT"
