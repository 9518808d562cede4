"""Model names between pools and replicas (router/rewrite.py, monitor.learn_model), and the replica routes
the router forwards besides generation, in-process: fake backends (httpx.MockTransport) behind the real app."""

import asyncio
import json

import httpx
import msgspec
import pytest

from llmserve.router.app import build_app
from llmserve.router.classifier import AutoRouteConfig
from llmserve.router.config import AutoscaleConfig, BackendSpec, PoolSpec, RouterConfig, RouterSetup
from llmserve.router.gateway import Gateway
from llmserve.router.health import HealthState
from llmserve.router.monitor import choose_card, probe_all
from llmserve.router.rewrite import ModelRename, SseRenamer, json_body, request_body
from llmserve.testing.router_servers import Chunks
from router_mock_upstream import MockUpstream

RENAME = ModelRename(served="served-name", public="pool")
STREAM = (b'data: {"id":"1","model":"served-name","choices":[{"text":"\\"model\\":\\"served-name\\""}]}\n\n'
          b'data: {"id":"1","model":"served-name","choices":[],"usage":{"model":"served-name"}}\n\n'
          b"data: [DONE]\n\n")


def test_request_body_renames_only_a_model_it_has():
    body = b'{"model": "pool",  "prompt": "x"}'
    assert msgspec.json.decode(request_body(body, msgspec.json.decode(body), "served")) == {"model": "served",
                                                                                          "prompt": "x"}
    assert request_body(body, msgspec.json.decode(body), "pool") is body  # already right: the same bytes
    tgi = b'{"inputs": "x"}'
    assert request_body(tgi, msgspec.json.decode(tgi), "served") is tgi  # no model: none added
    assert request_body(b"", None, "served") == b""


def test_json_body_renames_the_top_level_model_only():
    body = json.dumps({"model": "served-name", "usage": {"model": "served-name"}}).encode()
    assert json.loads(json_body(body, RENAME)) == {"model": "pool", "usage": {"model": "served-name"}}
    assert json.loads(json_body(b'{"model_id": "served-name"}', RENAME)) == {"model_id": "pool"}  # TGI /info
    other = b'{"model": "else"}'
    assert json_body(other, RENAME) is other
    assert json_body(b"not json", RENAME) == b"not json"
    assert json_body(b"[1]", RENAME) == b"[1]"


def renamed_events(raw: bytes) -> list:
    return [e for e in raw.split(b"\n\n") if e]


@pytest.mark.parametrize("piece", [1, 7, 50, len(STREAM)])
def test_sse_renamer_renames_whole_events_however_the_bytes_arrive(piece):
    renamer = SseRenamer(RENAME)
    out = b"".join(renamer.feed(STREAM[i:i + piece]) for i in range(0, len(STREAM), piece)) + renamer.flush()
    events = renamed_events(out)
    first, second = (json.loads(e[len(b"data: "):]) for e in events[:2])
    assert first["model"] == "pool" and first["choices"][0]["text"] == '"model":"served-name"'  # text untouched
    assert second["model"] == "pool" and second["usage"]["model"] == "served-name"
    assert events[2] == b"data: [DONE]" and out.endswith(b"\n\n") and renamer.is_at_event_boundary


def test_sse_renamer_holds_a_partial_event_and_flushes_a_last_one_without_blank_line():
    renamer = SseRenamer(RENAME)
    assert renamer.feed(b'data: {"model":"served-na') == b"" and not renamer.is_at_event_boundary
    assert renamer.feed(b'me"}') == b""
    assert renamer.flush() == b'data: {"model":"pool"}'
    assert renamer.feed(b": keep-alive comment\n\n") == b": keep-alive comment\n\n"


def test_a_renamed_event_escapes_the_line_breaks_json_leaves_raw():
    """A replica's text with U+2028 / U+0085 (escaped by the replica) stays one line once re-encoded."""
    text = "a\u2028b\x85c\u2029d"
    event = b"data: " + json.dumps({"model": "served-name", "text": text}).encode()
    out = SseRenamer(RENAME).feed(event + b"\n\n")
    assert len(out.decode().strip().splitlines()) == 1
    assert json.loads(out[len(b"data: "):]) == {"model": "pool", "text": text}


def test_choose_card():
    cards = [{"id": "a"}, {"id": "pool"}]
    assert choose_card("pool", None, cards) == ({"id": "pool"}, "")  # the pool's own name first
    assert choose_card("other", None, cards) == ({"id": "a"}, "")  # else the first it serves
    assert choose_card("other", "a", cards) == ({"id": "a"}, "")
    card, problem = choose_card("other", "missing", cards)
    assert card is None and "serves a, pool, not `missing`" in problem
    assert choose_card("pool", None, []) == (None, "")


# ---- in-process: a gateway over fake replicas ----------------------------------------------------------

A, B, C = "http://a:1", "http://b:1", "http://c:1"
SERVED = {"a": "served-name", "b": "served-name", "c": "pool"}  # what each fake replica serves


def streamed(content_type: str, *chunks: bytes) -> httpx.Response:
    return httpx.Response(200, headers={"content-type": content_type}, stream=Chunks(*chunks))


