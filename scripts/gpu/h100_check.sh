#!/usr/bin/env bash
# One lease on an H100 (the device tool): install without network, run the GPU tests, then measure the
# targets of issues 15 (host overhead), 20 (fp8) and 18 (speculation) on the Llama-3.1-8B shape in bf16.
# Each stage has its own time limit and the run keeps a deadline, so a stage that breaks or hangs costs
# only its own slot. Everything lands in $OUT: summary.txt (one line a stage, printed last) and res.tgz
# (every log and results JSON).
#
#   usage (device tool, .whl carried): bash scripts/gpu/h100_check.sh [budget_s] [stages]
#   stages: comma list of tests,fp8probe,fp8sweep,gemvprobe,roofline,offline,serve,stepprof,arrivals,fp8,fp8serve,specprof,spec,specdyn
#   (default: all but fp8probe, fp8sweep, gemvprobe, stepprof, fp8serve, specprof and specdyn, in that order); TESTS: the test
#   paths (default below); SPEC_ARGS: extra `bench spec` arguments, SPEC_CONFIGS / SPEC_CONCURRENCY its
#   configurations and batch sizes, SPEC_LIMIT its time limit (default 110 s)
#   fp8serve: a bf16 server and an fp8 one (--quantization fp8 --kv-cache-dtype $FP8_KV, default fp8; the
#   same KV bytes) at once, their start-up block counts and one `bench serve --compare` at c=256 (issue 20's targets)
#   WEIGHTS: copying (default: make-model --copying, an induction circuit in layers 0-1 that continues
#   repeated spans with clear argmaxes, so that n-gram lookup finds drafts and the oracle keeps its nominal A
#   in bf16; the same cost), peaked (--peaked-logits), random, or dummy (no checkpoint: --load-format dummy,
#   ~100 s less a lease; speed stages only)
#   STEPPROF_AB=1: stepprof also with LLMSERVE_FUSED_ELEMENTWISE=off, first; STEPPROF_SCHEMA=FILE: each batch
#   size also with that JSON schema on every request; STEPPROF_LIMIT: its seconds (150)
#   SERVE_RUNS: the serve stage's runs (default c64,c256,c1024,c1,c64greedy; json: c=16,64 with and without a schema);
#   SERVE_ARGS: more `serve` flags (e.g. --max-cudagraph-capture-size 1024); STEPPROF_ARGS: LLM keyword arguments
#   for stepprof and arrivals as JSON (e.g. '{"max_graph_batch": 1024}'), STEPPROF_PARAMS its sampling over the
#   defaults, STEPPROF_PARAMS_B other sampling for a second stepprof (an A/B); ARRIVALS_AB=1: arrivals also with decode graphs only (mixed steps eager), second;
#   ROOFLINE_LONG=N: roofline also at an N-token prompt, with the decode keys split and whole (an A/B)
#   GEMV_AB=1: roofline also with LLMSERVE_CUDA_GEMV_ROWS=16 (the Triton GEMV for a few rows, second);
#   gemvprobe: scripts/gpu/gemv_probe.py (each linear at 1-16 rows, cuBLAS vs the Triton GEMV; GEMV_SWEEP=1 ranks tilings)
#   SHAPE=tiny DEVICE=cpu bash scripts/gpu/h100_check.sh 300   # a dry run of the commands on CPU
set -u
BUDGET=${1:-560}
STAGES=${2:-tests,roofline,offline,serve,fp8,spec}
SHAPE=${SHAPE:-llama-3.1-8b}
DEVICE=${DEVICE:-cuda}
OUT=${OUT:-/tmp/h100-out}
RES=/tmp/h100-res
MODEL=/tmp/model-$SHAPE
mkdir -p "$OUT" "$RES"
T0=$(date +%s)
elapsed() { echo $(( $(date +%s) - T0 )); }
note() { echo "[$(elapsed)s] $*" | tee -a "$OUT/summary.txt"; }
left() { echo $(( BUDGET - $(elapsed) )); }
pack() { tar -czf "$OUT/res.tgz" -C "$RES" . 2>/dev/null; }
want() { [[ ",$STAGES," == *",$1,"* ]]; }
wait_up() {  # wait_up PORT PID TRIES: until the server answers /health, exits, or TRIES seconds pass
    for _ in $(seq 1 "$3"); do
        kill -0 "$2" 2>/dev/null || return
        "$PY" -c "import urllib.request as u; u.urlopen('http://127.0.0.1:$1/health', timeout=2)" 2>/dev/null && return
        sleep 1
    done
}
# run NAME LIMIT CMD...: the command under min(LIMIT, time left - 15 s), output to $RES/NAME.log
run() {
    local name=$1 limit=$2; shift 2
    local avail=$(( $(left) - 15 ))
    (( avail < limit )) && limit=$avail
    if (( limit < 20 )); then note "$name: skipped, no time left"; return 1; fi
    timeout -k 5 "$limit" "$@" >"$RES/$name.log" 2>&1
    local rc=$?
    note "$name: rc=$rc ($limit s allowed) | $(grep -E '^\| c=|tok/s|passed|failed|rror' "$RES/$name.log" | tail -1 | cut -c1-200)"
    pack
    return $rc
}
PY=${PY:-python3}
L=("$PY" -c 'import sys; from llmserve.cli import main; sys.exit(main())')  # the CLI, wherever pip put scripts

