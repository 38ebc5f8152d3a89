#!/usr/bin/env bash
# One device call on nvidia-h200-x2.
#  GPU 0: three testbed-teacher recipes on the restated-lookup trace format, side by side.
#  GPU 1: the FlexAttention diagnostic and the per-layer training-speed benchmark (alone on their GPU),
#         then a fourth, shorter teacher recipe.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
TB=${TB:-430}
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
COMMON="--steps 1000000 --seq-len 2048:4096 --len-multiple 256 --warmup 200 --seed 0 --workers 3
  --log-every 250 --eval-n 30 --eval-batch-size 60 --curriculum-frac 0.6 --curriculum-len 256:1024
  --hidden 256 --layers 6 --heads 8 --kv-heads 2 --head-dim 32 --intermediate 768"
teacher() {  # gpu name budget args...
  local gpu=$1 name=$2 tb=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpu timeout $((tb + 110)) python3 training/pretrain_teacher.py --out "$OUT/t_$name" \
    --time-budget $tb $COMMON "$@" > "$OUT/teacher_$name.log" 2>&1
  stamp "teacher $name exit $?"
}
teacher 0 G $TB --lr 2e-3 --tokens-per-batch 32768 --reasoning-weight 0.6 &
teacher 0 H $TB --lr 2e-3 --tokens-per-batch 32768 --reasoning-weight 1.0 &
teacher 0 I $TB --lr 3e-3 --tokens-per-batch 16384 --reasoning-weight 0.6 &
(
  export CUDA_VISIBLE_DEVICES=1 OMP_NUM_THREADS=4
  stamp "flex_diag"
  timeout 170 python3 benchmarks/gpu/flex_diag.py --out "$OUT/flex_diag" > "$OUT/flex_diag.log" 2>&1
  stamp "flex_diag exit $?"
  timeout 150 python3 benchmarks/training_speed.py --out "$OUT/training_speed_gpu" > "$OUT/training_speed.log" 2>&1
  stamp "training_speed exit $?"
  left=$(( TB - ($(date +%s) - T0) - 20 ))
  [ $left -gt 120 ] && teacher 1 J $left --lr 3e-3 --tokens-per-batch 16384 --reasoning-weight 1.0
) &
wait
stamp "all done"
grep -E "target pass|Ratio|FAILS|HOLDS" "$OUT/training_speed_gpu.md" | head -12
tail -25 "$OUT/flex_diag.log"
cd "$OUT"
for n in G H I J; do
  [ -f "teacher_$n.log" ] || continue
  echo "== $n"; grep -oE "step [0-9]+ loss [0-9.]+ .* bs [0-9]+ it/s [0-9.]+" "teacher_$n.log" | awk 'NR%4==1' | tail -5
  grep -E "trained|dense greedy EM" "teacher_$n.log"
  [ -d "t_$n" ] && tar czf "t_$n.tgz" "t_$n" && rm -rf "t_$n"
done
tar czf logs.tgz *.log training_speed_gpu.* flex_diag.* 2>/dev/null && rm -f *.log training_speed_gpu.* flex_diag.md flex_diag.csv
ls -la
stamp pack done
