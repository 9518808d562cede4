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