if [ "$DEVICE" = cuda ] && [ -d .whl ]; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
        && export PYTHONPATH=/tmp/site
fi
[ "$DEVICE" = cuda ] && { python3 -m pip install -q --no-deps --no-build-isolation -e . >"$RES/install.log" 2>&1 || note "install failed"; }
nvidia-smi --query-gpu=name,memory.total,memory.used,clocks.sm,driver_version --format=csv >"$RES/gpu.txt" 2>&1
note "install done; $(tail -1 "$RES/gpu.txt"); torch $("$PY" -c 'import torch, triton; print(torch.__version__, triton.__version__)')"
export PYTHONUNBUFFERED=1

# The 8B checkpoint is written on the CPU while the tests use the GPU.
# WEIGHTS=dummy: no checkpoint written (config and tokenizer only, seconds); every stage loads random weights
# on the device (--load-format dummy): for the speed stages (serve, stepprof, roofline, offline, fp8), never spec.
LOAD=()
case "${WEIGHTS:-copying}" in
    copying) W_FLAG=--copying ;; peaked) W_FLAG=--peaked-logits ;;
    dummy) W_FLAG=--no-weights; LOAD=(--load-format dummy); export LOAD_FORMAT=dummy ;; *) W_FLAG= ;;
esac
# shellcheck disable=SC2086
("${L[@]}" make-model --arch llama --shape "$SHAPE" --dtype "${DTYPE:-bfloat16}" $W_FLAG --out "$MODEL" >"$RES/make_model.log" 2>&1; echo "rc=$?" >>"$RES/make_model.log") &
MAKER=$!

if want tests; then
    TESTS=${TESTS:-tests/gpu tests/unit/test_triton_attention.py tests/unit/test_triton_engine.py tests/unit/test_async_scheduling.py tests/unit/test_fp8_triton.py tests/unit/test_token_kinds.py tests/unit/test_draft_chain.py}
    # shellcheck disable=SC2086
    run tests ${TESTS_LIMIT:-230} "$PY" -m pytest -q -p no:cacheprovider --timeout 150 --durations=10 $TESTS
fi
if want fp8probe; then
    run fp8probe 90 "$PY" scripts/gpu/fp8_probe.py 1,2,4,8,64,256
fi
if want fp8sweep; then  # the FP8 decode kernel's tilings (the five fastest at 1, 8, 64, 256 rows, and over all)
    run fp8sweep 300 "$PY" scripts/gpu/fp8_probe.py --sweep
