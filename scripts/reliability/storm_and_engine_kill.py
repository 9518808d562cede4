"""Figure 2: disconnect storm (400 streams, 200 leave mid-stream). Figure 3: engine SIGKILLed under ~100 streams."""
import asyncio, json, os, signal, sys, time
import httpx
from llmserve.testing.servers import ServerProcess, metric_value, wait_until

MODEL = ["--model", "/tmp/fig-tiny", "--dtype", "float32", "--max-model-len", "512"]

def scrape(url):
    t = httpx.get(f"{url}/metrics", timeout=30).text
    keys = ("num_requests_in_flight", "num_requests_running", "num_requests_waiting", "kv_cache_usage_perc",
            "kv_cache_free_blocks", "kv_cache_blocks")
    out = {k: metric_value(t, "llmserve:" + k) for k in keys}
    out["aborted_total"] = sum(float(l.rsplit(" ", 1)[1]) for l in t.splitlines()
                               if l.startswith("llmserve:request_success_total{") and 'finished_reason="abort"' in l)
    return out

def idle(url):
    m = scrape(url)
    return m if m["kv_cache_usage_perc"] == 0 and m["kv_cache_free_blocks"] == m["kv_cache_blocks"] and m["num_requests_in_flight"] == 0 else None

async def stream(http, i, leave_after, max_tokens, on_event=None):
    body = {"model": "/tmp/fig-tiny", "prompt": f"storm {i}", "max_tokens": max_tokens, "ignore_eos": True, "stream": True}
    n = 0
    async with http.stream("POST", "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return ("http", r.status_code, n)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return ("error", time.monotonic(), n, ev["error"])
            n += 1
            if on_event: on_event(i, n)
            if leave_after and n >= leave_after:
                return ("left", None, n)  # leaving the block closes the connection mid-stream
            fin = ev["choices"][0]["finish_reason"]
            if fin:
                last = fin
    return ("done", last, n)

def fig2():
    N = 400
    server = ServerProcess([*MODEL, "--max-num-seqs", "512", "--num-gpu-blocks-override", "4096"]).start()
    try:
        before = scrape(server.url)
        print("fig2 idle before:", before, flush=True)
        async def main():
            lim = httpx.Limits(max_connections=N + 10, max_keepalive_connections=N + 10)
            async with httpx.AsyncClient(base_url=server.url, timeout=300, limits=lim) as http:
                # odd i: leave after 1..8 events (spread), ask 400 tokens so they cannot finish first; even i: read 64 to the end
                return await asyncio.wait_for(asyncio.gather(*(
                    stream(http, i, leave_after=(1 + (i // 2) % 8) if i % 2 else 0, max_tokens=400 if i % 2 else 64)
                    for i in range(N)), return_exceptions=True), 300)
        t0 = time.monotonic()
        res = asyncio.run(main())
        print(f"fig2 clients done in {time.monotonic() - t0:.1f} s", flush=True)
        kinds = {}
        for r in res:
            k = type(r).__name__ if isinstance(r, BaseException) else f"{r[0]}:{r[1]}"
            kinds[k] = kinds.get(k, 0) + 1
        print("fig2 results:", kinds, flush=True)
        t1 = time.monotonic()
        after = wait_until(lambda: idle(server.url), 60, "idle", 0.05)
        print(f"fig2 idle {time.monotonic() - t1:.2f} s after the clients finished:", after,
              "aborted delta", after["aborted_total"] - before["aborted_total"], flush=True)
        h = httpx.get(f"{server.url}/health", timeout=10).status_code
        r = httpx.post(f"{server.url}/v1/completions", json={"prompt": "after", "max_tokens": 8, "ignore_eos": True}, timeout=60)
        print("fig2 health", h, "completion after", r.status_code, r.json()["usage"], flush=True)
        log = server.log()
        print("fig2 log: client-disconnected lines", log.count("the client disconnected"), "tracebacks", log.count("Traceback"), flush=True)
    finally:
        print("fig2 server exit (SIGTERM)", server.stop(), flush=True)

def fig3():
    N = 100
    server = ServerProcess([*MODEL, "--max-num-seqs", "128", "--num-gpu-blocks-override", "4096"]).start()
    try:
        engine = server.engine_pid()
        print("fig3 server pid", server.proc.pid, "children", server.children(), "engine", engine, flush=True)
        got = set()
        async def main():
            lim = httpx.Limits(max_connections=N + 10, max_keepalive_connections=N + 10)
            async with httpx.AsyncClient(base_url=server.url, timeout=120, limits=lim) as http:
                tasks = [asyncio.create_task(stream(http, i, 0, 480, lambda i, n: got.add(i))) for i in range(N)]
                t = time.monotonic()
                while len(got) < N and time.monotonic() - t < 120:
                    await asyncio.sleep(0.01)
                assert len(got) == N, len(got)
                t_kill = time.monotonic()
                os.kill(engine, signal.SIGKILL)
                res = await asyncio.wait_for(asyncio.gather(*tasks, return_exceptions=True), 60)
                return t_kill, res
        t_kill, res = asyncio.run(main())
        code = server.wait(timeout=60)
        t_exit = time.monotonic() - t_kill
        errs = [r for r in res if not isinstance(r, BaseException) and r[0] == "error"]
        other = [r for r in res if isinstance(r, BaseException) or r[0] != "error"]
        lat = sorted(r[1] - t_kill for r in errs)
        print(f"fig3 {len(errs)} of {N} streams ended with an error event; other endings: {[repr(o)[:200] for o in other]}")
        if lat:
            print(f"fig3 kill -> error event: min {lat[0]*1000:.0f} ms, median {lat[len(lat)//2]*1000:.0f} ms, max {lat[-1]*1000:.0f} ms")
            print("fig3 events received before the kill (min/max):", min(r[2] for r in errs), max(r[2] for r in errs))
            print("fig3 error event:", errs[0][3])
        print(f"fig3 server exit code {code}, {t_exit:.2f} s after the kill", flush=True)
        log = server.log()
        print("\n".join(l for l in log.splitlines() if "leaked" not in l and "nanobind" not in l and "ended early" not in l)[-2500:])
        print("fig3 'ended early with an error event' lines:", log.count("ended early with an error event"))
    finally:
        server.stop(signal.SIGKILL)

if __name__ == "__main__":
    {"2": fig2, "3": fig3}[sys.argv[1]]()
