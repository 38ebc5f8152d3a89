#!/usr/bin/env bash
# Retrofit four testbed scorers on a 1024-token teacher: KVpop (mLSTM, delayed) and KVpop_mlp at 75%
# and 88% compression of 1024 tokens (B = 4 + 32 + 220 and 4 + 32 + 87), scorer only (backbone frozen), on the
# reasoning family, all four side by side on one GPU, RS seconds of training each.
# Writes $OUT/ckpt/<name>/ (kvpop_config.json + kvpop_scorer.safetensors and the card; the unchanged backbone copy
# and training_args.bin are removed) and $OUT/retrofit_<name>.log
# (study retrofit_gpu in results/studies.csv).
# Usage: OUT=dir TEACHER=dir/final/teacher bash benchmarks/gpu/retrofit_scorers.sh
# Knobs: TEACHER (required: a 1024-token teacher), RS (training seconds per scorer, default 70 as committed).
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source benchmarks/gpu/lab_env.sh
TEACHER=${TEACHER:?set TEACHER to a 1024-token testbed teacher (benchmarks/gpu/pretrain_teacher.sh writes one)}; L=1024; W=32; TK88=87; TK75=220
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p "$OUT"
retro() {  # name scorer topk
  local name=$1 scorer=$2 topk=$3
  OMP_NUM_THREADS=3 timeout 150 python3 training/retrofit.py --model "$TEACHER" \
    --dataset testbed:reasoning --seq_len $L --sinks 4 --window $W --topk $topk --train_backbone False --scorer $scorer \
    --scorer_kwargs "$([ "$scorer" = mlstm ] && echo '{"token_readout": false}' || echo '{}')" \
    --output_dir "$OUT/ckpt/$name" --max_steps 1000 --num_examples 4000 --max_train_seconds ${RS:-70} \
    --per_device_train_batch_size 8 --learning_rate 1e-4 --scorer_learning_rate 3e-3 --bf16 --logging_steps 10 \
    --report_to none --save_strategy no --disable_tqdm True --seed 0 > "$OUT/retrofit_$name.log" 2>&1
  stamp "retrofit $name exit $?"; grep -o "{'loss'[^}]*}" "$OUT/retrofit_$name.log" | sed -n '$p' | cut -c1-200
}
retro kvpop_cr88 mlstm $TK88 & retro kvpop_cr75 mlstm $TK75 &
retro kvpop_mlp_cr88 mlp $TK88 & retro kvpop_mlp_cr75 mlp $TK75 &
wait
stamp done
