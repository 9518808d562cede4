# Shared by the side-by-side benchmark scripts (sourced; they set OUT first): servers started in the
# background and stopped together, and a wait for a server's /health. NEVER RUN IN CI.

stop_all() { kill "${PIDS[@]}" 2> /dev/null || true; wait "${PIDS[@]}" 2> /dev/null || true; PIDS=(); }

wait_healthy() {  # wait_healthy PORT PID
  for _ in $(seq 600); do
    curl -sf "http://127.0.0.1:$1/health" > /dev/null && return
    kill -0 "$2" 2> /dev/null || { echo "server on :$1 exited; see $OUT" >&2; exit 1; }
    sleep 1
  done
  echo "server on :$1 not healthy after 600 s" >&2; exit 1
}

start() {  # start NAME COMMAND...: in the background, logged to $OUT/NAME.log, without the lock's fd
  "${@:2}" > "$OUT/$1.log" 2>&1 9>&- &
  PIDS+=($!)
}

take_bench_lock() {  # hold /tmp/llmserve-bench.lock (fd 9) until the script exits
  exec 9> /tmp/llmserve-bench.lock
  echo "waiting for /tmp/llmserve-bench.lock"; flock 9
}

compare_anchor() {  # compare_anchor PORT_A PORT_B LABELS C [N]: the anchor workload (N requests, 128 by default) on
  # both, A B, B A; BENCH_EXTRA_BODY (JSON) goes into every request, e.g. '{"top_k": -1, "top_p": 0.9}'
  # a level with failed requests exits non-zero: its table says so, and the next level still runs
  local -a extra=()
  [[ -n ${BENCH_EXTRA_BODY:-} ]] && extra=(--extra-body "$BENCH_EXTRA_BODY")
  "$PYTHON" -m llmserve.cli bench serve --url "http://127.0.0.1:$1" "${extra[@]}" \
    --compare "http://127.0.0.1:$2" --labels "$3" --tokenizer "$MODEL" --dataset random \
    --input-len 288 --output-len 144 --range-ratio 0.7778 --num-requests "${5:-128}" --concurrency "$4" \
    --ignore-eos --stream --seed 20 --timeout 1800 --out "$OUT/results-c$4.json" | tee "$OUT/table-c$4.txt" \
    || echo "c=$4: bench serve exited non-zero (failed requests: see $OUT/table-c$4.txt)" >&2
}
