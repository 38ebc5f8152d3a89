#!/usr/bin/env bash
# Long-context generation speed and memory on one H200: Qwen3-8B shapes with random bf16 weights, dense
# caches (DynamicCache eager, StaticCache + torch.compile) against KVpopCache (eager and compiled decoding).
# Usage: OUT=dir bash benchmarks/gpu/generation_speed.sh   (about 8 minutes: most of it is torch.compile)
# The committed run (results/generation_speed/h200_qwen3-8b.*) used these defaults; its files were written under
# another output prefix and renamed, and its 128k rows were taken from the log (see the .md).
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout ${LIMIT_S:-470} python benchmarks/generation_speed.py --device cuda --shape qwen3-8b \
  --contexts ${CONTEXTS:-4096 131072} --static-contexts 4096 131072 --static-synthetic 131072 \
  --scorers ${SCORERS:-mlstm knorm} --profile-prefill --profile-decode --leak-caches ${LEAK:-30} \
  --out-prefix "$OUT/generation_speed" 2>&1 | tee "$OUT/generation_speed.log"
