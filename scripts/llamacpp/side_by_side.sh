#!/usr/bin/env bash
# llmserve vs llama.cpp's llama-server, side by side on one CPU machine (issues 19, 20).
#
# NEVER RUN IN CI: no test calls this script. It builds C++ (8-12 min on 2 cores) and benchmarks for
# tens of minutes per mode (both levels, 2 cores).
#
# usage: scripts/llamacpp/side_by_side.sh [--build] [--mode f32|bf16|int8] [--concurrency 1,16,64] [--out DIR]
#                                         [--num-requests N] [--ours-flags "FLAGS"] [--isa native|avx2]
#   --build        build llama-server from the llama-cpp-python source distribution (which vendors
#                  llama.cpp) into $LLAMACPP_CACHE; skipped when the binary is there
#   --mode f32     ours float32             vs llama.cpp f32 GGUF   (default)
#   --mode bf16    ours --dtype bfloat16     vs llama.cpp bf16 GGUF  (AVX512-BF16 / AMX machines)
#   --mode int8    ours --quantization int8 vs llama.cpp Q8_0 GGUF
#   --concurrency  levels, one server pair each; 1 is one user at a time (llama-server -np 1)
#   --num-requests requests a level (default 128; 24 at concurrency 1, whose requests run one after another)
#   --ours-flags   more flags for our server (word-split), e.g. "--kv-cache-dtype fp16"; named in its label
#   --isa avx2     both held to the AVX2-only kind on an AVX-512 machine (a proxy for one, docs/cpu.md): llama-server
#                  built without AVX-512 into $LLAMACPP_CACHE/build-avx2 (built when missing, nice'd, -j2), ours
#                  under ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2; f32 and int8 only (the AVX2 kind has no
#                  bf16 dot products). Default native: each built for and running on this CPU as it is.
#
# The workload is the anchor of docs/benchmarks.md: smollm2-135m-shaped random checkpoint, 128 requests,
# prompts 64-512 tokens, outputs 32-256 (ignore_eos), streamed; llama-server runs with -t 2 -np C.
# Both servers are up at once; one `llmserve bench serve --compare` interleaves them (A B, B A).
# The measurement holds /tmp/llmserve-bench.lock (other benchmarks on the machine wait for it).
#
# env: LLAMACPP_CACHE (default ~/.cache/llmserve-llamacpp), LLAMA_CPP_PYTHON_VERSION (0.3.36),
#      PYTHON (a python that imports llmserve; default: python3), PORT_OURS (8321), PORT_LCPP (8322)
set -euo pipefail
source "$(dirname "$0")/../lib/servers.sh"
source "$(dirname "$0")/../lib/llamacpp.sh"

CACHE=${LLAMACPP_CACHE:-$HOME/.cache/llmserve-llamacpp}
VERSION=${LLAMA_CPP_PYTHON_VERSION:-0.3.36}
PYTHON=${PYTHON:-python3}
PORT_OURS=${PORT_OURS:-8321}
PORT_LCPP=${PORT_LCPP:-8322}
SRC=$CACHE/llama_cpp_python-$VERSION/vendor/llama.cpp
SERVER_BIN=$CACHE/build/bin/llama-server
CONVERT_PY=$CACHE/venv/bin/python

BUILD=0 MODE=f32 CONCURRENCY=16,64 OUT= EXTRA_FLAGS= NUM_REQUESTS= ISA=native
while [[ $# -gt 0 ]]; do
  case $1 in
    --build) BUILD=1; shift ;;
    --mode) MODE=$2; shift 2 ;;
    --concurrency) CONCURRENCY=$2; shift 2 ;;
    --out) OUT=$2; shift 2 ;;
    --ours-flags) EXTRA_FLAGS=$2; shift 2 ;;
    --num-requests) NUM_REQUESTS=$2; shift 2 ;;
    --isa) ISA=$2; shift 2 ;;
    *) sed -n '2,28p' "$0"; exit 2 ;;
  esac
done
case $MODE in
  f32) OURS_FLAGS=(--dtype float32); GGUF_TYPE=f32; LABELS=llmserve-f32,llama.cpp-f32 ;;
  bf16) OURS_FLAGS=(--dtype bfloat16); GGUF_TYPE=bf16; LABELS=llmserve-bf16,llama.cpp-bf16 ;;
  int8) OURS_FLAGS=(--dtype float32 --quantization int8); GGUF_TYPE=q8_0; LABELS=llmserve-int8,llama.cpp-q8_0 ;;
  *) echo "--mode f32|bf16|int8" >&2; exit 2 ;;
esac
OURS_ENV=()
case $ISA in
  native) ;;
  avx2)
    [[ $MODE == bf16 ]] && { echo "--isa avx2: no bf16 mode (the AVX2 kind has no bf16 dot products)" >&2; exit 2; }
    SERVER_BIN=$CACHE/build-avx2/bin/llama-server
    OURS_ENV=(ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2)
    LABELS="${LABELS%%,*}-avx2,${LABELS#*,}-avx2" ;;
  *) echo "--isa native|avx2" >&2; exit 2 ;;
esac
if [[ -n $EXTRA_FLAGS ]]; then
  read -r -a EXTRA <<< "$EXTRA_FLAGS"
  OURS_FLAGS+=("${EXTRA[@]}")
  LABELS="${LABELS%%,*}[${EXTRA_FLAGS// /=}],${LABELS#*,}"
