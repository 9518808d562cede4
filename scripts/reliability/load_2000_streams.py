"""2,000 streams held in the engine at once (step gate), then released; bench serve is the client."""
import subprocess, sys, time, os, signal, httpx
from llmserve.testing.servers import ServerProcess, StepGateClient, metric_value, wait_until

M = ("llmserve:num_requests_in_flight", "llmserve:num_requests_running", "llmserve:num_requests_waiting",
     "llmserve:kv_cache_usage_perc", "llmserve:kv_cache_free_blocks", "llmserve:kv_cache_blocks")
def scrape(url):
    t = httpx.get(f"{url}/metrics", timeout=30).text
    return {m.split(":")[1]: metric_value(t, m) for m in M}

with StepGateClient(timeout=120) as gate:
    server = ServerProcess(["--model", "/tmp/fig-tiny", "--dtype", "float32", "--max-num-seqs", "2048",
                            "--max-num-batched-tokens", "2048", "--num-gpu-blocks-override", "8192",
                            "--max-model-len", "512", "--max-queued-requests", "4096"], env=gate.env).start()
    try:
        print("server", server.url, "idle:", scrape(server.url), flush=True)
        start = gate.status()
        bench = subprocess.Popen(["timeout", "580", os.path.join(os.path.dirname(sys.executable), "llmserve"), "bench", "serve",
                                  "--url", server.url, "--model", "/tmp/fig-tiny", "--concurrency", "2000", "--num-requests", "2000",
                                  "--dataset", "random", "--input-len", "16", "--output-len", "32", "--ignore-eos",
                                  "--warmup", "0", "--no-progress", "--out", "/tmp/fig-run/bench1g.json"],
                                 stdout=open("/tmp/fig-run/bench1g.out", "w"), stderr=open("/tmp/fig-run/bench1g.err", "w"))
        wait_until(lambda: "model '" in open("/tmp/fig-run/bench1g.err").read(), 120, "the probe", 0.01)
        gate.hold()
        t0 = time.monotonic()
        st = wait_until(lambda: (s := gate.status())["added"] - start["added"] >= 2001 and s, 300, "2000 added", 0.5)
        print(f"engine held with {st['added'] - start['added'] - 1} requests (+1 probe) added after {time.monotonic() - t0:.1f} s;",
              "steps", st["steps"] - start["steps"], flush=True)
        gate.run_steps(40)  # prefill of 2000 x 16 tokens at 2048 a step, then some decode steps
        print("after 40 steps, held:", scrape(server.url), flush=True)
        gate.release()
        print("bench rc", bench.wait(600), flush=True)
        time.sleep(2)
        print("after the run:", scrape(server.url), flush=True)
        print("health", httpx.get(f"{server.url}/health").status_code)
    finally:
        print("server exit", server.stop(), flush=True)
        log = server.log()
        print("\n".join(l for l in log.splitlines() if "leaked" not in l and "nanobind" not in l)[-3000:])
