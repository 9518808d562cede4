#!/usr/bin/env bash
# Multi-LoRA serving against the base model, side by side on one server (issue 53): N random rank-16 adapters
# of the smollm2-135m shape, --max-loras SLOTS; `bench serve` sends the same requests naming a random adapter
# (A) or the base model (B), interleaved in rounds. NEVER RUN IN CI.
# usage: [LORA_DTYPE=auto|bfloat16] [NUM_THREADS=$(nproc)] scripts/cpu/lora_side_by_side.sh WORKDIR NUM_ADAPTERS
#        SLOTS CONCURRENCY[,...] [NUM_REQUESTS]
set -euo pipefail
work=$1 num=$2 slots=$3 levels=$4 requests=${5:-64}
py=${PYTHON:-python}
port=${PORT:-8123}
lora_dtype=${LORA_DTYPE:-auto}
threads=${NUM_THREADS:-$(nproc)}
[ -d "$work/base" ] || $py -m llmserve.cli make-model --arch llama --shape smollm2-135m --out "$work/base"
[ -d "$work/ad$num/a$((num - 1))" ] || $py scripts/cpu/make_lora_adapters.py "$work/base" "$work/ad$num" "$num" 16 \
    > /dev/null 2>&1
modules=$(for i in $(seq 0 $((num - 1))); do printf 'a%d=%s/ad%d/a%d ' "$i" "$work" "$num" "$i"; done)
names=$(seq -s, -f 'a%g' 0 $((num - 1)))
$py -m llmserve.cli serve "$work/base" --dtype float32 --served-model-name base --port $port --num-threads "$threads" \
    --enable-lora --lora-dtype "$lora_dtype" --max-loras "$slots" --max-cpu-loras "$num" --max-lora-rank 16 \
    --lora-modules $modules 2> "$work/server.log" &
server=$!
trap 'kill $server' EXIT
until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do sleep 1; done
$py -m llmserve.cli bench serve --url "http://127.0.0.1:$port" --model "$names" \
    --compare "http://127.0.0.1:$port" --compare-model base --labels "lora$num/$slots,base" \
    --concurrency "$levels" --num-requests "$requests" --input-len 128 --output-len 64 --vocab-size 49152 \
    --no-progress
