#!/usr/bin/env bash
# One device call on nvidia-h200-x2: six testbed-teacher recipes trained side by side (three per GPU),
# each with its own time budget, then evaluated (dense greedy EM on fresh problems, 2048-4096 tokens).
# Every teacher directory comes back as its own tarball; the logs as one more.
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
TB=${TB:-380}          # training seconds per recipe
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=index,name,memory.used --format=csv
COMMON="--steps 1000000 --time-budget $TB --seq-len 2048:4096 --len-multiple 256 --warmup 200 --seed 0
  --knob reasoning.n_facts=12 --eval-knob reasoning.steps=3 --workers 3 --log-every 250 --eval-n 30
  --eval-batch-size 60 --curriculum-frac 0.6"
SMALL="--hidden 256 --layers 6 --heads 8 --kv-heads 2 --head-dim 32 --intermediate 768"
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
sleep 60; nvidia-smi --query-gpu=index,utilization.gpu,memory.used --format=csv
wait
stamp "all done"
cd "$OUT"
for n in A B C D E F; do
  echo "== $n"; grep -E "^step|it/s" "teacher_$n.log" | grep -oE "step [0-9]+ loss [0-9.]+ .* bs [0-9]+ it/s [0-9.]+" | awk 'NR%4==1' | tail -6
  grep -E "trained|dense greedy EM|model:" "teacher_$n.log"
  [ -d "t_$n" ] && tar czf "t_$n.tgz" "t_$n" && rm -rf "t_$n"
done
tar czf logs.tgz teacher_*.log && rm -f teacher_*.log
ls -la
stamp pack done
