#!/usr/bin/env bash
# Prepared for the next session (not run yet): three testbed-teacher recipes side by side on ONE GPU that
# attack what no recipe so far learned -- copying a fact's value from far back (issue 4; README "Quality
# testbed"). Each logs the teacher-forced fact-lookup accuracy every 250 steps (chance ~0.1), so the log
# shows whether and when the copy mechanism forms.
#   P: half reasoning, half 'lookup' drill, head_dim 32, 256-512 tokens
#   Q: as P with head_dim 64 (Qwen3's q/k RMSNorm bounds the attention logits by ~sqrt(head_dim) at init)
#   R: as Q, 256-1024 tokens for 60% of the run, then 2048-4096 (the lengths)
# Usage: OUT=dir TB=400 bash benchmarks/gpu/next_teacher_drill.sh   (~8 min)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
TB=${TB:-400}
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
COMMON="--steps 1000000 --time-budget $TB --len-multiple 128 --warmup 150 --seed 0 --workers 4 --log-every 250
  --probe-every 250 --probe-n 16 --eval-n 30 --eval-batch-size 60 --lr 2e-3 --tokens-per-batch 32768
  --hidden 256 --layers 6 --kv-heads 2 --intermediate 768 --reasoning-weight 0.5 --lookup-weight 0.5"
teacher() {  # name args...
  local name=$1; shift
  timeout $((TB + 120)) python3 training/pretrain_teacher.py --out "$OUT/t_$name" $COMMON "$@" \
    > "$OUT/teacher_$name.log" 2>&1
  stamp "teacher $name exit $?"
}
teacher P --heads 8 --head-dim 32 --seq-len 256:512 &
teacher Q --heads 4 --head-dim 64 --seq-len 256:512 &
teacher R --heads 4 --head-dim 64 --seq-len 2048:4096 --curriculum-frac 0.6 --curriculum-len 256:1024 &
wait
cd "$OUT"
for n in P Q R; do
  echo "== $n"; grep -E "^probe step" "teacher_$n.log" | tail -6; grep -E "trained|dense greedy EM" "teacher_$n.log"
  [ -d "t_$n" ] && tar czf "t_$n.tgz" "t_$n" && rm -rf "t_$n"
done
tar czf logs.tgz teacher_*.log && rm -f teacher_*.log
ls -la; stamp done
