#!/usr/bin/env bash
# A small Mixture-of-Experts model on CPU, side by side (issue 47): our server on it against our server on a dense
# model with the same active parameters, and against llama.cpp's llama-server on the same MoE weights.
# NEVER RUN IN CI: tens of minutes per level on 2 cores.
#
# usage: scripts/moe/side_by_side.sh [--concurrency 16,64] [--num-requests N] [--num-threads T] [--vs WHAT] [--out DIR]
#   --num-requests  requests a comparison and level (default 2 x C: each of the two interleaved rounds at full
#                   concurrency)
#   --num-threads   threads of each engine (default 2: ours --num-threads T, llama-server -t T); 1 where other
#                   jobs load the cores (two OpenMP threads then wait on each other: docs/benchmarks.md,
#                   "The CPU engine under a noisy neighbour")
#   --vs            dense, llama.cpp or both (default): the comparisons run at each level
#
# Checkpoints (random weights, made by transformers through `make-model` when absent, in $LLAMACPP_CACHE):
#   qwen3moe-135m-a  --arch qwen3_moe --shape smollm2-135m-moe: smollm2-135m's layers, 8 experts, top-2, each
#                    expert half the dense MLP's width (~135M active parameters a token, ~350M in all)
#   qwen3-135m       --arch qwen3 --shape smollm2-135m: the same layers with the dense MLP
# The MoE one is converted to an f32 GGUF by llama.cpp's own converter (scripts/lib/llamacpp.sh).
# Per level two `bench serve --compare` runs of the anchor workload (scripts/lib/servers.sh: prompts 64-512,
# outputs 32-256, ignore_eos, streamed, seed 20), each with its two servers up and its requests interleaved
# A B, B A: ours MoE vs ours dense, then ours MoE vs llama.cpp. Both engines in float32 on T threads:
# `--num-threads T` and `llama-server -t T -np C -c C*768`. llama-server must be built already
# (scripts/llamacpp/side_by_side.sh --build). The measurement holds /tmp/llmserve-bench.lock.
#
# env: LLAMACPP_CACHE (default ~/.cache/llmserve-llamacpp), LLAMA_CPP_PYTHON_VERSION (0.3.36),
#      PYTHON (a python that imports llmserve; default python3), PORT_A (8351), PORT_B (8352)
set -euo pipefail
source "$(dirname "$0")/../lib/servers.sh"
source "$(dirname "$0")/../lib/llamacpp.sh"

CACHE=${LLAMACPP_CACHE:-$HOME/.cache/llmserve-llamacpp}
SRC=$CACHE/llama_cpp_python-${LLAMA_CPP_PYTHON_VERSION:-0.3.36}/vendor/llama.cpp
SERVER_BIN=$CACHE/build/bin/llama-server
CONVERT_PY=$CACHE/venv/bin/python
PYTHON=${PYTHON:-python3}
PORT_A=${PORT_A:-8351}
PORT_B=${PORT_B:-8352}
CONCURRENCY=16,64 OUT= NUM_REQUESTS= THREADS=2 VS=both
while [[ $# -gt 0 ]]; do
  case $1 in
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --num-requests) NUM_REQUESTS=$2; shift 2 ;;
    --num-threads) THREADS=$2; shift 2 ;;
    --vs) VS=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    *) sed -n '2,25p' "$0"; exit 2 ;;
  esac
done
[[ $VS == dense || $VS == llama.cpp || $VS == both ]] || { echo "--vs: dense, llama.cpp or both" >&2; exit 2; }
OUT=${OUT:-/tmp/side-by-side-moe}
MOE=$CACHE/qwen3moe-135m-a
DENSE=$CACHE/qwen3-135m
GGUF=$CACHE/qwen3moe-135m-a-f32.gguf
MODEL=$MOE  # the tokenizer compare_anchor reads (both checkpoints have the same)
mkdir -p "$OUT"
[[ -x $SERVER_BIN ]] || { echo "no $SERVER_BIN: build it with scripts/llamacpp/side_by_side.sh --build" >&2; exit 1; }
[[ -d $MOE ]] || "$PYTHON" -m llmserve.cli make-model --arch qwen3_moe --shape smollm2-135m-moe --out "$MOE"
[[ -d $DENSE ]] || "$PYTHON" -m llmserve.cli make-model --arch qwen3 --shape smollm2-135m --out "$DENSE"
converter_venv
convert "$MOE" f32 "$GGUF"
"$SERVER_BIN" --version > "$OUT/llama-server-version.txt" 2>&1 || true

ours() {  # ours NAME PORT CHECKPOINT: our f32 server on $THREADS threads, in the background
  start "$1" "$PYTHON" -m llmserve.cli serve "$3" --port "$2" --max-model-len 1024 --kv-cache-memory-bytes 3GiB \
    --num-threads "$THREADS" --dtype float32
}

compare() {  # compare C N LABELS: the two servers started last, once healthy, then stopped
  wait_healthy "$PORT_A" "${PIDS[0]}"
  wait_healthy "$PORT_B" "${PIDS[1]}"
  echo "$3 c=$1 load average before: $(cat /proc/loadavg) at $(date -u +%H:%M:%S)" | tee -a "$OUT/loadavg.txt"
  compare_anchor "$PORT_A" "$PORT_B" "$3" "$1" "$2"
  mv "$OUT/results-c$1.json" "$OUT/results-${3//,/-}-c$1.json"
  mv "$OUT/table-c$1.txt" "$OUT/table-${3//,/-}-c$1.txt"
  stop_all
}

take_bench_lock
PIDS=()
trap stop_all EXIT
for C in ${CONCURRENCY//,/ }; do
  N=${NUM_REQUESTS:-$((2 * C))}
  if [[ $VS != llama.cpp ]]; then
    ours "moe-c$C" "$PORT_A" "$MOE"
    ours "dense-c$C" "$PORT_B" "$DENSE"
    compare "$C" "$N" llmserve-moe,llmserve-dense
  fi
  if [[ $VS != dense ]]; then
    ours "moe-vs-lcpp-c$C" "$PORT_A" "$MOE"
    start "llama-server-c$C" "$SERVER_BIN" -m "$GGUF" --port "$PORT_B" -t "$THREADS" -np "$C" -c $((C * 768))
    compare "$C" "$N" llmserve-moe,llama.cpp-moe
  fi
done
echo "load average after: $(cat /proc/loadavg) at $(date -u +%H:%M:%S)" | tee -a "$OUT/loadavg.txt"
