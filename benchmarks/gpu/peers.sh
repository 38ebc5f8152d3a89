#!/usr/bin/env bash
# The peers comparison in one GPU call (ends within DEADLINE, 570 s): kvpress 0.5.5 beside KVpop on the table of
# record's 80 problems (quality, docs/peers.md) and on Qwen3-8B-shaped decoding (speed and memory), in processes
# of their own:
#   * kvpress runs in its own package set (it needs transformers < 5.3): its wheels travel in .whl/kvpress and are
#     installed offline into /tmp/kvpress_site, which only the kvpress processes see (PYTHONPATH=/tmp/kvpress_site:
#     benchmarks; kvpop_hf is not on their path);
#   * quality: KVPRESS_PROCS processes of kvpop_lab.peers.run_kvpress and OURS_PROCS of kvpop_lab.peers.run_ours, each
#     on the problems i % N == its shard, float32, batch 1, eager, on the GPU in the background; then the shards are
#     merged (kvpop_lab.peers.runfiles --merge) and scored (kvpop_lab.peers.score); they run at nice 10, so the
#     speed processes' compilation keeps its CPU;
#   * speed, meanwhile, one process after another: kvpop_lab.peers.speed_kvpress (kvpress knorm,
#     PrefillDecodingPress holding B = 12% of the context), kvpop_lab.peers.speed_ours --system kvpop (KVpop's
#     fastest documented path at the same B) and --system static (StaticCache + compile, the whole context) on
#     SPEED_ROWS, joined by kvpop_lab.peers.speed_table. A measurement takes the GPU from the quality processes for
#     what it times (kvpop_lab.peers.device_lock), so their work overlaps only its compilation.
#   * TRIM-KV is not run: its package imports flash-attn, which cannot be built there (docs/peers.md).
# Every phase has a time limit inside DEADLINE; rows and problems are written as they finish, and the tables count
# what finished (a speed row never reached reads "not run"; the quality table the first problems all runs finished).
#
# The wheels, once, here (Python 3.12 on the GPU machine; ~15 MB, pure Python but tokenizers; .whl/ is git-ignored):
#   P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
#      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl/kvpress"
#   for s in kvpress==0.5.5 transformers==5.2.0 tokenizers==0.22.2 datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19 \
#            cachetools==5.5.2 termcolor==3.3.0; do python3 -m pip download $P $s; done
#   python3 -m pip wheel --no-deps --no-binary=fire -w .whl/kvpress fire==0.6.0   # fire 0.6.0 has no wheel to download
# (kvpress imports datasets, cachetools and fire at import; the GPU image has the rest of its and transformers'
# needs: accelerate, pandas, pyarrow, numpy, requests, peft, safetensors, huggingface_hub, tqdm, xxhash, six.)
#
# Run:   OUT=dir KVPOP_GIT_COMMIT=<commit> bash benchmarks/gpu/peers.sh          (carry: .whl)
# Knobs: LIMIT (problems, 80), DEADLINE (seconds from the start, 570), KVPRESS_PROCS (8), OURS_PROCS (6),
#        PRESSES / POLICIES / COMPRESSIONS (the runners' lists; all, all, 0.88,0.94), SPEED_ROWS ("32768x1 131072x1
#        32768x8 32768x32"), SPEED_KVPRESS_S / SPEED_KVPOP_S / SPEED_STATIC_S (caps, 100 / 270 / 200 s), PHASES
#        ("quality speed"), RESUME_FROM (a folder holding an earlier call's raw.tar unpacked: the problems its
#        kvpress/all and kvpop/all hold are skipped and merged back in, so a quality table that stopped short is
#        finished by the next call; carry the folder), KVPRESS_PYTHON (an interpreter that already has kvpress), WORK
#        (/tmp/peers_gpu), PEERS_CHECK_ONLY=1 (check the arguments and stop).
# CPU smoke run (tiny shape, 2 problems, dense and K-Norm at 94%; about a minute on this 2-core machine):
#   DEVICE=cpu KVPRESS_PYTHON=/work/peers/kvpress-venv/bin/python OUT=/tmp/peers_smoke PATH=/work/venv/bin:$PATH \
#     bash benchmarks/gpu/peers.sh
# Writes to OUT (at most 8 files): peers.log, quality_4k.csv, compare.md, speed.csv, speed.md, raw.tar (the merged
# run folders, the speed rows, every process's log).
set -u
: "${OUT:?set OUT to an output directory}"
DEVICE=${DEVICE:-cuda}
case "$DEVICE" in
  cuda)
    LIMIT=${LIMIT:-80}; DEADLINE=${DEADLINE:-570}; KVPRESS_PROCS=${KVPRESS_PROCS:-8}; OURS_PROCS=${OURS_PROCS:-6}
    PRESSES=${PRESSES:-dense,snapkv,knorm,streaming,tova,keydiff}; POLICIES=${POLICIES:-$PRESSES}
    COMPRESSIONS=${COMPRESSIONS:-0.88,0.94}; SHAPE=qwen3-8b; SPEED_ROWS=${SPEED_ROWS:-32768x1 131072x1 32768x8 32768x32}
    SYNTHETIC_FROM=8; NEW=48; WARM=8 ;;
  cpu)  # the smoke run: the same pipeline on a tiny shape and a few problems and configurations
    LIMIT=${LIMIT:-2}; DEADLINE=${DEADLINE:-1200}; KVPRESS_PROCS=${KVPRESS_PROCS:-2}; OURS_PROCS=${OURS_PROCS:-1}
    PRESSES=${PRESSES:-dense,knorm}; POLICIES=${POLICIES:-$PRESSES}; COMPRESSIONS=${COMPRESSIONS:-0.94}
    SHAPE=tiny; SPEED_ROWS=${SPEED_ROWS:-1024x1 2048x1 1024x2 1024x4}; SYNTHETIC_FROM=2; NEW=12; WARM=2 ;;
  *) echo "DEVICE must be cuda or cpu, got '$DEVICE'" >&2; exit 2 ;;
