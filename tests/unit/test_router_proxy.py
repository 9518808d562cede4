"""The router's request path in-process: fake backends (httpx.MockTransport) behind the real app."""

import asyncio
import functools
import json
import logging

import httpx
import pytest

from llmserve.router.admission import GatewayQueue, QueueFull, QueueTimeout
from llmserve.router.app import build_app
from llmserve.router.classifier import AutoRouteConfig
from llmserve.router.config import AutoscaleConfig, BackendSpec, PoolSpec, RouterConfig, RouterSetup
from llmserve.router.gateway import Gateway
from llmserve.router.health import HealthState
from llmserve.router.ratelimit import RateLimit
from llmserve.testing.router_servers import Chunks
from llmserve.testing.servers import until
from router_mock_upstream import MockUpstream

A, B = "http://a:1", "http://b:1"
SSE = {"content-type": "text/event-stream"}


def sync(fn):
    """Run an async test on a fresh event loop (the suite has no asyncio pytest plugin)."""
    @functools.wraps(fn)
    def wrapper():
        return asyncio.run(fn())

    return wrapper


class CutStream(httpx.AsyncByteStream):
    async def __aiter__(self):
        yield b'data: {"choices":[{"text":"x"}]}\n\n'
        yield b'data: {"choi'
        raise httpx.RemoteProtocolError("peer closed connection")


def make_gateway(handler, urls=(A, B), auto=AutoRouteConfig(), limits=None, **router):
    pools = (PoolSpec("m", tuple(BackendSpec(u) for u in urls), policy="round-robin"),
             PoolSpec("big", (BackendSpec("http://big:1"),)))
    config = RouterConfig(**{"retry_backoff_s": 0.0, "queue_timeout_s": 0.5, **router})
    setup = RouterSetup(config, pools, auto, AutoscaleConfig(), limits or {})
    client = httpx.AsyncClient(transport=httpx.MockTransport(handler))
    return Gateway(setup, upstream=MockUpstream(client))


async def call(gw, body, path="/v1/completions", headers=None):
    transport = httpx.ASGITransport(app=build_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        return await client.post(path, json=body, headers=headers or {})


def json_response(status, obj, headers=None):
    return httpx.Response(status, headers={"content-type": "application/json", **(headers or {})},
                          stream=Chunks(json.dumps(obj).encode()))


def ok(request):
    return json_response(200, {"served_by": str(request.url.host), "body": json.loads(request.content)})


def backend(gw, url):
    return next(b for p in gw.pools.values() for b in p.backends if b.url == url)


@sync
async def test_connect_error_retried_on_another_backend():
    def handler(request):
        if request.url.host == "a":
            raise httpx.ConnectError("refused", request=request)
        return ok(request)

    gw = make_gateway(handler)
    for _ in range(3):
        r = await call(gw, {"model": "m", "prompt": "hi"})
        assert r.status_code == 200 and r.json()["served_by"] == "b"
        assert r.headers["x-llmserve-backend"] == B
    a = backend(gw, A)
    assert a.health.state is HealthState.EJECTED  # 3 consecutive failures (threshold 3)
    assert a.num_in_flight == 0 and backend(gw, B).num_in_flight == 0
    assert b'llmserve_router:ejections_total{backend="http://a:1",pool="m"} 1.0' in gw.metrics.render()


def test_an_ejection_and_the_recovery_are_logged_once_each(caplog):
    is_down = {"a": True}

    def handler(request):
        if request.url.host == "a" and is_down["a"]:
            raise httpx.ConnectError("refused", request=request)
        return ok(request)

    async def run():
        gw = make_gateway(handler, cooldown_s=0.0)  # every request after the ejection is a trial of `a`
        for _ in range(5):  # 3 failures eject it; the trials after fail again, unlogged
            assert (await call(gw, {"model": "m", "prompt": "hi"})).status_code == 200
        is_down["a"] = False
        served_by = [(await call(gw, {"model": "m", "prompt": "hi"})).json()["served_by"] for _ in range(2)]
        assert "a" in served_by and backend(gw, A).health.state is HealthState.HEALTHY

    with caplog.at_level(logging.INFO, logger="llmserve.router"):
        asyncio.run(run())
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(f"backend {A}")]
    assert len(lines) == 2, lines
    assert "ejected after 3 consecutive failures" in lines[0] and "recovered" in lines[1]


@sync
async def test_503_retried_then_relayed_when_all_unavailable():
    calls = []

    def handler(request):
        calls.append(request.url.host)
        return json_response(503, {"error": {"message": "draining"}}, headers={"Retry-After": "5"})

    r = await call(make_gateway(handler, max_retries=2), {"model": "m", "prompt": "hi"})
    assert r.status_code == 503 and r.json()["error"]["message"] == "draining" and "retry-after" in r.headers
    assert calls == ["a", "b", "a"]  # untried backends first


@sync
async def test_all_connect_errors_give_502_in_openai_shape():
    def handler(request):
        raise httpx.ConnectError("refused", request=request)

    r = await call(make_gateway(handler, max_retries=1), {"model": "m", "prompt": "hi"})
    assert r.status_code == 502 and r.json()["error"]["code"] == "bad_gateway"


