#!/usr/bin/env bash
# Session 3, call 1 (one H200): four testbed teachers side by side, each with the 'lookup' drill mixed in at a
# fact density of 16 facts a problem (the default, length // 48, gives 5-10), to get the fact copy learned
# (issue 4). Each logs the teacher-forced fact-lookup accuracy every 250 steps (chance ~0.1), then the
# dense teacher is evaluated with kvpop-eval on 30 reasoning problems of 512 and 1024 tokens (EM included).
#   P: head_dim 64 x 4 heads, reasoning 0.5 + drill 0.5, 256-512 tokens, lr 2e-3
#   Q: as P with head_dim 32 x 8 heads
#   R: as P with every family: reasoning 0.3 + drill 0.5 + the four RULER families 0.2, 256-1024 tokens
#   S: as P with lr 1e-3
# Usage: OUT=dir TB=390 bash benchmarks/gpu/call6_teacher_drill.sh   (~8.5 min)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. TOKENIZERS_PARALLELISM=false OMP_NUM_THREADS=2
TB=${TB:-390}
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
COMMON="--steps 1000000 --time-budget $TB --len-multiple 128 --warmup 150 --seed 0 --workers 3 --log-every 250
  --probe-every 250 --probe-n 16 --probe-len 512 --eval-n 30 --eval-batch-size 60 --tokens-per-batch 32768
  --hidden 256 --layers 6 --kv-heads 2 --intermediate 768 --knob lookup.n_facts=16 --lookup-weight 0.5"
teacher() {  # name args...
  local name=$1; shift
  timeout $((TB + 90)) python3 training/pretrain_teacher.py --out "$OUT/t_$name" $COMMON "$@" \
    > "$OUT/teacher_$name.log" 2>&1
  stamp "teacher $name exit $?"
  for L in 512 1024; do
    timeout 100 python3 -m kvpop_hf.testbed.evaluate --model "$OUT/t_$name" --out "$OUT/eval_${name}_L$L" \
      --length $L --n 30 --families reasoning --in-domain reasoning --policies dense --budgets 0.75 --window 32 \
      --batch-size 30 --no-progress > "$OUT/eval_${name}_L$L.log" 2>&1
    stamp "eval $name L$L exit $?"
  done
}
teacher P --heads 4 --head-dim 64 --seq-len 256:512 --lr 2e-3 --reasoning-weight 0.5 &
teacher Q --heads 8 --head-dim 32 --seq-len 256:512 --lr 2e-3 --reasoning-weight 0.5 &
teacher R --heads 4 --head-dim 64 --seq-len 256:1024 --lr 2e-3 --reasoning-weight 0.3 &
teacher S --heads 4 --head-dim 64 --seq-len 256:512 --lr 1e-3 --reasoning-weight 0.5 &
wait
cd "$OUT"
for n in P Q R S; do
  echo "== $n"; grep -E "^probe step" "teacher_$n.log" | awk 'NR%3==0' | tail -8; grep -E "trained|dense greedy EM" "teacher_$n.log"
  for L in 512 1024; do grep -E "^\| dense" "eval_${n}_L$L/table1.md" 2>/dev/null | head -1 | sed "s/^/L$L /"; done
  [ -d "t_$n" ] && tar czf "t_$n.tgz" "t_$n" && rm -rf "t_$n"
done
tar czf logs.tgz teacher_*.log eval_* && rm -rf teacher_*.log eval_*
ls -la; stamp done