esac
PHASES=${PHASES:-quality speed}
SPEED_KVPRESS_S=${SPEED_KVPRESS_S:-100}; SPEED_KVPOP_S=${SPEED_KVPOP_S:-270}; SPEED_STATIC_S=${SPEED_STATIC_S:-200}
WORK=${WORK:-/tmp/peers_gpu}; RESERVE=20  # seconds kept after the last phase for merging, scoring and packing

bad() { echo "peers.sh: $*" >&2; exit 2; }
[ -f benchmarks/gpu/lab_env.sh ] || bad "run me from the repository root (benchmarks/gpu/lab_env.sh not found in $PWD)"
for v in LIMIT DEADLINE KVPRESS_PROCS OURS_PROCS SPEED_KVPRESS_S SPEED_KVPOP_S SPEED_STATIC_S; do
  [[ ${!v} =~ ^[0-9]+$ ]] && [ "${!v}" -ge 1 ] || bad "$v must be a whole number >= 1, got '${!v}'"
done
[ "$LIMIT" -le 80 ] || bad "LIMIT must be <= 80 (the table of record has 80 problems), got $LIMIT"
[ "$KVPRESS_PROCS" -le "$LIMIT" ] && [ "$OURS_PROCS" -le "$LIMIT" ] \
  || bad "KVPRESS_PROCS ($KVPRESS_PROCS) and OURS_PROCS ($OURS_PROCS) must be <= LIMIT ($LIMIT): a shard needs a problem"
[ "$DEADLINE" -ge 120 ] || bad "DEADLINE must be >= 120 seconds, got $DEADLINE"
for r in $SPEED_ROWS; do [[ $r =~ ^[0-9]+x[0-9]+$ ]] || bad "SPEED_ROWS: '$r' is not CONTEXTxBATCH (e.g. 32768x1)"; done
for p in $PHASES; do [[ $p == quality || $p == speed ]] || bad "PHASES: '$p' is neither quality nor speed"; done
if [ -z "${KVPRESS_PYTHON:-}" ] && ! compgen -G ".whl/kvpress/kvpress-*.whl" >/dev/null; then
  bad "no kvpress wheel in .whl/kvpress: download the wheels (this script's header) and carry .whl, or set KVPRESS_PYTHON"
fi
[ "${PEERS_CHECK_ONLY:-0}" = 1 ] && { echo "peers.sh: arguments fine"; exit 0; }

T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( DEADLINE - ($(date +%s) - T0) - RESERVE )); }  # seconds a phase may still take
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source benchmarks/gpu/lab_env.sh
source benchmarks/gpu/pack.sh

