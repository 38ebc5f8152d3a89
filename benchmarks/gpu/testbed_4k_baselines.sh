#!/usr/bin/env bash
# The baseline rows of the 4k-token testbed (results/quality_4k_baselines.csv) on one GPU, everything side by side:
#   * StreamingLLM+ at 75/88/94%: sinks + a window of B - 4 tokens (k = 0, scorer "streaming"), TEACHER's rank-8
#     LoRA distilled at the budget for RS seconds and merged -> $OUT/ckpt/streaming_plus_cr<NN>;
#   * DMS at 75/88/94%: eviction gates + rank-8 LoRA distilled for RS seconds (the compression target ramps up over
#     the first half of them), merged -> $OUT/ckpt/dms_cr<NN>;
#   * KVP (POLICIES=kvp, not by default): Q/K/V traces of KVP_TRACES reasoning problems (the 4k knobs) recorded once
#     with TEACHER, then the RL agent and the supervised (ListNet) agent trained on them side by side for RS seconds
#     on DEVICE (training/train_kvp.py) -> $OUT/ckpt/kvp_{rl,supervised}, each evaluated at every budget of COMPRESSION_PCT
#     (one untagged checkpoint serves them all, with the budget's topk);
#   * meanwhile, kvpop-eval of the policies that need no training, at the budgets the 4k table lacks: TOVA, H2O and
#     SnapKV at 75% and 94%, LagKV at 94%, KVP (RL and supervised, KVP_CKPTS/{rl,supervised}, when KVP_CKPTS is set) at 94%;
#   * each trained checkpoint is evaluated as soon as it is saved (kvpop-eval, one folder per policy and budget);
#     once the three DMS evaluations are done, their compression.json files are merged into $OUT/eval_dms/ and
#     drawn as the per-head eviction-ratio heatmap (python -m kvpop_hf.baselines.dms.heatmap).
# Every evaluation has its own folder $OUT/eval_<policy>_cr<NN> (log beside it: $OUT/eval_<...>.log; outputs.jsonl
# is written problem by problem, so a run cut by DEADLINE keeps what it finished); training logs: $OUT/train_*.log.
# All problems: reasoning, LEN tokens, the 4k knobs (10 facts, 4 steps), sinks 4, window WINDOW (32), EVAL_N problems
# with seeds SEED_BASE + i (2^48 + i).
#
# Usage: OUT=dir bash benchmarks/gpu/testbed_4k_baselines.sh                                 (~9.5 min)
# Knobs: TEACHER (checkpoints/testbed-4k-teacher), KVP_CKPTS (a POLICIES=kvp output folder; unset: no KVP row), RS (training seconds, 240), EVAL_N
# (problems per evaluation, 40), SEED_BASE (the first problem's seed, 2^48), TRAIN_SEED (the trainings' seed, 0;
# another seed adds _s<seed> to the checkpoint and evaluation names), KVP_TRACES (128), WINDOW (DMS's protected window and the
# window of the evaluations, 32), COMPRESSION_PCT (the trained budgets as compression percentages, "75 88 94"), POLICIES (the trained baselines,
# "streaming_plus dms"; one of them trains as many at a time as KVpop's two-at-a-time retrofits), UNTRAINED=0 (skip the policies that need
# no training), EVAL=0 (train only), LR_DECAY=1 (the learning rate decays linearly to 0 over RS, as KVpop's
# retrofits in testbed_4k.sh), EBS (evaluation batch size, 20; DEBS for DMS, whose prefill mask is dense, 10),
# DBS (DMS training batch size, 2), DMS_WEIGHT (DMS's compression-penalty weight, 10; another weight adds _w<weight>
# to DMS's names), HELDOUT_SEED_BASE (if set, every trained checkpoint is first evaluated on HELDOUT_N (40) problems
# with these seeds, in $OUT/eval_<name>_heldout: the set a setting is picked on, apart from the reported one), NEX (training examples, 1200), TRAIN_SLACK (seconds a training may run past RS
# for loading and saving, 150), THREADS (torch threads per process, 2), DEADLINE (seconds after start by which
# everything is cut, 560); for a CPU smoke test of the script (python3 must be the environment's):
# DEVICE=cpu LEN=768 RS=5 EVAL_N=2 EBS=2 DEBS=2 NEX=8 THREADS=1 TRAIN_SLACK=900 DEADLINE=1200.
set -u
: "${OUT:?set OUT to an output directory}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source benchmarks/gpu/lab_env.sh
L=${LEN:-4096}; W=${WINDOW:-32}; N=${EVAL_N:-40}; EBS=${EBS:-20}; DEBS=${DEBS:-10}; DBS=${DBS:-2}; NEX=${NEX:-1200}; RS=${RS:-240}
SEED=${TRAIN_SEED:-0}; SFX=$([ "$SEED" = 0 ] || echo "_s$SEED")
DW=${DMS_WEIGHT:-10}; DSFX=$([ "$DW" = 10 ] || echo "_w$DW")$SFX
TEACHER=${TEACHER:-checkpoints/testbed-4k-teacher}; KVP_CKPTS=${KVP_CKPTS:-}
DEADLINE=${DEADLINE:-560}; DEVICE=${DEVICE:-cuda}; TRAIN_SLACK=${TRAIN_SLACK:-150}; TH=${THREADS:-2}
if [ "$DEVICE" = cpu ]; then TRAIN_DEV="--use_cpu True"; else TRAIN_DEV="--bf16"; fi
KNOBS="--knob reasoning.n_facts=10 --knob reasoning.steps=4"
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
left() { local s=$(( DEADLINE - ($(date +%s) - T0) )); echo $(( s > 1 ? s : 1 )); }
tokens() {  # B of a compression ratio, from kvpop_hf's own parse_budgets
  python3 -c "from kvpop_hf.policies import parse_budgets as p
print(p(compression='$1', length=$L, sinks=4, window=$W)[0].B)"; }
mkdir -p "$OUT/ckpt"
for d in "$TEACHER" ${KVP_CKPTS:+"$KVP_CKPTS/rl" "$KVP_CKPTS/supervised"}; do
  [ -d "$d" ] || { echo "missing $d" >&2; exit 2; }
done
python3 -c "from kvpop_hf.policies import parse_budgets as p
cr = '$(printf '0.%s,' ${COMPRESSION_PCT:-75 88 94})'[:-1]
print('budgets:', ', '.join(f'{b.spec}: B = {b.B}, k = {b.topk}' for b in p(compression=cr, length=$L, sinks=4, window=$W)))" \
  || { echo "python3 cannot import kvpop_hf" >&2; exit 2; }

evaluate() {  # out-dir seconds args...  (kvpop-eval of reasoning problems with the 4k knobs)
  local d=$1 s=$2; shift 2
  OMP_NUM_THREADS=$TH timeout "$s" python3 -m kvpop_lab.testbed.evaluate --out "$d" --n "$N" --families reasoning \
    --in-domain reasoning --seed-base "${SEED_BASE:-281474976710656}" --length $L --sinks 4 --window $W $KNOBS \
    --batch-size "$EBS" --device "$DEVICE" \
    --no-progress "$@" > "$d.log" 2>&1
  local rc=$?; stamp "eval ${d##*/} exit $rc"; grep -E "^\| [a-z]" "$d/table1.md" 2>/dev/null
}

train_seconds() {  # the training limit: RS + TRAIN_SLACK, and at least a minute before DEADLINE for the evaluation
  local s cap=$(( RS + TRAIN_SLACK )); s=$(( $(left) - 60 )); echo $(( s < cap ? (s > 1 ? s : 1) : cap ))
}

COMMON_TRAIN="--dataset testbed:reasoning --knob reasoning.n_facts=10 reasoning.steps=4 --seq_len $L --sinks 4
  --lora_rank 8 --merge_lora True --max_steps 100000 --num_examples $NEX --max_train_seconds $RS --learning_rate 1e-3
  --logging_steps 10 --report_to none --save_strategy no --disable_tqdm True --seed $SEED $TRAIN_DEV
  $([ "${LR_DECAY:-0}" = 1 ] && echo --lr_decay_by_time True)"

streaming_plus() {  # NN (75 / 88 / 94): train, then evaluate
  local cr=0.$1 name=streaming_plus_cr$1$SFX B
  B=$(tokens "$cr")
  OMP_NUM_THREADS=$TH timeout "$(train_seconds)" python3 training/retrofit.py --model "$TEACHER" $COMMON_TRAIN \
    --window $((B - 4)) --topk 0 --scorer streaming --per_device_train_batch_size 4 --output_dir "$OUT/ckpt/$name" \
    > "$OUT/train_$name.log" 2>&1
  local rc=$?; stamp "train $name (B = $B, window $((B - 4))) exit $rc"
  grep -o "{'loss'[^}]*}" "$OUT/train_$name.log" | sed -n '$p' | cut -c1-200
  [ $rc = 0 ] && [ "${EVAL:-1}" = 1 ] || return
  local args=(--model "$TEACHER" --compression "$cr" --policies streaming_plus
    --scorer-checkpoint "streaming_plus@cr$1=$OUT/ckpt/$name")
  heldout "$OUT/eval_$name" "${args[@]}"
  evaluate "$OUT/eval_$name" "$(left)" "${args[@]}"
}

heldout() {  # evaluate-dir args...: the held-out evaluation of HELDOUT_SEED_BASE, if set
  [ -n "${HELDOUT_SEED_BASE:-}" ] || return 0
  local d=$1; shift
  SEED_BASE=$HELDOUT_SEED_BASE N=${HELDOUT_N:-40} evaluate "${d}_heldout" "$(left)" "$@"
}

dms() {  # NN: train, then evaluate (compression.json in the evaluation folder)
  local cr=0.$1 name=dms_cr$1$DSFX
  OMP_NUM_THREADS=$TH timeout "$(train_seconds)" python3 training/train_dms.py --model "$TEACHER" $COMMON_TRAIN \
    --compression "$cr" --window $W --penalty one_sided --compression_weight "$DW" --ramp_fraction 0.5 \
    --per_device_train_batch_size "$DBS" --output_dir "$OUT/ckpt/$name" > "$OUT/train_$name.log" 2>&1
  local rc=$?; stamp "train $name exit $rc"
  grep -o "{'loss'[^}]*}" "$OUT/train_$name.log" | sed -n '$p' | cut -c1-240
  [ $rc = 0 ] && [ "${EVAL:-1}" = 1 ] || return
  local args=(--model "$TEACHER" --compression "$cr" --policies dms --scorer-checkpoint "dms@cr$1=$OUT/ckpt/$name")
  EBS=$DEBS heldout "$OUT/eval_$name" "${args[@]}"
  EBS=$DEBS evaluate "$OUT/eval_$name" "$(left)" "${args[@]}"
}

kvp() {  # record the traces, train both KVP agents side by side, evaluate each at every budget of COMPRESSION_PCT
  local nn0 B0 traces=$OUT/kvp_traces.pt obj
  nn0=$(set -- ${COMPRESSION_PCT:-75 88 94}; echo "$1"); B0=$(tokens "0.$nn0")
  local targs=(--model "$TEACHER" --traces-file "$traces" --families reasoning --length $L
    --knob reasoning.n_facts=10 reasoning.steps=4 --train-traces "${KVP_TRACES:-128}" --heldout-traces 8
    --device "$DEVICE" --sinks 4 --window $W --topk $((B0 - 4 - W)) --seed $SEED --baselines knorm,streaming
    --fractions 0.5 --budgets "$B0" --no-progress)
  OMP_NUM_THREADS=$TH timeout "$(left)" python3 training/train_kvp.py "${targs[@]}" --out "$OUT/kvp_record" --steps 0 \
    > "$OUT/train_kvp_record.log" 2>&1
  stamp "kvp traces recorded exit $? ($(du -h "$traces" 2>/dev/null | cut -f1))"
  for obj in rl supervised; do
    ( OMP_NUM_THREADS=$TH timeout "$(train_seconds)" python3 training/train_kvp.py "${targs[@]}" --objective $obj \
        --out "$OUT/ckpt/kvp_$obj$SFX" --steps 1000000 --max-train-seconds "$RS" --save-every 500 \
        > "$OUT/train_kvp_$obj$SFX.log" 2>&1
      stamp "train kvp_$obj$SFX exit $? ($(tail -1 "$OUT/ckpt/kvp_$obj$SFX/train_log.csv" 2>/dev/null))" ) &
  done
  wait
  [ "${EVAL:-1}" = 1 ] || return
  for nn in ${COMPRESSION_PCT:-75 88 94}; do
    evaluate "$OUT/eval_kvp_cr$nn$SFX" "$(left)" --model "$TEACHER" --compression 0.$nn --policies kvp,kvp_supervised \
      --scorer-checkpoint "kvp=$OUT/ckpt/kvp_rl$SFX" --scorer-checkpoint "kvp_supervised=$OUT/ckpt/kvp_supervised$SFX" &
  done
  wait
}

DMS_JOBS=()
case " ${POLICIES:-streaming_plus dms} " in *" kvp "*) kvp & ;; esac
for nn in ${COMPRESSION_PCT:-75 88 94}; do
  case "$nn" in [0-9][0-9]) ;; *) echo "COMPRESSION_PCT holds two-digit percentages (75 88 94), got $nn" >&2; exit 2 ;; esac
  case " ${POLICIES:-streaming_plus dms} " in *" streaming_plus "*) streaming_plus $nn & ;; esac
  case " ${POLICIES:-streaming_plus dms} " in *" dms "*) dms $nn & DMS_JOBS+=($!) ;; esac
