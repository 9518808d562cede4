"""The router's two upstream clients side by side: the lean asyncio/httptools pool (router/upstream.py) and
httpx (what Gateway used when handed an httpx client), each in a real `llmserve route` process in front of
the same fast fake upstream (no engine: the router's own cost is what is measured).

    PYTHONPATH=src python scripts/cpu/router_upstream_bench.py --num-requests 400 --rounds 3

Prints, per client, concurrency and streaming or not, the median over rounds (interleaved A B A B) of
requests/s and of the median and p90 time per request. Figures go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import time

import httpx

NUM_EVENTS = 16  # SSE events per streamed answer (one per token of a 16-token answer)
EVENT = b"data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
                                "choices": [{"index": 0, "text": " tok", "logprobs": None,
                                             "finish_reason": None}]}).encode() + b"\n\n"
ANSWER = json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "tiny",
                     "choices": [{"index": 0, "text": " tok" * NUM_EVENTS, "logprobs": None,
                                  "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 8, "completion_tokens": NUM_EVENTS,
                               "total_tokens": 8 + NUM_EVENTS}}).encode()
MODELS = json.dumps({"object": "list", "data": [{"id": "tiny", "object": "model"}]}).encode()


# ---- the fake upstream: HTTP/1.1 keep-alive, fixed answers, no engine ----

async def _handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    try:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            lines = head.split(b"\r\n")
            method, path = lines[0].split(b" ")[:2]
            length = next((int(v) for k, _, v in (line.partition(b":") for line in lines[1:])
                           if k.strip().lower() == b"content-length"), 0)
            body = await reader.readexactly(length) if length else b""
            if method == b"POST" and (b'"stream": true' in body or b'"stream":true' in body):
                await _stream(writer)
            else:
                payload = MODELS if path == b"/v1/models" else ANSWER if method == b"POST" else b"{}"
                writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
                             + str(len(payload)).encode() + b"\r\n\r\n" + payload)
                await writer.drain()
    except (asyncio.IncompleteReadError, ConnectionError):
        writer.close()


async def _stream(writer: asyncio.StreamWriter) -> None:
    """One event per write, as a server streaming tokens does."""
    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")
    for data in [EVENT] * NUM_EVENTS + [b"data: [DONE]\n\n"]:
        writer.write(b"%x\r\n%s\r\n" % (len(data), data))
        await writer.drain()
        await asyncio.sleep(0)
    writer.write(b"0\r\n\r\n")
    await writer.drain()


async def _upstream(port: int) -> None:
    server = await asyncio.start_server(_handle, "127.0.0.1", port, backlog=1024)
    async with server:
        await server.serve_forever()


# ---- a router process with the chosen upstream client ----

def _router(port: int, upstream: str, client: str) -> int:
    from llmserve.router import server
    from llmserve.router.cli import add_route_parser
    from llmserve.router.gateway import Gateway, make_client
    from llmserve.router.loading import setup_from_args

    parser = argparse.ArgumentParser()
    add_route_parser(parser.add_subparsers())
    args = parser.parse_args(["route", "--backend", f"tiny={upstream}", "--port", str(port),
                              "--log-level", "warning", "--scrape-interval-s", "0"])
    setup = setup_from_args(args)
    if client == "httpx":
        server.Gateway = lambda s: Gateway(s, client=make_client(s.router))
    return server.run(setup)


# ---- the client ----

async def _one(client: httpx.AsyncClient, url: str, is_stream: bool) -> float:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": NUM_EVENTS, "stream": is_stream}
    start = time.perf_counter()
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        data = b"".join([chunk async for chunk in response.aiter_raw()])
    assert response.status_code == 200, (response.status_code, data[:200])
    assert data.endswith(b"data: [DONE]\n\n") if is_stream else data == ANSWER
    return time.perf_counter() - start


async def _load(url: str, concurrency: int, num_requests: int, is_stream: bool) -> dict:
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(limits=limits, timeout=60, trust_env=False) as client:
        for _ in range(concurrency):  # warm the connections
            await _one(client, url, is_stream)
        times: list[float] = []
        errors: list[str] = []
        left = iter(range(num_requests))

        async def worker() -> None:
            for _ in left:
                try:
                    times.append(await _one(client, url, is_stream))
                except httpx.TransportError as e:  # counted and reported: a client that drops requests
                    errors.append(type(e).__name__)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - start
    times.sort()
    return {"rps": len(times) / elapsed, "errors": len(errors), "p50_ms": 1e3 * times[len(times) // 2],
            "p90_ms": 1e3 * times[int(len(times) * 0.9)]}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_ready(url: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/v1/models", timeout=1, trust_env=False).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not start")


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], env=os.environ.copy())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    args = parser.parse_args()
    up_port = _free_port()
    upstream = f"http://127.0.0.1:{up_port}"
    children = [_spawn("upstream", str(up_port))]
    routers = {}
    try:
        _wait_ready(upstream)
        for client in ("lean", "httpx"):
            port = _free_port()
            children.append(_spawn("router", str(port), upstream, client))
            routers[client] = f"http://127.0.0.1:{port}"
        for url in routers.values():
            _wait_ready(url)
        results: dict[tuple, list[dict]] = {}
        for round_ in range(args.rounds):
            order = list(routers) if round_ % 2 == 0 else list(reversed(routers))
            for concurrency in args.concurrency:
                for is_stream in (False, True):
                    for client in order:
                        result = asyncio.run(_load(routers[client], concurrency, args.num_requests, is_stream))
                        results.setdefault((concurrency, is_stream, client), []).append(result)
        _print(results, args)
    finally:
        for child in children:
            child.terminate()
            child.wait(10)


def _print(results: dict, args) -> None:
    print(f"{args.num_requests} requests x {args.rounds} rounds, medians over rounds; load average "
          f"{os.getloadavg()[0]:.1f}")
    print("| concurrency | stream | client | req/s | p50 ms | p90 ms | errors | lean / httpx req/s |")
    print("|---|---|---|---|---|---|---|---|")
    for (concurrency, is_stream, client), runs in sorted(results.items(), key=lambda kv: (kv[0][0], kv[0][1])):
        rps, p50, p90 = (statistics.median(r[k] for r in runs) for k in ("rps", "p50_ms", "p90_ms"))
        other = results[(concurrency, is_stream, "httpx")]
        ratio = f"{rps / statistics.median(r['rps'] for r in other):.2f}x" if client == "lean" else ""
        errors = sum(r["errors"] for r in runs)
        print(f"| {concurrency} | {'yes' if is_stream else 'no'} | {client} | {rps:,.0f} | {p50:.2f} | {p90:.2f} | "
              f"{errors} | {ratio} |")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "upstream":
        asyncio.run(_upstream(int(sys.argv[2])))
    elif len(sys.argv) > 1 and sys.argv[1] == "router":
        raise SystemExit(_router(int(sys.argv[2]), sys.argv[3], sys.argv[4]))
    else:
        main()
