#!/usr/bin/env bash
# Two of our float32 servers side by side on one CPU machine: KV cache float32 (auto) vs --kv-cache-dtype
# fp16 (issue 19), on the anchor workload of scripts/llamacpp/side_by_side.sh (128 requests, prompts
# 64-512, outputs 32-256, ignore_eos, streamed, seed 20), one `bench serve --compare` per level
# (interleaved A B A B). NEVER RUN IN CI: tens of minutes per level on 2 cores.
#
# usage: scripts/cpu/kv_dtype_side_by_side.sh [--concurrency 16,64] [--out DIR]
# env: PYTHON (a python that imports llmserve; default python3), MODEL (default: the side-by-side
#      checkpoint in ~/.cache/llmserve-llamacpp/smollm2-135m, made when absent), PORT_A (8331), PORT_B (8332)
# The measurement holds /tmp/llmserve-bench.lock.
set -euo pipefail
source "$(dirname "$0")/../lib/servers.sh"

PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-${LLAMACPP_CACHE:-$HOME/.cache/llmserve-llamacpp}/smollm2-135m}
PORT_A=${PORT_A:-8331}
PORT_B=${PORT_B:-8332}
CONCURRENCY=16,64 OUT=/tmp/kv-dtype-side-by-side
while [[ $# -gt 0 ]]; do
  case $1 in
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) sed -n '2,10p' "$0"; exit 2 ;;
  esac
done
mkdir -p "$OUT"
[[ -d $MODEL ]] || "$PYTHON" -m llmserve.cli make-model --arch llama --shape smollm2-135m --out "$MODEL"

ours() {  # ours NAME PORT FLAGS...: our f32 server in the background
  start "$1" "$PYTHON" -m llmserve.cli serve --model "$MODEL" --port "$2" --max-model-len 1024 \
    --kv-cache-memory 3GiB --dtype float32 "${@:3}"
}

take_bench_lock
PIDS=()
trap stop_all EXIT
for C in ${CONCURRENCY//,/ }; do
  echo "c=$C load average before: $(cat /proc/loadavg) at $(date -u +%H:%M:%S)" | tee -a "$OUT/loadavg.txt"
  ours "kv-f32-c$C" "$PORT_A"
  ours "kv-fp16-c$C" "$PORT_B" --kv-cache-dtype fp16
  wait_healthy "$PORT_A" "${PIDS[0]}"
  wait_healthy "$PORT_B" "${PIDS[1]}"
  grep -h "engine ready" "$OUT/kv-f32-c$C.log" "$OUT/kv-fp16-c$C.log" | tee -a "$OUT/engines.txt" || true
  compare_anchor "$PORT_A" "$PORT_B" kv-f32,kv-fp16 "$C"
  stop_all
done
echo "load average after: $(cat /proc/loadavg) at $(date -u +%H:%M:%S)" | tee -a "$OUT/loadavg.txt"
