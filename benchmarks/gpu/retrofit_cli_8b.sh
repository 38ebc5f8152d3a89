#!/usr/bin/env bash
# The README's real-scale retrofit command, run as a user runs it, on one GPU: training/retrofit.py on a
# Qwen3-8B-shaped model directory (random bf16 weights, saved once with the testbed tokenizer; no download)
# at 32k tokens, LoRA rank 16, mlstm scorer, 88% compression, for STEPS optimizer steps, then the saved
# output loaded back with KVpopCache.from_pretrained. GPU memory is sampled by nvidia-smi every 0.5 s.
# Usage: OUT=dir [SEQ_LEN=32768] [STEPS=4] [SCRATCH=/tmp/kvpop_retrofit_cli] bash benchmarks/gpu/retrofit_cli_8b.sh
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source benchmarks/gpu/lab_env.sh
SEQ_LEN=${SEQ_LEN:-32768}
STEPS=${STEPS:-4}
SCRATCH=${SCRATCH:-/tmp/kvpop_retrofit_cli}
MODEL="$SCRATCH/qwen3-8b-random"
TOPK=$(( SEQ_LEN / 8 - 4 - 256 ))
mkdir -p "$OUT" "$SCRATCH"
if [ ! -f "$MODEL/config.json" ]; then
  python3 - "$MODEL" "$SEQ_LEN" "$STEPS" <<'PY' > "$OUT/retrofit_cli_prepare.log" 2>&1
import json, random, sys, time
from pathlib import Path
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from kvpop_lab.testbed import build_tokenizer
model_dir, seq_len, steps = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
t0 = time.time()
tok = build_tokenizer()
cfg = Qwen3Config(vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                  num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
                  rope_theta=1_000_000.0, tie_word_embeddings=False, bos_token_id=tok.bos_token_id,
                  eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
torch.manual_seed(0)
with torch.device("cuda"):
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
model.save_pretrained(model_dir)
tok.save_pretrained(model_dir)
rng = random.Random(0)
with open(model_dir / "data.jsonl", "w") as fh:  # documents of random words, enough for every step
    for _ in range(steps + 1):
        fh.write(json.dumps({"text": tok.decode([rng.randrange(10, len(tok)) for _ in range(seq_len)])}) + "\n")
print(f"model and data in {model_dir} ({time.time() - t0:.0f} s)")
PY
  echo "prepare exit $?"; tail -2 "$OUT/retrofit_cli_prepare.log"
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -lms 500 > "$OUT/retrofit_cli_gpu_mem.csv" &
SMI=$!
CMD="python training/retrofit.py --model $MODEL --dataset $MODEL/data.jsonl --seq_len $SEQ_LEN --dtype bfloat16 \
--lora_rank 16 --sinks 4 --window 256 --topk $TOPK --scorer mlstm --bf16 True --gradient_checkpointing True \
--per_device_train_batch_size 1 --learning_rate 1e-4 --max_steps $STEPS --logging_steps 1 --report_to none \
--output_dir $SCRATCH/out"
echo "$CMD" > "$OUT/retrofit_cli.log"
TIMER=""; [ -x /usr/bin/time ] && TIMER="/usr/bin/time -v"
$TIMER $CMD >> "$OUT/retrofit_cli.log" 2>&1
echo "retrofit exit $?"
kill $SMI 2>/dev/null
python3 - "$SCRATCH/out" >> "$OUT/retrofit_cli.log" 2>&1 <<'PY'
import sys
from kvpop_hf import KVpopCache
cache = KVpopCache.from_pretrained(sys.argv[1])
print("loaded:", cache)
PY
echo "load exit $?"
grep -E "'loss'|train_runtime|loaded:|Maximum resident|Elapsed|Error|error" "$OUT/retrofit_cli.log" | tail -14
echo "peak GPU memory used (nvidia-smi, MiB): $(sort -n "$OUT/retrofit_cli_gpu_mem.csv" | tail -1)"
