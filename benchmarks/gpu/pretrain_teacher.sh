#!/usr/bin/env bash
# Pretrain the 1024-token testbed teacher (the start of checkpoints/testbed-4k-teacher: a 5.8M-parameter Qwen3, 6 layers, 8 query / 2 KV heads of 32)
# from scratch on the generated tasks, in three stages on one GPU, each followed by a dense kvpop-eval.
#
#   STAGE=1  four recipes side by side, each with the 'lookup' drill mixed in at 16 facts a problem (the default,
#            length // 48, gives 5-10); every run logs the teacher-forced fact-lookup accuracy every 250 steps
#            (chance ~0.1) and is evaluated dense on 30 reasoning problems of 512 and 1024 tokens.
#              P: head_dim 64 x 4 heads, reasoning 0.5 + drill 0.5, 256-512 tokens, lr 2e-3
#              Q: as P with head_dim 32 x 8 heads
#              R: as P with every family: reasoning 0.3 + drill 0.5 + the four RULER families 0.2, 256-1024 tokens
#              S: as P with lr 1e-3
#            -> $OUT/recipes_side_by_side/ (TB=390, ~8.5 min)
#   STAGE=2  continue INIT (default: stage 1's Q, the recipe whose fact copy formed) twice side by side at
#            256-1024 tokens, lr 1e-3 (fresh warmup + cosine):
#              A: reasoning 0.5 + lookup drill 0.5;  B: reasoning 0.4 + drill 0.3 + the four RULER families 0.3
#            dense kvpop-eval of both on 30 reasoning problems of 1024 tokens; the higher EM is written to
#            picked.txt (ties: B, every family)
#            -> $OUT/continued_256_1024/ (TB=300, ~7 min)
#   STAGE=3  continue INIT (default: stage 2's pick) at 256-1152 tokens (uniform over multiples of 128), every
#            family: reasoning 0.4, drill 0.2, the four RULER families 0.1 each; lr 7e-4; then dense kvpop-eval on
#            30 reasoning problems of 1024 tokens
#            -> $OUT/final/teacher (continued to 4096 tokens by benchmarks/gpu/testbed_4k.sh STAGE=teacher), teacher.log, eval_dense/ (TB=210,
#               ~5 min)
#   STAGE=all (default) runs 1, 2 and 3 in turn (~21 min).
#
# Usage: OUT=dir bash benchmarks/gpu/pretrain_teacher.sh
#        OUT=dir STAGE=3 INIT=dir/continued_256_1024/t_B bash benchmarks/gpu/pretrain_teacher.sh
# Knobs: STAGE, INIT, TB (training seconds per run; the per-stage defaults above are those of the shipped teacher,
# so leave TB unset with STAGE=all).
# The shipped teacher's exact commands are in checkpoints/testbed-4k-teacher/README.md; results/studies.csv (study
# teacher) gives the commit.
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source benchmarks/gpu/lab_env.sh
STAGE=${STAGE:-all}; L=1024; W=32
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }

stage1() {
  local D="$OUT/recipes_side_by_side" TB=${TB:-390}
  mkdir -p "$D"
  local COMMON="--steps 1000000 --time-budget $TB --len-multiple 128 --warmup 150 --seed 0 --workers 3 --log-every 250
    --probe-every 250 --probe-n 16 --probe-len 512 --eval-n 30 --eval-batch-size 60 --tokens-per-batch 32768
    --hidden 256 --layers 6 --kv-heads 2 --intermediate 768 --knob lookup.n_facts=16 --lookup-weight 0.5"
  teacher() {  # name args...
    local name=$1; shift
    OMP_NUM_THREADS=2 timeout $((TB + 90)) python3 training/pretrain_teacher.py --out "$D/t_$name" $COMMON "$@" \
      > "$D/teacher_$name.log" 2>&1
    stamp "teacher $name exit $?"
    for EL in 512 1024; do
      OMP_NUM_THREADS=2 timeout 100 python3 -m kvpop_lab.testbed.evaluate --model "$D/t_$name" --out "$D/eval_${name}_L$EL" \
        --length $EL --n 30 --families reasoning --in-domain reasoning --policies dense --compression 0.75 --window 32 \
        --batch-size 30 --no-progress > "$D/eval_${name}_L$EL.log" 2>&1
      stamp "eval $name L$EL exit $?"
    done
  }
  teacher P --heads 4 --head-dim 64 --seq-len 256:512 --lr 2e-3 --reasoning-weight 0.5 &
  teacher Q --heads 8 --head-dim 32 --seq-len 256:512 --lr 2e-3 --reasoning-weight 0.5 &
  teacher R --heads 4 --head-dim 64 --seq-len 256:1024 --lr 2e-3 --reasoning-weight 0.3 &
  teacher S --heads 4 --head-dim 64 --seq-len 256:512 --lr 1e-3 --reasoning-weight 0.5 &
  wait
  for n in P Q R S; do
    echo "== $n"; grep -E "^probe step" "$D/teacher_$n.log" | awk 'NR%3==0' | tail -8
    grep -E "trained|dense greedy EM" "$D/teacher_$n.log"
    for EL in 512 1024; do grep -E "^\| dense" "$D/eval_${n}_L$EL/table1.md" 2>/dev/null | head -1 | sed "s/^/L$EL /"; done
  done
}