done
[ "${UNTRAINED:-1}" = 1 ] && for p in tova h2o snapkv; do
  for nn in 75 94; do
    evaluate "$OUT/eval_${p}_cr$nn" "$(left)" --model "$TEACHER" --compression 0.$nn --policies $p &
  done
done
[ "${UNTRAINED:-1}" = 1 ] && evaluate "$OUT/eval_lagkv_cr94" "$(left)" --model "$TEACHER" --compression 0.94 --policies lagkv &
[ "${UNTRAINED:-1}" = 1 ] && [ -n "$KVP_CKPTS" ] && evaluate "$OUT/eval_kvp_cr94" "$(left)" --model "$TEACHER" --compression 0.94 --policies kvp,kvp_supervised \
  --scorer-checkpoint "kvp=$KVP_CKPTS/rl" --scorer-checkpoint "kvp_supervised=$KVP_CKPTS/supervised" &

[ ${#DMS_JOBS[@]} -gt 0 ] && wait "${DMS_JOBS[@]}"
if [ ${#DMS_JOBS[@]} -gt 0 ]; then  # merge the DMS compression.json files and draw their heatmap
mkdir -p "$OUT/eval_dms$DSFX"
python3 - "$OUT" "$DSFX" ${COMPRESSION_PCT:-75 88 94} > "$OUT/eval_dms$DSFX/merge.log" 2>&1 <<'EOF'
import json, sys
from pathlib import Path
out, sfx = Path(sys.argv[1]), sys.argv[2]
merged = {}
for nn in sys.argv[3:]:
    f = out / f"eval_dms_cr{nn}{sfx}" / "compression.json"
    if f.is_file():
        merged.update(json.loads(f.read_text()))
        print(f"merged {f}")
if merged:
    (out / f"eval_dms{sfx}" / "compression.json").write_text(json.dumps(merged, indent=2) + "\n")
EOF
if [ -f "$OUT/eval_dms$DSFX/compression.json" ]; then
  timeout "$(left)" python3 -m kvpop_hf.baselines.dms.heatmap "$OUT/eval_dms$DSFX/compression.json" \
    "$OUT/eval_dms$DSFX/eviction_ratio_heatmap.png" >> "$OUT/eval_dms$DSFX/merge.log" 2>&1
  stamp "DMS heatmap exit $?"
else
  stamp "DMS heatmap: no compression.json"
fi
fi
wait

stamp "summary"
for f in "$OUT"/eval_*/table1.md; do
  [ -f "$f" ] || continue
  echo "== ${f%/table1.md}"; grep -E "^\| [a-z]" "$f"
done
stamp "done"