class Replicas:
    """Fake llmserve replicas: /health, /v1/models, and an echo of every other request."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, str, str, dict | None]] = []  # (host, method, path+query, body)

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host, path = request.url.host, request.url.raw_path.decode()
        if path == "/health":
            return httpx.Response(200)
        if path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [
                {"id": SERVED[host], "object": "model", "root": f"/ckpt/{host}", "max_model_len": 512}]})
        body = json.loads(request.content) if request.content else None
        self.seen.append((host, request.method, path, body))
        if body and body.get("stream"):
            events = [{"model": SERVED[host], "choices": [{"text": t}]} for t in ("a", "b")]
            sse = b"".join(b"data: " + json.dumps(e).encode() + b"\n\n" for e in events) + b"data: [DONE]\n\n"
            return streamed("text/event-stream", sse[:10], sse[10:])
        return streamed("application/json", json.dumps({"model": SERVED[host], "host": host}).encode())


def gateway(replicas: Replicas, upstream_model=None) -> Gateway:
    pools = (PoolSpec("pool", (BackendSpec(A), BackendSpec(B)), policy="round-robin", upstream_model=upstream_model),
             PoolSpec("other", (BackendSpec(C),)))
    setup = RouterSetup(RouterConfig(retry_backoff_s=0.0), pools, AutoRouteConfig(), AutoscaleConfig(), {})
    client = httpx.AsyncClient(transport=httpx.MockTransport(replicas))
    return Gateway(setup, upstream=MockUpstream(client))


async def request(gw: Gateway, method: str, path: str, body=None) -> httpx.Response:
    transport = httpx.ASGITransport(app=build_app(gw))
    async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
        return await client.request(method, path, json=body)


def test_pool_name_differs_from_served_name_both_ways():
    async def run():
        replicas = Replicas()
        gw = gateway(replicas)
        await probe_all(gw)  # learns each replica's model card
        assert [b.served_model for b in gw.pools["pool"].backends] == ["served-name", "served-name"]
        plain = await request(gw, "POST", "/v1/completions", {"model": "pool", "prompt": "x"})
        streamed = await request(gw, "POST", "/v1/completions", {"model": "pool", "prompt": "x", "stream": True})
        return replicas, plain, streamed

    replicas, plain, streamed = asyncio.run(run())
    assert [body["model"] for *_, body in replicas.seen] == ["served-name", "served-name"]
    assert plain.json()["model"] == "pool" and int(plain.headers["content-length"]) == len(plain.content)
    events = [json.loads(e[6:]) for e in streamed.content.split(b"\n\n") if e.startswith(b"data: {")]
    assert [e["model"] for e in events] == ["pool", "pool"] and streamed.content.endswith(b"data: [DONE]\n\n")


def test_a_replica_serving_another_name_than_upstream_model_is_left_out():
    async def run():
        gw = gateway(Replicas(), upstream_model="not-served")
        for _ in range(3):
            await probe_all(gw)
        return gw

    gw = asyncio.run(run())
    assert all(b.health.state is HealthState.EJECTED for b in gw.pools["pool"].backends)
    assert gw.pools["other"].backends[0].health.state is HealthState.HEALTHY


def test_other_replica_routes_are_forwarded():
    async def run():
        replicas = Replicas()
        gw = gateway(replicas)
        await probe_all(gw)
        answers = [await request(gw, "POST", "/tokenize", {"model": "other", "prompt": "hi"}),
                   await request(gw, "POST", "/v1/detokenize", {"model": "pool", "tokens": [1]}),
                   await request(gw, "POST", "/generate", {"inputs": "hi"}),
                   await request(gw, "POST", "/", {"inputs": "hi"}),
                   await request(gw, "GET", "/version?x=1"),
                   await request(gw, "GET", "/static/playground/app.js")]
        return replicas, answers

    replicas, answers = asyncio.run(run())
    assert all(r.status_code == 200 for r in answers)
    assert replicas.seen[0] == ("c", "POST", "/tokenize", {"model": "pool", "prompt": "hi"})  # c serves `pool`
    assert replicas.seen[1][1:] == ("POST", "/v1/detokenize", {"model": "served-name", "tokens": [1]})
    assert [s[1:] for s in replicas.seen[2:4]] == [("POST", "/generate", {"inputs": "hi"}),
                                                   ("POST", "/", {"inputs": "hi"})]  # no model added
    assert {s[0] for s in replicas.seen[2:4]} <= {"a", "b"}  # no model: the default (first) pool
    assert [s[1:3] for s in replicas.seen[4:]] == [("GET", "/version?x=1"), ("GET", "/static/playground/app.js")]
    assert answers[1].json()["model"] == "pool" and answers[0].headers["x-llmserve-pool"] == "other"


def test_models_show_the_replicas_cards_under_the_pool_names():
    async def run():
        gw = gateway(Replicas())
        await probe_all(gw)
        return [await request(gw, "GET", path) for path in ("/v1/models", "/v1/models/pool", "/v1/models/nope")]

    models, one, missing = asyncio.run(run())
    cards = {c["id"]: c for c in models.json()["data"]}
    assert set(cards) == {"pool", "other"} and cards["pool"]["root"] == "/ckpt/a"
    assert cards["pool"]["max_model_len"] == 512
    assert one.json()["id"] == "pool" and missing.status_code == 404
