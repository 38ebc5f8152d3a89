#!/usr/bin/env bash
# lm-eval generate_until throughput and peak memory, --model kvpop vs --model hf, in one process on one GPU:
# Qwen3-8B shapes with random bf16 weights, batch BATCH (16; 8 on an 80 GB card), 16384-token prompts, 256 new tokens, greedy. lm-eval is not
# installed there: carry its wheel (pure Python) as .whl/lm_eval
#   here:  pip download --no-deps -d .whl/lm_eval lm-eval==0.4.13
#   run:   OUT=dir KVPOP_GIT_COMMIT=<commit> bash benchmarks/gpu/lm_eval_throughput.sh     (carry: .whl)
# The kvpop run feeds prompts in 4096-token chunks (prefill_chunk=4096, kvpop_hf.prefill_in_chunks); hf prefills in
# one forward, as lm-eval's hf model does. Rows are written as they finish (result.json), so a run cut by LIMIT_S
# keeps them. BATCHING=continuous times --model kvpop's default generate_until (kvpop_hf.generate_batch, BATCH rows)
# instead of lm-eval's static batches.
set -u
export PYTHONUNBUFFERED=1
source benchmarks/gpu/lab_env.sh
python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/lm_eval_site .whl/lm_eval/*.whl \
  && export PYTHONPATH=$PYTHONPATH:/tmp/lm_eval_site || exit 1
timeout ${LIMIT_S:-590} python3 benchmarks/lm_eval_throughput.py --stack-every ${STACK_EVERY:-0} ${NO_COMPILE:+--no-compile} ${BATCHING:+--batching $BATCHING} --device cuda --shape qwen3-8b --batch ${BATCH:-16} \
  --context ${CONTEXT:-16384} --new-tokens ${NEW:-256} --policies ${POLICIES:-kvpop} --compression 0.88 \
  --prefill-chunk ${CHUNK:-4096} --out "$OUT/lm_eval_throughput" 2>&1 \
  | grep -v -i warn | tee "$OUT/lm_eval_throughput.log"
