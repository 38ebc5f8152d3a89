#!/usr/bin/env bash
# KVpopCache with Qwen3-8B shapes (random bf16 weights) split across two GPUs (accelerate dispatch: first
# half of the layers on cuda:0, the rest on cuda:1) against the same model on cuda:0: greedy tokens,
# prefill seconds, decode ms/token, and where each layer's cache and scorer copy live.
# Usage (needs the nvidia-h200-x2 machine): OUT=dir bash benchmarks/gpu/split_model_generation.sh
set -u
export PYTHONUNBUFFERED=1
source benchmarks/gpu/lab_env.sh
timeout ${LIMIT_S:-560} python benchmarks/split_model_generation.py --devices cuda:0 cuda:1 --shape qwen3-8b \
  --context ${CONTEXT:-32768} --new-tokens 40 --warmup 8 ${COMPILED:---compiled} \
  --out-prefix "$OUT/split_model_generation" 2>&1 | grep -v -i warn | tee "$OUT/split_model_generation.log"
