#!/usr/bin/env bash
# Session 3, call 2 (one H200). Input: INIT=<teacher folder> -- call 1's teacher Q, whose fact lookup formed
# at the end of its run (probe lookup accuracy 0.45 -> 0.98 over its last 500 steps, LR already decayed).
#  1. continue it twice side by side at 256-1024 tokens, lr 1e-3 (fresh warmup + cosine):
#       A: reasoning 0.5 + lookup drill 0.5;  B: reasoning 0.4 + drill 0.3 + the four RULER families 0.3
#  2. dense kvpop-eval of both on 30 reasoning problems of 1024 tokens; pick the higher EM (ties: B, every family)
#  3. retrofit KVpop (mLSTM) and KVpop_mlp at 75% and 88% of 1024 tokens on the picked teacher (scorer only)
# Usage: INIT=out/t_Q OUT=dir TB=300 bash benchmarks/gpu/call7_continue_retrofit.sh   (~8 min)
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=. TOKENIZERS_PARALLELISM=false
TB=${TB:-300}; L=1024; W=32; TK88=87; TK75=220
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
teacher() {  # name args...
  local name=$1; shift
  OMP_NUM_THREADS=2 timeout $((TB + 80)) python3 training/pretrain_teacher.py --out "$OUT/t_$name" --init-from "$INIT" \
    --steps 1000000 --time-budget $TB --seq-len 256:$L --len-multiple 128 --warmup 100 --lr 1e-3 --seed 1 \
    --workers 6 --log-every 250 --probe-every 250 --probe-n 16 --probe-len $L --eval-n 30 --eval-batch-size 60 \
    --tokens-per-batch 32768 --knob lookup.n_facts=16 "$@" > "$OUT/teacher_$name.log" 2>&1
  stamp "teacher $name exit $?"
  timeout 100 python3 -m kvpop_hf.testbed.evaluate --model "$OUT/t_$name" --out "$OUT/eval_dense_$name" \
    --length $L --n 30 --families reasoning --in-domain reasoning --policies dense --budgets 0.75 --window $W \
    --batch-size 30 --no-progress > "$OUT/eval_dense_$name.log" 2>&1
  stamp "dense eval $name exit $?"
}
teacher A --reasoning-weight 0.5 --lookup-weight 0.5 &
teacher B --reasoning-weight 0.4 --lookup-weight 0.3 &
wait
for n in A B; do echo "== $n"; grep -E "trained|dense greedy EM" "$OUT/teacher_$n.log"
  grep -E "^probe step" "$OUT/teacher_$n.log" | tail -3; grep -E "^\| dense" "$OUT/eval_dense_$n/table1.md"; done
PICK=$(python3 - "$OUT" <<'PY'
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
)
stamp "picked $PICK"; echo "$PICK" > "$OUT/picked.txt"
TEACHER="$OUT/t_$PICK"
retro() {  # name scorer topk
  local name=$1 scorer=$2 topk=$3
  OMP_NUM_THREADS=3 timeout 150 python3 training/retrofit.py --model "$TEACHER" \
    --dataset testbed:reasoning --seq_len $L --sinks 4 --window $W --topk $topk --train_backbone False --scorer $scorer \
    --output_dir "$OUT/ckpt/$name" --max_steps 1000 --num_examples 4000 --max_train_seconds ${RS:-70} \
    --per_device_train_batch_size 8 --learning_rate 1e-4 --scorer_learning_rate 3e-3 --bf16 --logging_steps 10 \
    --report_to none --save_strategy no --disable_tqdm True --seed 0 > "$OUT/retrofit_$name.log" 2>&1
  stamp "retrofit $name exit $?"; grep -o "{'loss'[^}]*}" "$OUT/retrofit_$name.log" | sed -n '1p;$p'
}
retro kvpop_cr88 mlstm $TK88 & retro kvpop_cr75 mlstm $TK75 &
retro kvpop_mlp_cr88 mlp $TK88 & retro kvpop_mlp_cr75 mlp $TK75 &
wait
cd "$OUT"
for d in ckpt/*; do rm -f "$d/model.safetensors" "$d/training_args.bin"; done
for n in A B; do [ -d t_$n ] && tar czf t_$n.tgz t_$n && rm -rf t_$n; done
tar czf ckpt.tgz ckpt retrofit_*.log && rm -rf ckpt retrofit_*.log
tar czf logs.tgz teacher_*.log eval_dense_* picked.txt && rm -rf teacher_*.log eval_dense_* picked.txt
ls -la; stamp done