fi
OUT=${OUT:-/tmp/side-by-side-$MODE$([[ $ISA == native ]] || echo "-$ISA")}
MODEL=$CACHE/smollm2-135m
mkdir -p "$OUT"
llmserve() { "$PYTHON" -m llmserve.cli "$@"; }

build_llama_cpp() {
  [[ -x $SERVER_BIN ]] && { echo "llama-server already built: $SERVER_BIN"; return; }
  mkdir -p "$CACHE"
  if [[ ! -d $SRC ]]; then
    "$PYTHON" -m pip download --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$CACHE"
    tar xzf "$CACHE/llama_cpp_python-$VERSION.tar.gz" -C "$CACHE"
  fi
  # Nothing that downloads at build time: no curl/openssl, no web UI (prebuilt or built), no tests/examples.
  cmake -S "$SRC" -B "$CACHE/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
  cmake --build "$CACHE/build" -j"$(nproc)" --target llama-server
}

# llama-server held to the AVX2 kind (AVX2, FMA, F16C, BMI2; nothing of AVX-512, AVX-VNNI or AMX) into its own
# build directory, nice'd and on two jobs (the machine is shared); the native build above is left alone.
build_llama_cpp_avx2() {
  [[ -x $SERVER_BIN ]] && { echo "llama-server (AVX2) already built: $SERVER_BIN"; return; }
  [[ -d $SRC ]] || { echo "no $SRC: run once with --build (native) to fetch the sources" >&2; exit 1; }
  nice -n 19 cmake -S "$SRC" -B "$CACHE/build-avx2" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=OFF \
    -DGGML_SSE42=ON -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON -DGGML_AVX_VNNI=OFF \
    -DGGML_AVX512=OFF -DGGML_AVX512_VBMI=OFF -DGGML_AVX512_VNNI=OFF -DGGML_AVX512_BF16=OFF -DGGML_AMX_TILE=OFF \
    -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_APP=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
  nice -n 19 cmake --build "$CACHE/build-avx2" -j2 --target llama-server
}

say_isa() {  # what each server runs on: our kernels' choices; llama-server's CPU backend (its build's ISA options and
  # the AVX-512 (zmm) instructions in it: 0 when held to AVX2)
  local ours lcpp lib
  ours=$(env "${OURS_ENV[@]}" "$PYTHON" -c 'import torch
from llmserve.model import cpu_isa, cpu_kernels
print(f"torch {torch.backends.cpu.get_cpu_capability()}, oneDNN cap {cpu_isa.onednn_isa_cap()}, "
      f"float32 panels {cpu_kernels.panel_isa()}, bf16 dot products {cpu_isa.has_fast_bf16()}")')
  lib=$(dirname "$SERVER_BIN")/libggml-cpu.so
  lcpp="$(grep -o '^GGML_\(NATIVE\|AVX[A-Z0-9_]*\|AMX[A-Z0-9_]*\):BOOL=ON' "$(dirname "$SERVER_BIN")/../CMakeCache.txt" \
    | sed 's/:BOOL=ON//' | tr '\n' ' '); zmm instructions in libggml-cpu.so: $(objdump -d "$lib" | grep -c zmm || true)"
  echo "isa $ISA: llmserve: $ours; llama-server: $lcpp" | tee -a "$OUT/isa.txt"
}


if [[ $ISA == avx2 ]]; then build_llama_cpp_avx2; elif [[ $BUILD == 1 ]]; then build_llama_cpp; fi
[[ -x $SERVER_BIN ]] || { echo "no $SERVER_BIN: run with --build" >&2; exit 1; }
converter_venv
[[ -d $MODEL ]] || "$PYTHON" -m llmserve.cli make-model --arch llama --shape smollm2-135m --out "$MODEL"
GGUF=$CACHE/smollm2-135m-$GGUF_TYPE.gguf
convert "$MODEL" "$GGUF_TYPE" "$GGUF"

"$SERVER_BIN" --version > "$OUT/llama-server-version.txt" 2>&1 || true

say_isa
take_bench_lock
PIDS=()
trap stop_all EXIT
for C in ${CONCURRENCY//,/ }; do
  echo "c=$C load average before: $(cat /proc/loadavg)" | tee -a "$OUT/loadavg.txt"
  start "llmserve-c$C" env "${OURS_ENV[@]}" "$PYTHON" -m llmserve.cli serve "$MODEL" --port "$PORT_OURS" \
    --max-model-len 1024 --kv-cache-memory-bytes 3GiB --num-threads "$(nproc)" "${OURS_FLAGS[@]}"
  # -np C slots (one per bench client) of 768 tokens each: the longest prompt + output.
  start "llama-server-c$C" "$SERVER_BIN" -m "$GGUF" --port "$PORT_LCPP" -t 2 -np "$C" -c $((C * 768))
  wait_healthy "$PORT_OURS" "${PIDS[0]}"
  wait_healthy "$PORT_LCPP" "${PIDS[1]}"
  compare_anchor "$PORT_OURS" "$PORT_LCPP" "$LABELS" "$C" "${NUM_REQUESTS:-$([[ $C == 1 ]] && echo 24 || echo 128)}"
  stop_all
done
echo "load average after: $(cat /proc/loadavg)" | tee -a "$OUT/loadavg.txt"