fi
if want gemvprobe; then  # the linears of a batch-1 step against the copy bandwidth, cuBLAS vs the Triton GEMV
    run gemvprobe ${GEMV_LIMIT:-120} "$PY" scripts/gpu/gemv_probe.py --shape "$SHAPE" ${GEMV_SWEEP:+--sweep}
    grep -E 'copy bandwidth|step.s linears|silu|^sweep' "$RES/gemvprobe.log" | cut -c1-220 | tee -a "$OUT/summary.txt"
fi
wait $MAKER; note "make-model: $(tail -1 "$RES/make_model.log")"

if want roofline; then
    run roofline_bf16 70 "${L[@]}" bench roofline --model "$MODEL" "${LOAD[@]}" --prompt-len 128 --output-len 256 --repeats 2 --out "$RES/roof_bf16.json"
    if [ -n "${GEMV_AB:-}" ]; then  # the same through the Triton GEMV for up to 16 rows (model/triton_gemv.py)
        run roofline_bf16_gemv 70 env LLMSERVE_CUDA_GEMV_ROWS=16 "${L[@]}" bench roofline --model "$MODEL" "${LOAD[@]}" \
            --prompt-len 128 --output-len 256 --repeats 2 --out "$RES/roof_bf16_gemv.json"
    fi
    if [ -n "${ROOFLINE_LONG:-}" ]; then  # batch 1 at a long context, its keys split (flash decoding) and not
        run roofline_long_split 90 "${L[@]}" bench roofline --model "$MODEL" "${LOAD[@]}" --prompt-len "$ROOFLINE_LONG" \
            --output-len 128 --repeats 2 --out "$RES/roof_long_split.json"
        run roofline_long_whole 90 env LLMSERVE_SPLIT_MIN_KEYS=1000000000 "${L[@]}" bench roofline --model "$MODEL" \
            "${LOAD[@]}" --prompt-len "$ROOFLINE_LONG" --output-len 128 --repeats 2 --out "$RES/roof_long_whole.json"
    fi
fi
if want offline; then
    run offline_8b 80 "${L[@]}" bench offline --model "$MODEL" "${LOAD[@]}" --no-split-steps --out "$RES/offline_8b.json"
    run offline_smollm2 60 "${L[@]}" bench offline --shape smollm2-135m --no-split-steps --out "$RES/offline_smollm2.json"
    run offline_smollm2_sync 60 "${L[@]}" bench offline --shape smollm2-135m --no-split-steps --no-async-scheduling
    run offline_smollm2_prof 60 "${L[@]}" bench offline --shape smollm2-135m --no-split-steps --profile "$RES/profile_smollm2.txt"
fi
if want stepprof; then  # where a served decode step's time goes (c=64, c=256), and a mixed step
    if [ -n "${STEPPROF_AB:-}" ]; then  # the same with torch's elementwise chains first (model/fused_cuda.py)
        run stepprof_unfused 150 env LLMSERVE_FUSED_ELEMENTWISE=off "$PY" scripts/gpu/step_profile.py "$MODEL" \
            ${STEPPROF_BATCHES:-64,256} "$RES/step_profile_unfused.txt"
        grep -E '^batch|decode:|device busy' "$RES/step_profile_unfused.txt" | cut -c1-200 | tee -a "$OUT/summary.txt"
    fi
    run stepprof ${STEPPROF_LIMIT:-150} "$PY" scripts/gpu/step_profile.py "$MODEL" ${STEPPROF_BATCHES:-64,256} "$RES/step_profile.txt"
    grep -E '^batch|decode:|synchronised|device busy|mixed|prompt phase' "$RES/step_profile.txt" | cut -c1-200 | tee -a "$OUT/summary.txt"
    if [ -n "${STEPPROF_PARAMS_B:-}" ]; then  # the same with other sampling over the defaults, second (an A/B)
        run stepprof_b ${STEPPROF_LIMIT:-150} env STEPPROF_PARAMS="$STEPPROF_PARAMS_B" "$PY" scripts/gpu/step_profile.py \
            "$MODEL" ${STEPPROF_BATCHES:-64,256} "$RES/step_profile_b.txt"
        grep -E '^defaults|^batch|decode:|device busy' "$RES/step_profile_b.txt" | cut -c1-200 | tee -a "$OUT/summary.txt"
    fi
