#!/usr/bin/env bash
# Prefill/decode disaggregation against one colocated server on a CPU machine: streaming chats decode while
# long prompts arrive; the chats' inter-token latency is what disaggregation protects. Colocated: one server
# on cores 0-1 (2 threads). Disaggregated: a prefill server on core 0 and a decode server on core 1 (1 thread
# each) behind `llmserve route --pd-disaggregation`. The same two workloads run at once against each setup:
#   chats: NUM_CHATS streamed requests, CHAT_CONCURRENCY at a time (prompts ~256 tokens, outputs 256);
#   long:  NUM_LONG prompts of LONG_LEN tokens (output 16) at LONG_RATE requests/s (Poisson arrivals).
# Reports the chats' ITL p50/p99 and TTFT, the long prompts' TTFT, and the output tok/s of both together.
# NEVER RUN IN CI: minutes per setup on 2 cores.
#
# usage: scripts/pd/itl_side_by_side.sh [--out DIR]
# env: PYTHON (a python that imports llmserve; default python3), MODEL (default: the side-by-side checkpoint in
#      ~/.cache/llmserve-llamacpp/smollm2-135m, made when absent), LONG_LEN (7900), LONG_RATE (0.02),
#      NUM_LONG (3), NUM_CHATS (48), CHAT_CONCURRENCY (8), DTYPE (float32), MAX_MODEL_LEN (8192),
#      MAX_LOCAL_PREFILL (0: every prompt through the prefill server; the router's --max-local-prefill-length),
#      PREFILL_FLAGS, DECODE_FLAGS, ROUTER_FLAGS (more flags for the prefill server, the decode server, the router;
#      e.g. PREFILL_FLAGS="--max-num-partial-prefills 2 --long-prefill-token-threshold 1024")
# The measurement holds /tmp/llmserve-bench.lock.
set -euo pipefail
source "$(dirname "$0")/../lib/servers.sh"

PYTHON=${PYTHON:-python3}
MODEL=${MODEL:-${LLAMACPP_CACHE:-$HOME/.cache/llmserve-llamacpp}/smollm2-135m}
LONG_LEN=${LONG_LEN:-7900} LONG_RATE=${LONG_RATE:-0.02} NUM_LONG=${NUM_LONG:-3}
NUM_CHATS=${NUM_CHATS:-48} CHAT_CONCURRENCY=${CHAT_CONCURRENCY:-8} DTYPE=${DTYPE:-float32}
MAX_MODEL_LEN=${MAX_MODEL_LEN:-8192} MAX_LOCAL_PREFILL=${MAX_LOCAL_PREFILL:-0}
read -r -a PREFILL_EXTRA <<< "${PREFILL_FLAGS:-}"
read -r -a DECODE_EXTRA <<< "${DECODE_FLAGS:-}"
read -r -a ROUTER_EXTRA <<< "${ROUTER_FLAGS:-}"
OUT=/tmp/pd-itl-side-by-side
[[ ${1:-} == --out ]] && OUT=$2
mkdir -p "$OUT"
[[ -d $MODEL ]] || "$PYTHON" -m llmserve.cli make-model --arch llama --shape smollm2-135m --out "$MODEL"

serve() {  # serve NAME CORES THREADS PORT FLAGS...
  start "$1" taskset -c "$2" "$PYTHON" -m llmserve.cli serve "$MODEL" --port "$4" --num-threads "$3" \
    --dtype "$DTYPE" --max-model-len "$MAX_MODEL_LEN" --kv-cache-memory-bytes 3GiB --served-model-name m \
    --log-level warning "${@:5}"
}

workloads() {  # workloads NAME URL: the chats and the long prompts at once, each to $OUT/NAME-*.json
  local common=(--url "$2" --model m --tokenizer "$MODEL" --dataset random --ignore-eos --stream
                --timeout 3600 --no-progress)
  "$PYTHON" -m llmserve.cli bench serve "${common[@]}" --input-len 256 --output-len 256 --range-ratio 0.5 \
    --concurrency "$CHAT_CONCURRENCY" --num-requests "$NUM_CHATS" --seed 1 --out "$OUT/$1-chats.json" \
    > "$OUT/$1-chats.txt" 9>&- &
  local chats=$!
  "$PYTHON" -m llmserve.cli bench serve "${common[@]}" --input-len "$LONG_LEN" --output-len 16 --range-ratio 0 \
    --request-rate "$LONG_RATE" --num-requests "$NUM_LONG" --seed 2 --out "$OUT/$1-long.json" \
    > "$OUT/$1-long.txt" 9>&-
  wait "$chats"
}

take_bench_lock
PIDS=()
trap stop_all EXIT
echo "load average before: $(cat /proc/loadavg) at $(date -u +%H:%M:%S)" | tee "$OUT/loadavg.txt"

serve colocated 0,1 2 8341
wait_healthy 8341 "${PIDS[0]}"
workloads colocated http://127.0.0.1:8341
stop_all

serve prefill 0 1 8342 --disaggregation-mode prefill "${PREFILL_EXTRA[@]}"
serve decode 1 1 8343 --disaggregation-mode decode --disaggregation-kv-port 14591 "${DECODE_EXTRA[@]}"
wait_healthy 8342 "${PIDS[0]}"
wait_healthy 8343 "${PIDS[1]}"
start router taskset -c 0,1 "$PYTHON" -m llmserve.cli route --pd-disaggregation --port 8344 \
  --prefill http://127.0.0.1:8342 --decode http://127.0.0.1:8343 --max-local-prefill-length "$MAX_LOCAL_PREFILL" "${ROUTER_EXTRA[@]}"
wait_healthy 8344 "${PIDS[2]}"
workloads disaggregated http://127.0.0.1:8344
stop_all
echo "load average after: $(cat /proc/loadavg) at $(date -u +%H:%M:%S)" | tee -a "$OUT/loadavg.txt"

"$PYTHON" - "$OUT" <<'EOF'
import json, sys

def run(path):
    with open(path) as f:
        return json.load(f)["runs"][0]["metrics"]

out = sys.argv[1]
rows = {}
for setup in ("colocated", "disaggregated"):
    chats, long = run(f"{out}/{setup}-chats.json"), run(f"{out}/{setup}-long.json")
    tokens = chats["total_output_tokens"] + long["total_output_tokens"]
    rows[setup] = (chats["itl_ms"]["median"], chats["itl_ms"]["p99"], chats["ttft_ms"]["median"],
                   long["ttft_ms"]["median"], tokens / max(chats["duration_s"], long["duration_s"]),
                   chats["num_failed"] + long["num_failed"])
print("| setup | chat ITL p50 (ms) | chat ITL p99 (ms) | chat TTFT p50 (ms) | long TTFT p50 (ms) | out tok/s | failed |")
print("|---|---|---|---|---|---|---|")
for setup, r in rows.items():
    print(f"| {setup} | {r[0]:.1f} | {r[1]:.1f} | {r[2]:.0f} | {r[3]:.0f} | {r[4]:.1f} | {r[5]} |")
c, d = rows["colocated"], rows["disaggregated"]
print(f"chat ITL p99: colocated / disaggregated = {c[1] / d[1]:.2f}x; output tok/s: disaggregated / colocated "
      f"= {d[4] / c[4]:.2f}x")
EOF