@sync
async def test_cut_stream_ends_with_sse_error_event_and_is_not_retried():
    calls = []

    def handler(request):
        calls.append(request.url.host)
        return httpx.Response(200, headers=SSE, stream=CutStream())

    gw = make_gateway(handler)
    r = await call(gw, {"model": "m", "prompt": "hi", "stream": True})
    events = r.content.split(b"\n\n")
    assert events[0] == b'data: {"choices":[{"text":"x"}]}'
    assert events[1] == b'data: {"choi'  # the partial event is closed, then the error event follows
    assert json.loads(events[2][len(b"data: "):])["error"]["code"] == "upstream_disconnected"
    assert events[3] == b"data: [DONE]" and calls == ["a"]
    assert backend(gw, A).health.num_consecutive_failures == 1 and backend(gw, A).num_in_flight == 0


@sync
async def test_auto_model_routed_by_difficulty_with_header_and_rewritten_model():
    gw = make_gateway(ok, auto=AutoRouteConfig(small_pool="m", large_pool="big", max_small_prompt_chars=10))
    r = await call(gw, {"model": "auto", "prompt": "short"})
    assert r.headers["x-llmserve-route"] == "m; reason=default" and r.json()["body"]["model"] == "m"
    r = await call(gw, {"model": "auto", "prompt": "a much longer prompt"})
    assert r.json()["served_by"] == "big" and r.json()["body"]["model"] == "big"
    assert r.headers["x-llmserve-route"] == "big; reason=prompt_chars"
    assert b'auto_route_decisions_total{pool="big",reason="prompt_chars"} 1.0' in gw.metrics.render()


@sync
async def test_rate_limit_429_per_key():
    gw = make_gateway(ok, limits={"vip": RateLimit(100, 100)}, rate_limit_rps=1, rate_limit_burst=1)
    assert (await call(gw, {"model": "m", "prompt": "x"})).status_code == 200
    r = await call(gw, {"model": "m", "prompt": "x"})
    assert r.status_code == 429 and r.headers["retry-after"] == "1"
    assert r.json()["error"]["code"] == "rate_limit_exceeded"
    auth = {"Authorization": "Bearer vip"}
    for _ in range(3):
        assert (await call(gw, {"model": "m", "prompt": "x"}, headers=auth)).status_code == 200


@sync
async def test_queue_full_and_queue_timeout_give_503_retry_after():
    entered, release = asyncio.Event(), asyncio.Event()

    async def slow(request):
        entered.set()
        await release.wait()
        return ok(request)

    gw = make_gateway(slow, urls=(A,), max_in_flight_per_backend=1, max_queued_requests=1, queue_timeout_s=1.0)
    first = asyncio.create_task(call(gw, {"model": "m", "prompt": "1"}))
    await asyncio.wait_for(entered.wait(), 5)  # at the backend, which holds it
    second = asyncio.create_task(call(gw, {"model": "m", "prompt": "2"}))
    await until(lambda: gw.pools["m"].queue.num_waiting == 1, what="the second request in the queue")
    third = await call(gw, {"model": "m", "prompt": "3"})
    assert third.status_code == 503 and third.headers["retry-after"] == "1"
    assert (await second).status_code == 503  # timed out in the queue
    release.set()
    assert (await first).status_code == 200


@sync
async def test_bad_requests_and_info_routes():
    gw = make_gateway(ok, auto=AutoRouteConfig(small_pool="m", large_pool="big"))
    r = await call(gw, {"model": "nope", "prompt": "x"})
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    transport = httpx.ASGITransport(app=build_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        r = await client.post("/v1/completions", content=b"{oops")
        assert r.status_code == 400 and "malformed JSON" in r.json()["error"]["message"]
        assert [m["id"] for m in (await client.get("/v1/models")).json()["data"]] == ["m", "big", "auto"]
        assert (await client.get("/health")).status_code == 200
        assert (await client.get("/v1/completions")).status_code == 405
        assert b"llmserve_router:requests_in_flight" in (await client.get("/metrics")).content


@sync
async def test_gateway_queue_is_fifo_and_bounded():
    queue, capacity, order = GatewayQueue(max_waiting=3), [0], []

    def pick():
        if capacity[0] > 0:
            capacity[0] -= 1
            return True
        return None

    async def waiter(i):
        await queue.acquire(pick, timeout=5)
        order.append(i)

    tasks = [asyncio.create_task(waiter(i)) for i in range(3)]
    await until(lambda: queue.num_waiting == 3, what="three waiters")
    with pytest.raises(QueueFull):
        await queue.acquire(pick, timeout=5)
    for i in range(3):
        capacity[0] += 1
        queue.notify()
        await until(lambda: len(order) == i + 1, what=f"waiter {i} served")
    await asyncio.gather(*tasks)
    assert order == [0, 1, 2] and queue.num_waiting == 0
    with pytest.raises(QueueTimeout):
        await queue.acquire(pick, timeout=0.05)
