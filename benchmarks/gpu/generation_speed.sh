#!/usr/bin/env bash
# Long-context decode speed and memory on one H200: Qwen3-8B shapes with random bf16 weights, dense caches
# (DynamicCache eager, StaticCache + torch.compile) against KVpopCache with every scorer (eager and compiled
# decoding), then the 100-cache leak check. Usage: OUT=dir bash benchmarks/gpu/generation_speed.sh
# About 9 minutes, most of it torch.compile (about 40-55 s per StaticCache length, 75-130 s per KVpop scorer;
# later contexts reuse the graph), so a third scorer needs its own run (SCORERS=mlp). Rows are written as
# they finish, so a run cut by LIMIT_S keeps them.
# Prefill at more contexts, with repeats, and the batch rows: benchmarks/gpu/prefill_speed.sh.
set -u
export PYTHONUNBUFFERED=1
source benchmarks/gpu/lab_env.sh
timeout ${LIMIT_S:-590} python3 benchmarks/generation_speed.py --device cuda --shape qwen3-8b \
  --contexts ${CONTEXTS:-4096 131072} --static-contexts 4096 131072 --static-synthetic 131072 \
  --scorers ${SCORERS:-mlstm knorm} --profile-decode --leak-caches ${LEAK:-100} \
  --out-prefix "$OUT/generation_speed" 2>&1 | grep -v -i warn | tee "$OUT/generation_speed.log"
