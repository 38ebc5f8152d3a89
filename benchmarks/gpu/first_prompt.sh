#!/usr/bin/env bash
# The first and second prompt of a fresh process (Qwen3-8B shape, random bf16 weights, one GPU): KVpop's default
# path (prefill_in_chunks + generate), its fastest path (fused projections + run-ahead loop) and StaticCache, each in
# a process with empty compile caches (cold) and in a second one on the caches the first filled (warm).
# Usage: OUT=dir [CONTEXTS="32768 131072"] [PATHS="default fastest static"] [PROCESSES="cold warm"] [LIMIT_S=560]
#        bash benchmarks/gpu/first_prompt.sh
# Writes $OUT/first_prompt.csv (one row per prompt, with device, command, commit and date) and the log.
set -u
: "${OUT:?set OUT to an output directory}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu/lab_env.sh
timeout "${LIMIT_S:-560}" python3 -m kvpop_lab.bench.first_prompt --device cuda --shape qwen3-8b \
  --contexts ${CONTEXTS:-32768 131072} --paths ${PATHS:-default fastest static} --processes ${PROCESSES:-cold warm} \
  --out "$OUT/first_prompt.csv" 2>&1 | tee "$OUT/first_prompt.log"