fi
if want arrivals; then  # what a new request's arrival costs the running streams, without and with a schema
    run arrivals ${ARRIVALS_LIMIT:-120} "$PY" scripts/gpu/arrival_profile.py "$MODEL" ${ARRIVALS_RUNNING:-16} "$RES/arrivals.txt"
    grep -E 'engine arguments|running:|steady|arrival' "$RES/arrivals.txt" | cut -c1-200 | tee -a "$OUT/summary.txt"
    if [ -n "${ARRIVALS_AB:-}" ]; then  # the same with decode graphs only: mixed steps eager
        run arrivals_decode_only ${ARRIVALS_LIMIT:-120} env STEPPROF_ARGS='{"cudagraph_mode": "FULL_DECODE_ONLY"}' \
            "$PY" scripts/gpu/arrival_profile.py "$MODEL" ${ARRIVALS_RUNNING:-16} "$RES/arrivals_decode_only.txt"
        grep -E 'engine arguments|running:|steady|arrival' "$RES/arrivals_decode_only.txt" | cut -c1-200 | tee -a "$OUT/summary.txt"
    fi
fi
if want serve; then
    # shellcheck disable=SC2086
    "${L[@]}" serve --model "$MODEL" "${LOAD[@]}" --max-model-len ${MAXLEN:-4096} --port 8000 ${SERVE_ARGS:-} \
        >"$RES/server.log" 2>&1 &
    SERVER=$!
    wait_up 8000 $SERVER 150
    note "server up after $(elapsed)s: $(grep -iE 'blocks|graph' "$RES/server.log" | tail -1 | cut -c1-160)"
    S=("${L[@]}" bench serve --url http://127.0.0.1:8000 --tokenizer "$MODEL" --dataset random --input-len 200
       --output-len 180 --ignore-eos --no-progress)
    runs=",${SERVE_RUNS:-c64,c256,c1024,c1,c64greedy},"
    [[ $runs == *,c64,* ]] && run serve_c64 45 "${S[@]}" --concurrency 64 --num-requests 256 --out "$RES/serve_c64.json"
    if [[ $runs == *,c256,* ]]; then  # with each process's share of a core (is the API process the bound?)
        "$PY" scripts/gpu/proc_cpu.py "$RES/cpu_c256.txt" & CPUMON=$!
        run serve_c256 60 "${S[@]}" --concurrency 256 --num-requests 512 --out "$RES/serve_c256.json"
        kill -TERM $CPUMON; wait $CPUMON; head -6 "$RES/cpu_c256.txt" | cut -c1-160 | tee -a "$OUT/summary.txt"
    fi
    [[ $runs == *,c1024,* ]] && run serve_c1024 75 "${S[@]}" --concurrency 1024 --num-requests 1024 --out "$RES/serve_c1024.json"
    [[ $runs == *,c1,* ]] && run serve_c1 25 "${S[@]}" --concurrency 1 --num-requests 4 --out "$RES/serve_c1.json"
    # the checkpoint's sampling defaults (above) vs greedy: what the sampler costs a served step
    [[ $runs == *,c64greedy,* ]] && run serve_c64_greedy 45 "${S[@]}" --concurrency 64 --num-requests 256 \
        --extra-body '{"temperature": 0}' --out "$RES/serve_c64_greedy.json"
    # structured outputs (issue 54's target: a JSON schema on every request >= 0.9x of none, c=16 and c=64)
    [[ $runs == *,json,* ]] && run serve_json_none 60 "${S[@]}" --concurrency 16,64 --num-requests 256 \
        --out "$RES/serve_json_none.json"
    [[ $runs == *,json,* ]] && run serve_json 60 "${S[@]}" --concurrency 16,64 --num-requests 256 \
        --json-schema scripts/gpu/schema.json --out "$RES/serve_json.json"
    kill $SERVER; wait $SERVER 2>/dev/null