main() {
rm -rf "$WORK"; mkdir -p "$WORK/logs"
LOCK=$WORK/device_lock; P=$WORK/problems.jsonl
stamp "DEVICE=$DEVICE LIMIT=$LIMIT DEADLINE=$DEADLINE KVPRESS_PROCS=$KVPRESS_PROCS OURS_PROCS=$OURS_PROCS PHASES='$PHASES'"
[ "$DEVICE" = cuda ] && nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv,noheader

# --- kvpress's environment: its own transformers, seen by the kvpress processes only
if [ -n "${KVPRESS_PYTHON:-}" ]; then
  KVP_PY=$KVPRESS_PYTHON; KVP_PATH=benchmarks
else
  KVP_PY=python3; KVP_PATH=/tmp/kvpress_site:benchmarks
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/kvpress_site \
    .whl/kvpress/*.whl || stamp "kvpress wheels did not install"
fi
KVP=(env PYTHONPATH="$KVP_PATH" OMP_NUM_THREADS=1 "$KVP_PY")  # a kvpress process: kvpop_hf is not on its path
if "${KVP[@]}" -c "import kvpress, transformers, torch; from importlib.metadata import version as v; \
print('kvpress', v('kvpress'), 'transformers', transformers.__version__, 'torch', torch.__version__)"; then KVP_OK=1
else KVP_OK=0; stamp "kvpress does not import: its rows are skipped"; fi

python3 -m kvpop_lab.peers.export --out "$P" --n "$LIMIT" || bad "could not write the problems"

# --- quality, in the background: shards of the problems, the device taken shared for each generation
QPIDS=(); DONE_KVPRESS=(); DONE_KVPOP=()
if [ -n "${RESUME_FROM:-}" ]; then  # an earlier call's raw.tar, unpacked: its problems are skipped, then merged in
  [ -f "$RESUME_FROM/kvpress/all/meta.json" ] && DONE_KVPRESS=(--done-in "$RESUME_FROM/kvpress/all")
  [ -f "$RESUME_FROM/kvpop/all/meta.json" ] && DONE_KVPOP=(--done-in "$RESUME_FROM/kvpop/all")
  stamp "resuming from $RESUME_FROM: kvpress ${DONE_KVPRESS[1]:-none}, kvpop ${DONE_KVPOP[1]:-none}"
fi
if [[ " $PHASES " == *" quality "* ]]; then
  QT=$(left)
  if [ "$KVP_OK" = 1 ]; then
    for ((i = 0; i < KVPRESS_PROCS; i++)); do
      nice -n 10 timeout "$QT" "${KVP[@]}" -m kvpop_lab.peers.run_kvpress --problems "$P" \
        --out "$WORK/kvpress/s$i" --shard "$i/$KVPRESS_PROCS" --device "$DEVICE" --device-lock "$LOCK" --threads 1 \
        --presses "$PRESSES" --compressions "$COMPRESSIONS" "${DONE_KVPRESS[@]}" > "$WORK/logs/run_kvpress_s$i.log" 2>&1 &
      QPIDS+=($!)
    done
  fi
  for ((i = 0; i < OURS_PROCS; i++)); do
    OMP_NUM_THREADS=1 nice -n 10 timeout "$QT" python3 -m kvpop_lab.peers.run_ours --problems "$P" --out "$WORK/kvpop/s$i" \
      --shard "$i/$OURS_PROCS" --device "$DEVICE" --device-lock "$LOCK" --policies "$POLICIES" \
      --compressions "$COMPRESSIONS" "${DONE_KVPOP[@]}" > "$WORK/logs/run_ours_s$i.log" 2>&1 &
    QPIDS+=($!)
  done
  stamp "quality: ${#QPIDS[@]} processes, at most $QT s"
fi

# --- speed, one process after another, each capped
speed() {  # name cap command...: run it with the smaller of its cap and the time left
  local name=$1 cap=$2 t; shift 2
  t=$(left); [ "$cap" -lt "$t" ] && t=$cap
  if [ "$t" -lt 30 ]; then stamp "speed $name: not run ($t s left)"; return; fi
  [ "$DEVICE" = cuda ] && stamp "GPU memory used before $name: $(nvidia-smi --query-gpu=memory.used --format=csv,noheader)"
  stamp "speed $name: at most $t s"
  timeout "$t" "$@" > "$WORK/logs/speed_$name.log" 2>&1
  stamp "speed $name: exit $? ($(grep -c . "$WORK/speed_$name.jsonl" 2>/dev/null || echo 0) rows)"
  grep -v -i warn "$WORK/logs/speed_$name.log" | tail -n 8
}
COMMON=(--device "$DEVICE" --shape "$SHAPE" --rows $SPEED_ROWS --new-tokens "$NEW" --warmup "$WARM" --device-lock "$LOCK")
if [[ " $PHASES " == *" speed "* ]]; then
  [ "$KVP_OK" = 1 ] && speed kvpress "$SPEED_KVPRESS_S" "${KVP[@]}" -m kvpop_lab.peers.speed_kvpress "${COMMON[@]}" \
    --press knorm --mode decoding --out "$WORK/speed_kvpress.jsonl"
  speed kvpop "$SPEED_KVPOP_S" python3 -m kvpop_lab.peers.speed_ours --system kvpop "${COMMON[@]}" \
    --synthetic-from "$SYNTHETIC_FROM" --out "$WORK/speed_kvpop.jsonl"
  speed static "$SPEED_STATIC_S" python3 -m kvpop_lab.peers.speed_ours --system static "${COMMON[@]}" \
    --synthetic-from "$SYNTHETIC_FROM" --lock-whole-from "$SYNTHETIC_FROM" --out "$WORK/speed_static.jsonl"
  # shellcheck disable=SC2086  # the rows are words
  python3 -m kvpop_lab.peers.speed_table --kvpop "$WORK/speed_kvpop.jsonl" --kvpress "$WORK/speed_kvpress.jsonl" \
    --static "$WORK/speed_static.jsonl" --rows $SPEED_ROWS --out "$OUT/speed.csv" --markdown "$OUT/speed.md"
fi

# --- the quality table from what the shards finished
if [ ${#QPIDS[@]} -gt 0 ]; then
  stamp "waiting for the quality processes"
  wait "${QPIDS[@]}"
  stamp "quality processes done"; tail -qn 2 "$WORK"/logs/run_*.log
  merge() {  # lib: the shards that wrote a meta.json, joined into WORK/lib/all
    local parts=() d
    [ -n "${RESUME_FROM:-}" ] && [ -f "$RESUME_FROM/$1/all/meta.json" ] && parts+=("$RESUME_FROM/$1/all")
    for d in "$WORK/$1"/s*; do [ -f "$d/meta.json" ] && parts+=("$d"); done
    [ ${#parts[@]} -gt 0 ] && python3 -m kvpop_lab.peers.runfiles --merge "$WORK/$1/all" "${parts[@]}" > /dev/null
  }
  merge kvpop; [ "$KVP_OK" = 1 ] && merge kvpress
  if [ -f "$WORK/kvpress/all/meta.json" ] && [ -f "$WORK/kvpop/all/meta.json" ]; then
    python3 -m kvpop_lab.peers.score --problems "$P" --kvpress "$WORK/kvpress/all" --kvpop "$WORK/kvpop/all" \
      --out "$OUT/quality_4k.csv" --compare "$OUT/compare.md" \
      --kvpress-command "OUT=... bash benchmarks/gpu/peers.sh: $KVPRESS_PROCS x run_kvpress --device $DEVICE --shard I/$KVPRESS_PROCS (PYTHONPATH=<kvpress site>:benchmarks), merged" \
      --kvpop-command "OUT=... bash benchmarks/gpu/peers.sh: $OURS_PROCS x run_ours --device $DEVICE --shard I/$OURS_PROCS, merged" \
      || stamp "scoring failed"
  else
    stamp "no quality table: a library's runs are missing (see the logs in raw.tar)"
  fi
fi

echo "TRIM-KV: not run. trimkv 0.1.5 imports flash_attn unconditionally; flash-attn comes as source only, and its build \
fetches a prebuilt wheel over the network or compiles its CUDA kernels for far longer than this call, and this machine \
reaches no network (docs/peers.md, TRIM-KV's row)."
local items=() x
for x in logs kvpress/all kvpop/all; do [ -e "$WORK/$x" ] && items+=("$x"); done
pack raw "${items[@]}" 'speed_*.jsonl'
stamp "done; $OUT holds: $(cd "$OUT" && echo *)"
}

main 2>&1 | tee -a "$OUT/peers.log"
exit "${PIPESTATUS[0]}"
