#!/usr/bin/env bash
# Two of our float32 servers side by side on one CPU machine, differing only in flags (issues 19, 20):
# e.g. float32 weights vs --quantization int8, or KV cache auto vs --kv-cache-dtype fp16. The workload is
# the anchor of scripts/llamacpp/side_by_side.sh (128 requests, prompts 64-512, outputs 32-256,
# ignore_eos, streamed, seed 20), one `bench serve --compare` per level (interleaved A B, B A).
# NEVER RUN IN CI: tens of minutes per level on 2 cores.
#
# usage: scripts/cpu/ours_side_by_side.sh --labels A,B [--a-flags "FLAGS"] [--b-flags "FLAGS"]
#                                         [--a-env "K=V ..."] [--b-env "K=V ..."]
#                                         [--concurrency 16,64] [--num-requests N] [--out DIR]
#   e.g. --labels f32,int8 --b-flags "--quantization int8"; --labels onednn,panels --a-env LLMSERVE_CPU_LINEAR=onednn
#   (later flags win: --b-flags "--dtype bfloat16" serves bf16; N defaults to 128, 24 at concurrency 1)
# env: PYTHON (a python that imports llmserve; default python3), MODEL (default: the side-by-side
#      checkpoint in ~/.cache/llmserve-llamacpp/smollm2-135m, made when absent), PORT_A (8331), PORT_B (8332)
# The measurement holds /tmp/llmserve-bench.lock.
set -euo pipefail
source "$(dirname "$0")/../lib/servers.sh"

PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-${LLAMACPP_CACHE:-$HOME/.cache/llmserve-llamacpp}/smollm2-135m}
PORT_A=${PORT_A:-8331}
PORT_B=${PORT_B:-8332}
CONCURRENCY=16,64 OUT= LABELS= A_FLAGS= B_FLAGS= A_ENV= B_ENV= NUM_REQUESTS=
while [[ $# -gt 0 ]]; do
  case $1 in
    --labels) LABELS=$2; shift 2 ;;
    --a-flags) A_FLAGS=$2; shift 2 ;;
    --b-flags) B_FLAGS=$2; shift 2 ;;
    --a-env) A_ENV=$2; shift 2 ;;
    --b-env) B_ENV=$2; shift 2 ;;
    --num-requests) NUM_REQUESTS=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) sed -n '2,16p' "$0"; exit 2 ;;
  esac
done
[[ $LABELS == *,* ]] || { sed -n '2,16p' "$0"; exit 2; }
LABEL_A=${LABELS%%,*} LABEL_B=${LABELS#*,}
OUT=${OUT:-/tmp/side-by-side-$LABEL_A-$LABEL_B}
read -r -a FLAGS_A <<< "$A_FLAGS"
read -r -a FLAGS_B <<< "$B_FLAGS"
mkdir -p "$OUT"
[[ -d $MODEL ]] || "$PYTHON" -m llmserve.cli make-model --arch llama --shape smollm2-135m --out "$MODEL"

ours() {  # ours NAME PORT ENV FLAGS...: our f32 server in the background (ENV: "K=V ..." or empty)
  local -a envs; read -r -a envs <<< "$3"
  start "$1" env "${envs[@]}" "$PYTHON" -m llmserve.cli serve "$MODEL" --port "$2" --max-model-len 1024 \
    --kv-cache-memory-bytes 3GiB --num-threads "$(nproc)" --dtype float32 "${@:4}"
}

take_bench_lock
PIDS=()
trap stop_all EXIT
for C in ${CONCURRENCY//,/ }; do
  echo "c=$C load average before: $(cat /proc/loadavg) at $(date -u +%H:%M:%S)" | tee -a "$OUT/loadavg.txt"
  ours "$LABEL_A-c$C" "$PORT_A" "$A_ENV" "${FLAGS_A[@]}"
  ours "$LABEL_B-c$C" "$PORT_B" "$B_ENV" "${FLAGS_B[@]}"
  wait_healthy "$PORT_A" "${PIDS[0]}"
  wait_healthy "$PORT_B" "${PIDS[1]}"
  grep -h "engine ready" "$OUT/$LABEL_A-c$C.log" "$OUT/$LABEL_B-c$C.log" | tee -a "$OUT/engines.txt" || true
  compare_anchor "$PORT_A" "$PORT_B" "$LABELS" "$C" "${NUM_REQUESTS:-$([[ $C == 1 ]] && echo 24 || echo 128)}"
  stop_all
done
echo "load average after: $(cat /proc/loadavg) at $(date -u +%H:%M:%S)" | tee -a "$OUT/loadavg.txt"