fi
if want fp8; then
    run roofline_fp8 70 "${L[@]}" bench roofline --model "$MODEL" "${LOAD[@]}" --prompt-len 128 --output-len 256 --repeats 2 \
        --quantization fp8 --out "$RES/roof_fp8.json"
fi
if want fp8serve; then
    KV=${FP8_KV_MEMORY:-16GiB}
    "${L[@]}" serve --model "$MODEL" "${LOAD[@]}" --max-model-len ${MAXLEN:-4096} --port 8000 --kv-cache-memory-bytes "$KV" \
        >"$RES/server_bf16.log" 2>&1 &
    BF16=$!
    "${L[@]}" serve --model "$MODEL" "${LOAD[@]}" --max-model-len ${MAXLEN:-4096} --port 8001 --kv-cache-memory-bytes "$KV" \
        --quantization fp8 --kv-cache-dtype "${FP8_KV:-fp8}" >"$RES/server_fp8.log" 2>&1 &
    FP8=$!
    wait_up 8000 $BF16 200
    wait_up 8001 $FP8 200
    note "fp8serve up after $(elapsed)s; KV blocks bf16 / fp8+fp8-KV (target: twice): $(grep -o '[0-9]* KV blocks' "$RES/server_bf16.log" | tail -1) / $(grep -o '[0-9]* KV blocks' "$RES/server_fp8.log" | tail -1)"
    run serve_fp8_c256 150 "${L[@]}" bench serve --url http://127.0.0.1:8000 --compare http://127.0.0.1:8001 \
        --labels bf16,fp8 --tokenizer "$MODEL" --dataset random --input-len 200 --output-len 180 --ignore-eos \
        --no-progress --concurrency 256 --num-requests ${FP8_NUM_REQUESTS:-512} --out "$RES/serve_fp8_c256.json"
    kill $BF16 $FP8 2>/dev/null; wait $BF16 $FP8 2>/dev/null
fi
if want specprof; then  # where a speculative step's time goes (oracle=0.8 beside plain)
    run specprof 200 "$PY" scripts/gpu/spec_profile.py "$MODEL" ${SPECPROF_BATCHES:-1} "$RES/spec_profile.txt"
    grep -E '^batch|synchronised|profiled|accepted' "$RES/spec_profile.txt" | tee -a "$OUT/summary.txt"
fi
if want spec; then
    # shellcheck disable=SC2086
    run spec ${SPEC_LIMIT:-110} "${L[@]}" bench spec --model "$MODEL" --configs ${SPEC_CONFIGS:-none,oracle=0.8,ngram} \
        --concurrency ${SPEC_CONCURRENCY:-1,8} --rounds 1 ${SPEC_ARGS:-} --out "$RES/spec.json"
fi
if want specdyn; then  # the dynamic rule where speculating would cost throughput (issue 18: none below 0.97x)
    run specdyn 110 "${L[@]}" bench spec --model "$MODEL" --configs none,oracle=0.8 --speculative-dynamic \
        --concurrency ${SPECDYN_CONCURRENCY:-32} --rounds 1 --out "$RES/specdyn.json"
fi
pack
echo "=== summary"; cat "$OUT/summary.txt"
for f in "$RES"/*.log; do echo "=== $(basename "$f")"; tail -n 12 "$f" | cut -c1-220; done 2>/dev/null | tail -c 9000
