#!/usr/bin/env bash
# On a 2-GPU host: LoRA retrofit of a ~1B random-init Qwen3-shaped model
# with the same data / seed / global batch on 1 GPU, with DDP (accelerate launch, training/accelerate_ddp.yaml)
# and with FSDP2 (training/accelerate_fsdp.yaml); loss curves, tokens/s per GPU, peak memory per GPU.
# Usage (repo root):  OUT=/some/empty/dir bash benchmarks/gpu/multi_gpu.sh      (~4 minutes)
# The recorded run (study multi_gpu in results/studies.csv) used the defaults below; longer stage limits give more steps, e.g.
# SINGLE_S=150 DDP_S=120 FSDP_S=120 RUN_S=420 OUTER_S=430.
# Results: $OUT/multi_gpu.md, multi_gpu.json, multi_gpu_loss.png, logs.tgz (stage logs + raw per-rank files).
set -u
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
source benchmarks/gpu/lab_env.sh
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s)
stamp() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
: "${OUT:?set OUT to an (empty) output directory}"
mkdir -p "$OUT"
timeout 10 nvidia-smi -L || true
stamp "run (${RUN_S:-215} s)"
# the driver guards each stage itself (prepare / 1gpu / ddp / fsdp, each in its own process group with a
# time limit); this outer timeout is the last resort
timeout "${OUTER_S:-225}" python3 benchmarks/multi_gpu_retrofit.py run --device "${DEVICE:-cuda}" --out "$OUT/work" ${EXTRA:-} \
  --scratch /tmp/kvpop_multi_gpu --seconds "${RUN_S:-215}" --layers "${LAYERS:-20}" --seq-len "${SEQ_LEN:-2048}" \
  --steps "${STEPS:-30}" --window "${WINDOW:-128}" --topk "${TOPK:-124}" --lora-rank 16 --warmup-steps 3 \
  --prepare-s "${PREPARE_S:-40}" --single-s "${SINGLE_S:-70}" --ddp-s "${DDP_S:-50}" --fsdp-s "${FSDP_S:-55}" \
  --startup-s "${STARTUP_S:-30}" ${EXTRA2:-} > "$OUT/run.log" 2>&1
echo "driver rc=$?"; tail -45 "$OUT/run.log"
stamp "report (again, in case the driver was cut short)"
[ -f "$OUT/work/multi_gpu.md" ] || timeout 20 python3 benchmarks/multi_gpu_retrofit.py report --out "$OUT/work" > /dev/null 2>&1
stamp pack
cd "$OUT" && cp work/multi_gpu.md work/multi_gpu.json . 2>/dev/null; cp work/multi_gpu_loss.png . 2>/dev/null
tar czf logs.tgz run.log work/logs work/raw 2>/dev/null; rm -rf work run.log
ls -la "$OUT"
stamp done
