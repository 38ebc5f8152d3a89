#!/usr/bin/env bash
# The mLSTM scorer's decode step on one H200, its torch path against the fused Triton kernel
# (kvpop_hf/ops/mlstm_decode.py, Backends.mlstm_step through --mlstm-step), then DMS beside KVpop:
#   1. StaticCache + compile and KVpopCache mlstm with the torch step, 4k and 128k, paired contexts;
#   2. KVpopCache mlstm with the fused step, the same contexts (the run checks the kernel against its torch
#      reference on the GPU first and falls back to torch if they disagree);
#   3. DMS (eager decoding, synthetic gates at the KVpop budget's average) at 4k and 32k, beside the KVpop rows
#      of steps 1 and 2.
# Each step writes its own files ($OUT/mlstm_torch.*, $OUT/mlstm_triton.*, $OUT/dms.*), rows as they finish.
# Usage: OUT=dir bash benchmarks/gpu/mlstm_step_speed.sh    (about 9 minutes: mlstm compiles in 130-165 s,
# StaticCache in 45-60 s per length). LIMIT1/LIMIT2/LIMIT3 bound the steps (300/200/80 s);
# SHAPE/DEVICE/CONTEXTS/STEP3_CONTEXTS for a CPU smoke test (SHAPE=tiny DEVICE=cpu CONTEXTS="64 200"
# STEP3_CONTEXTS="64 200", TRITON_INTERPRET=1; step 2 stops there at its first compiled row: dynamo cannot
# trace the Triton interpreter).
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1
source benchmarks/gpu/lab_env.sh
SHAPE=${SHAPE:-qwen3-8b}; DEVICE=${DEVICE:-cuda}; CONTEXTS=${CONTEXTS:-4096 131072}
BASE="python3 benchmarks/generation_speed.py --device $DEVICE --shape $SHAPE"
[ "$SHAPE" = tiny ] && BASE="$BASE --sinks 4 --window 16 --topk 44 --steps 3 --warmup 2 --prefill-chunk 128"
mkdir -p "$OUT"
run() {  # limit name args...
  local limit=$1 name=$2; shift 2
  # shellcheck disable=SC2086
  timeout "$limit" $BASE "$@" --out-prefix "$OUT/$name" 2>&1 | grep -v -i warn | tee "$OUT/$name.log"
}
# shellcheck disable=SC2086
run "${LIMIT1:-300}" mlstm_torch --contexts $CONTEXTS --static-contexts $CONTEXTS --static-synthetic \
  ${CONTEXTS##* } --rows static kvpop --scorers mlstm --mlstm-step torch --paired-repeats 3 --profile-decode
# shellcheck disable=SC2086
run "${LIMIT2:-200}" mlstm_triton --contexts $CONTEXTS --rows kvpop --scorers mlstm --mlstm-step triton \
  --paired-repeats 3 --profile-decode
# shellcheck disable=SC2086
run "${LIMIT3:-80}" dms --contexts ${STEP3_CONTEXTS:-4096 32768} --rows dms
