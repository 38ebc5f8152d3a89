#!/usr/bin/env bash
# Decode through model.generate as a user calls it, on one H200 (Qwen3-8B shape, random bf16 weights):
# StaticCache and KVpopCache (knorm, mlp, mlstm) at 4k and 128k, batch 1, in two fresh processes sharing a
# compile cache (kvpop_hf.compile_cache), so the second process's first decode step shows what the cache saves.
# Batch rows at 32k (as in results/speed_generate_h200.csv): STATIC_INPUT_LOG=0 COMPILE_REUSE=0
#   CONTEXTS=32768 BATCHES="16 32 64 128 1" SCORERS=knorm STATIC_MAX_BATCH=32 STATIC_BATCHES="16 32"
#   KVPOP_BATCHES="1 32 64 128" SYNTHETIC_FROM=8 (add 8 to both batch lists for batch 8). PROFILE=1: decode-step
#   profiles (the profiler may slow the rows that follow it in the process: measure speed without it).
# The op25 case (a KVpop graph compiled after a StaticCache graph in one process): CONTEXTS=32768 BATCHES="8 32" CACHES="static kvpop" SCORERS=knorm
#   STATIC_BATCHES="8 32" KVPOP_BATCHES=32 SYNTHETIC_FROM=8 STATIC_MAX_BATCH=32 NO_RETRY=1 (a failure is not retried).
# LOOPS="stock run_ahead": every row with generate's own loop and with custom_generate=kvpop_hf.run_ahead_sample
#   (rows of the latter in $OUT/h200_qwen3-8b_generate_run_ahead.csv).
# Fused projections, all three scorers at 128k with a second process reusing the compile cache (one call, ~400 s):
#   CONTEXTS=131072 CACHES=kvpop LOOPS=run_ahead PROJECTIONS=fused STATIC_INPUT_LOG=0 LIMIT_S=560.
# PROJECTIONS="separate fused": every row again with q/k/v and gate/up as one product each (kvpop_hf.ops.fused_projections;
#   rows in $OUT/h200_qwen3-8b_generate[_run_ahead]_fused.csv).
# Usage: OUT=dir [CONTEXTS="4096 131072"] [CACHES="static kvpop"] [SCORERS="knorm mlp mlstm"] [STATIC_CONTEXTS=4096] [LIMIT_S=590]
#        bash benchmarks/gpu/generate_call_speed.sh
# Writes $OUT/h200_qwen3-8b_generate{.csv,.md}, the log, the non-static CUDA-graph inputs named by torch
# (static_inputs.log) and the decode-step profiles (profiles.tgz).
set -u
: "${OUT:?set OUT to an output directory}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu/lab_env.sh
[ "${STATIC_INPUT_LOG:-1}" = 1 ] && export TORCH_LOGS=cudagraph_static_inputs  # names the non-static CUDA-graph inputs
extra=()
[ "${COMPILE_REUSE:-1}" = 1 ] && extra+=(--compile-reuse "${COMPILE_DIR:-/tmp/kvpop_compile_cache}")
[ -n "${STATIC_CONTEXTS:-}" ] && extra+=(--static-contexts $STATIC_CONTEXTS)
[ -n "${SYNTHETIC_FROM:-}" ] && extra+=(--synthetic-from "$SYNTHETIC_FROM")
[ -n "${COMPILE_MODE:-}" ] && extra+=(--compile-mode "$COMPILE_MODE")
[ -n "${CACHES:-}" ] && extra+=(--caches $CACHES)
[ -n "${STATIC_BATCHES:-}" ] && extra+=(--static-batches $STATIC_BATCHES)
[ -n "${KVPOP_BATCHES:-}" ] && extra+=(--kvpop-batches $KVPOP_BATCHES)
[ -n "${LOOPS:-}" ] && extra+=(--loops $LOOPS)  # e.g. LOOPS="stock run_ahead": each row with both decoding loops
[ "${PROFILE:-0}" = 1 ] && extra+=(--profile-dir /tmp/kvpop_profiles)
[ -n "${PROJECTIONS:-}" ] && extra+=(--projections $PROJECTIONS)  # e.g. "separate fused": every row again, fused
[ "${NO_RETRY:-0}" = 1 ] && extra+=(--no-retry)  # a failed generate is not retried after torch._dynamo.reset()
timeout "${LIMIT_S:-590}" python3 benchmarks/generate_call_speed.py --device cuda --shape qwen3-8b \
  --contexts ${CONTEXTS:-4096 131072} --batches ${BATCHES:-1} --scorers ${SCORERS:-knorm mlp mlstm} \
  --static-max-batch ${STATIC_MAX_BATCH:-1} "${extra[@]}" \
  --out-prefix "$OUT/h200_qwen3-8b_generate" 2>&1 | grep -v -i warn | tee "$OUT/generate_call_speed.full.log" \
  | grep -v "cudagraph_static_inputs" | tee "$OUT/generate_call_speed.log"
grep "Non-static input" "$OUT/generate_call_speed.full.log" | sed 's/.*\] Non-static/Non-static/' | sort | uniq -c \
  > "$OUT/static_inputs.log"
rm -f "$OUT/generate_call_speed.full.log"
[ -d /tmp/kvpop_profiles ] && tar czf "$OUT/profiles.tgz" -C /tmp kvpop_profiles
[ -f "${COMPILE_DIR:-/tmp/kvpop_compile_cache}/torch_compile_artifacts.bin" ] && ls -la "${COMPILE_DIR:-/tmp/kvpop_compile_cache}"/torch_compile_artifacts.bin
true