stage2() {
  local D="$OUT/continued_256_1024" TB=${TB:-300} INIT=${INIT:-$OUT/recipes_side_by_side/t_Q}
  mkdir -p "$D"
  teacher() {  # name args...
    local name=$1; shift
    OMP_NUM_THREADS=2 timeout $((TB + 80)) python3 training/pretrain_teacher.py --out "$D/t_$name" --init-from "$INIT" \
      --steps 1000000 --time-budget $TB --seq-len 256:$L --len-multiple 128 --warmup 100 --lr 1e-3 --seed 1 \
      --workers 6 --log-every 250 --probe-every 250 --probe-n 16 --probe-len $L --eval-n 30 --eval-batch-size 60 \
      --tokens-per-batch 32768 --knob lookup.n_facts=16 "$@" > "$D/teacher_$name.log" 2>&1
    stamp "teacher $name exit $?"
    timeout 100 python3 -m kvpop_lab.testbed.evaluate --model "$D/t_$name" --out "$D/eval_dense_$name" \
      --length $L --n 30 --families reasoning --in-domain reasoning --policies dense --compression 0.75 --window $W \
      --batch-size 30 --no-progress > "$D/eval_dense_$name.log" 2>&1
    stamp "dense eval $name exit $?"
  }
  teacher A --reasoning-weight 0.5 --lookup-weight 0.5 &
  teacher B --reasoning-weight 0.4 --lookup-weight 0.3 &
  wait
  for n in A B; do echo "== $n"; grep -E "trained|dense greedy EM" "$D/teacher_$n.log"
    grep -E "^probe step" "$D/teacher_$n.log" | tail -3; grep -E "^\| dense" "$D/eval_dense_$n/table1.md"; done
  python3 - "$D" > "$D/picked.txt" <<'PY'
import csv, sys
em = {}
for n in ("A", "B"):
    try:
        rows = list(csv.DictReader(open(f"{sys.argv[1]}/eval_dense_{n}/results.csv")))
        em[n] = sum(float(r["em"]) for r in rows if r["family"] == "reasoning") / max(1, sum(r["family"] == "reasoning" for r in rows))
    except Exception as e:
        print(f"no eval for {n}: {e}", file=sys.stderr); em[n] = -1.0
print("B" if em["B"] >= em["A"] else "A")
PY
  stamp "picked $(cat "$D/picked.txt")"
}

stage3() {
  local D="$OUT/final" TB=${TB:-210} INIT=${INIT:-$OUT/continued_256_1024/t_$(cat "$OUT/continued_256_1024/picked.txt" 2>/dev/null)}
  mkdir -p "$D"
  local TEACHER="$D/teacher"
  OMP_NUM_THREADS=2 timeout $((TB + 80)) python3 training/pretrain_teacher.py --out "$TEACHER" --init-from "$INIT" \
    --steps 1000000 --time-budget $TB --seq-len 256:1152 --len-multiple 128 --warmup 100 --lr 7e-4 --seed 2 \
    --workers 12 --log-every 250 --probe-every 250 --probe-n 16 --probe-len $L --eval-n 30 --eval-batch-size 60 \
    --tokens-per-batch 32768 --knob lookup.n_facts=16 --reasoning-weight 0.4 --lookup-weight 0.2 \
    > "$D/teacher.log" 2>&1
  stamp "teacher exit $?"; grep -E "trained|dense greedy EM" "$D/teacher.log"; grep -E "^probe step" "$D/teacher.log" | tail -3
  timeout 100 python3 -m kvpop_lab.testbed.evaluate --model "$TEACHER" --out "$D/eval_dense" \
    --length $L --n 30 --families reasoning --in-domain reasoning --policies dense --compression 0.75 --window $W \
    --batch-size 30 --no-progress > "$D/eval_dense.log" 2>&1
  stamp "dense eval exit $?"; grep -E "^\| dense" "$D/eval_dense/table1.md"
}

case "$STAGE" in
  1) stage1 ;;
  2) stage2 ;;
  3) stage3 ;;
  all) stage1; stage2; stage3 ;;
  *) echo "STAGE must be 1, 2, 3 or all" >&2; exit 2 ;;
esac
stamp done
