#!/usr/bin/env bash
# Earlier testbed-teacher recipes at 2048-4096 tokens (results/teacher_sweeps/), trained side by side on a 2-GPU
# host and evaluated at the end of training (dense greedy EM on fresh problems). None of them learned the fact
# lookups at those lengths; they are the baseline for the recipe in benchmarks/gpu/pretrain_teacher.sh.
#   SET=A-F  six recipes, three a GPU, TB=380 s each (commit 25ca5cb, the first trace format):
#              A: 6 x (8 heads of 32), hidden 256, lr 2e-3, 32k tokens a batch, curriculum 256-1024, reasoning.steps=3
#              B: as A with reasoning.steps=6;  C: as A with lr 3e-3 and 16k tokens a batch
#              D: 4 layers, hidden 384, 6 heads of 64;  E: as A with curriculum 192-512 for 75% of the run
#              F: as B with reasoning weight 1.0
#   SET=G-J  four recipes on the restated-lookup trace format (commit ff8c1e3), TB=430 s: G, H, I on GPU 0
#              (G: lr 2e-3, 32k tokens, reasoning 0.6; H: as G with reasoning 1.0; I: lr 3e-3, 16k tokens,
#              reasoning 0.6), J on GPU 1 (as I with reasoning 1.0) for TB_J=219 s, the time that GPU had left in
#              the committed run after benchmarks/gpu/training_speed.sh
# Writes $OUT/t_<name>/ (the teacher) and $OUT/teacher_<name>.log.
# Usage: OUT=dir SET=A-F bash benchmarks/gpu/teacher_recipe_sweep.sh      (~9.5 min on two H200s; G-J: ~10 min)
# The trace format changed after these runs: check out the commit above to reproduce a log.
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
source benchmarks/gpu/lab_env.sh
SET=${SET:-A-F}
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
mkdir -p "$OUT"
nvidia-smi --query-gpu=index,name,memory.used --format=csv
SMALL="--hidden 256 --layers 6 --heads 8 --kv-heads 2 --head-dim 32 --intermediate 768"
if [ "$SET" = A-F ]; then
  TB=${TB:-380}
  COMMON="--steps 1000000 --time-budget $TB --seq-len 2048:4096 --len-multiple 256 --warmup 200 --seed 0
    --knob reasoning.n_facts=12 --eval-knob reasoning.steps=3 --workers 3 --log-every 250 --eval-n 30
    --eval-batch-size 60 --curriculum-frac 0.6"
  teacher() {  # gpu name args...
    local gpu=$1 name=$2; shift 2
    CUDA_VISIBLE_DEVICES=$gpu timeout $((TB + 170)) python3 training/pretrain_teacher.py --out "$OUT/t_$name" \
      $COMMON "$@" > "$OUT/teacher_$name.log" 2>&1
    stamp "teacher $name exit $?"
  }
  teacher 0 A $SMALL --lr 2e-3 --tokens-per-batch 32768 --curriculum-len 256:1024 --knob reasoning.steps=3 --reasoning-weight 0.6 &
  teacher 0 B $SMALL --lr 2e-3 --tokens-per-batch 32768 --curriculum-len 256:1024 --knob reasoning.steps=6 --reasoning-weight 0.6 &
  teacher 0 C $SMALL --lr 3e-3 --tokens-per-batch 16384 --curriculum-len 256:1024 --knob reasoning.steps=3 --reasoning-weight 0.6 &
  teacher 1 D --hidden 384 --layers 4 --heads 6 --kv-heads 2 --head-dim 64 --intermediate 768 \
    --lr 2e-3 --tokens-per-batch 32768 --curriculum-len 256:1024 --knob reasoning.steps=3 --reasoning-weight 0.6 &
  teacher 1 E $SMALL --lr 2e-3 --tokens-per-batch 32768 --curriculum-len 192:512 --knob reasoning.steps=3 --reasoning-weight 0.6 --curriculum-frac 0.75 &
  teacher 1 F $SMALL --lr 2e-3 --tokens-per-batch 32768 --curriculum-len 256:1024 --knob reasoning.steps=6 --reasoning-weight 1.0 &
  NAMES="A B C D E F"
elif [ "$SET" = G-J ]; then
  TB=${TB:-430}
  COMMON="--steps 1000000 --seq-len 2048:4096 --len-multiple 256 --warmup 200 --seed 0 --workers 3
    --log-every 250 --eval-n 30 --eval-batch-size 60 --curriculum-frac 0.6 --curriculum-len 256:1024 $SMALL"
  teacher() {  # gpu name budget args...
    local gpu=$1 name=$2 tb=$3; shift 3
    CUDA_VISIBLE_DEVICES=$gpu timeout $((tb + 110)) python3 training/pretrain_teacher.py --out "$OUT/t_$name" \
      --time-budget $tb $COMMON "$@" > "$OUT/teacher_$name.log" 2>&1
    stamp "teacher $name exit $?"
  }
  teacher 0 G $TB --lr 2e-3 --tokens-per-batch 32768 --reasoning-weight 0.6 &
  teacher 0 H $TB --lr 2e-3 --tokens-per-batch 32768 --reasoning-weight 1.0 &
  teacher 0 I $TB --lr 3e-3 --tokens-per-batch 16384 --reasoning-weight 0.6 &
  teacher 1 J ${TB_J:-219} --lr 3e-3 --tokens-per-batch 16384 --reasoning-weight 1.0 &
  NAMES="G H I J"
else
  echo "SET must be A-F or G-J" >&2; exit 2
fi
wait
stamp "all done"
for n in $NAMES; do
  echo "== $n"; grep -oE "step [0-9]+ loss [0-9.]+ .* bs [0-9]+ it/s [0-9.]+" "$OUT/teacher_$n.log" | awk 'NR%4==1' | tail -6
  grep -E "trained|dense greedy EM|model:" "$OUT/teacher_$n.log"
done
