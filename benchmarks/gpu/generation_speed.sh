#!/usr/bin/env bash
# Long-context generation speed and memory on one H200: Qwen3-8B shapes with random bf16 weights, dense
# caches (DynamicCache eager, StaticCache + torch.compile) against KVpopCache (eager and compiled decoding).
# Usage: OUT=dir bash benchmarks/gpu/generation_speed.sh
# About 9 minutes with the defaults, most of it torch.compile (about 30 s for StaticCache, 75-120 s per
# KVpop scorer); rows are written as they finish, so a run cut by LIMIT_S keeps what it measured.
# The committed run (results/generation_speed/h200_qwen3-8b.*) used these defaults under LIMIT_S=545
# (it stopped before the leak check) with --out-prefix $OUT/gs; its files were renamed.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=.
timeout ${LIMIT_S:-590} python benchmarks/generation_speed.py --device cuda --shape qwen3-8b \
  --contexts ${CONTEXTS:-4096 131072 32768} --static-contexts 4096 131072 --static-synthetic 131072 \
  --scorers ${SCORERS:-mlstm knorm} --profile-decode --leak-caches ${LEAK:-100} \
  --out-prefix "$OUT/generation_speed" 2>&1 | grep -v -i warn | tee "$OUT/generation_speed.log"
