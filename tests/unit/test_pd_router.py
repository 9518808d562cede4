"""The P/D router's decisions against scripted upstreams: the prefill copy of a request, the decode server's
bytes passed through, a failed prefill server falling back to the decode server, a client's 4xx returned,
and its flags validated."""

import asyncio
import json

import httpx
import pytest

from llmserve.router.cli import main as route_main
from llmserve.router.pd import PDConfig, PDRouter, build_pd_app, prefill_body
from llmserve.router.pd_policy import PDPolicy
from llmserve.testing.router_servers import Chunks
from router_mock_upstream import MockUpstream

PREFILL, DECODE = "http://prefill:1", "http://decode:2"


class Upstreams:
    """The prefill and decode servers: record what they get; the prefill answers `prefill_status`."""

    def __init__(self, prefill_status: int = 200) -> None:
        self.prefill_status = prefill_status
        self.seen: list[tuple[str, dict | None]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        url = str(request.url)
        body = json.loads(request.content) if request.content else None
        self.seen.append((url, body))
        if url == f"{DECODE}/kv_transfer":
            return httpx.Response(200, json={"disaggregation_mode": "decode", "kv_port": 14579})
        if url == f"{DECODE}/tokenize":  # a token a character (a message's content, for chat)
            text = body.get("prompt") or "".join(m["content"] for m in body["messages"])
            return httpx.Response(200, json={"count": len(text), "max_model_len": 64, "tokens": [0] * len(text)})
        if url.startswith(PREFILL):
            if self.prefill_status == 599:
                raise httpx.ConnectError("refused")
            return httpx.Response(self.prefill_status, json={"error": {"message": "bad max_tokens"}})
        return httpx.Response(200, stream=Chunks(b"data: {\"x\": 1}\n\n", b"data: [DONE]\n\n"),
                              headers={"content-type": "text/event-stream"})


def _post(upstreams: Upstreams, body: dict, path: str = "/v1/completions", max_local_prefill_length: int = 0,
          prefill_on_idle_decode: bool = False, in_flight: dict[str, int] | None = None,
          max_local_prefill_length_if_busy: int = 0, long_in_flight: dict[str, int] | None = None
          ) -> tuple[httpx.Response, PDRouter]:
    """One request through a router; `in_flight`: the requests it holds at each server already
    (`long_in_flight`: of them, the long prompts at prefill servers)."""
    client = httpx.AsyncClient(transport=httpx.MockTransport(upstreams))
    policy = PDPolicy(max_local_prefill_length, max_local_prefill_length_if_busy, prefill_on_idle_decode)
    router = PDRouter(PDConfig((PREFILL,), (DECODE,), policy=policy), MockUpstream(client))
    router.num_in_flight.update(in_flight or {})
    router.num_long_in_flight.update(long_in_flight or {})

    async def call() -> httpx.Response:
        transport = httpx.ASGITransport(app=build_pd_app(router))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            response = await client.post(path, json=body)
            await response.aread()
            return response

    return asyncio.run(call()), router


def test_the_prompt_goes_to_the_prefill_server_then_the_request_to_the_decode_server():
    upstreams = Upstreams()
    body = {"prompt": "hi", "max_tokens": 50, "stream": True, "stream_options": {"include_usage": True}}
    response, router = _post(upstreams, body)
    assert response.status_code == 200 and response.content == b"data: {\"x\": 1}\n\ndata: [DONE]\n\n"
    urls = [url for url, _ in upstreams.seen]
    assert urls == [f"{DECODE}/kv_transfer", f"{PREFILL}/v1/completions", f"{DECODE}/v1/completions"]
    assert upstreams.seen[1][1] == {"prompt": "hi", "max_tokens": 1, "stream": False, "n": 1,
                                    "kv_transfer_params": {"decode_kv_address": "tcp://decode:14579"}}
    assert upstreams.seen[2][1] == body  # the client's request, unchanged
    assert router.stats.num_prefill_failures == 0


@pytest.mark.parametrize("status", [500, 503, 599])
def test_a_failed_prefill_server_leaves_the_prompt_to_the_decode_server(status):
    upstreams = Upstreams(prefill_status=status)
    response, router = _post(upstreams, {"prompt": "hi"})
    assert response.status_code == 200 and upstreams.seen[-1][0] == f"{DECODE}/v1/completions"
    assert router.stats.num_prefill_failures == 1


def test_a_client_error_on_the_prefill_server_goes_back_to_the_client():
    upstreams = Upstreams(prefill_status=400)
    response, _ = _post(upstreams, {"prompt": "hi", "max_tokens": -1})
    assert response.status_code == 400 and response.json()["error"]["message"] == "bad max_tokens"
    assert all(not url.endswith("/v1/completions") or url.startswith(PREFILL) for url, _ in upstreams.seen)


@pytest.mark.parametrize("path, body, is_local", [
    ("/v1/completions", {"prompt": "short"}, True),  # 5 tokens
    ("/v1/completions", {"prompt": "a longer prompt"}, False),
    ("/v1/completions", {"prompt": [1, 2, 3, 4, 5, 6, 7, 8]}, True),  # ids: counted without /tokenize
    ("/v1/completions", {"prompt": list(range(9))}, False),
    ("/v1/completions", {"prompt": ["a", "b"]}, False),  # a batch: through the prefill server
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}, True),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "a longer message"}]}, False),
])
def test_prompts_up_to_the_local_prefill_length_skip_the_prefill_server(path, body, is_local):
    upstreams = Upstreams()
    response, router = _post(upstreams, body, path, max_local_prefill_length=8)
    prefills = [url for url, _ in upstreams.seen if url.startswith(PREFILL)]
    assert response.status_code == 200 and upstreams.seen[-1] == (f"{DECODE}{path}", body)
    assert (prefills == [], router.stats.num_local_prefills) == ((True, 1) if is_local else (False, 0))
    tokenized = [b for url, b in upstreams.seen if url == f"{DECODE}/tokenize"]
    assert len(tokenized) == (1 if isinstance(body.get("prompt", ""), str) else 0)


@pytest.mark.parametrize("in_flight, is_local", [
    ({PREFILL: 1}, True),  # the prefill server is busy and the decode server idle: the decode server prefills
    ({}, False),  # both idle: through the prefill server
    ({PREFILL: 1, DECODE: 1}, False),  # a stream decodes on the decode server: never stalled by a local prefill
])
def test_an_idle_decode_server_takes_the_prompt_while_the_prefill_servers_are_busy(in_flight, is_local):
    upstreams = Upstreams()
    body = {"prompt": "a long prompt", "stream": True}
    response, router = _post(upstreams, body, prefill_on_idle_decode=True, in_flight=in_flight)
    prefills = [url for url, _ in upstreams.seen if url.startswith(PREFILL)]
    assert response.status_code == 200 and upstreams.seen[-1] == (f"{DECODE}/v1/completions", body)
    assert (prefills == [], router.stats.num_idle_decode_prefills) == ((True, 1) if is_local else (False, 0))
    assert router.num_in_flight == {PREFILL: 0, DECODE: 0, **in_flight}  # each request counted out once ended


def test_without_the_flag_a_busy_prefill_server_still_gets_the_prompt():
    upstreams = Upstreams()
    _, router = _post(upstreams, {"prompt": "hi"}, in_flight={PREFILL: 3})
    assert [url for url, _ in upstreams.seen if url.startswith(PREFILL)] == [f"{PREFILL}/v1/completions"]
    assert router.stats.num_idle_decode_prefills == 0


@pytest.mark.parametrize("body, long_in_flight, is_local", [
    ({"prompt": "a chat"}, {PREFILL: 1}, True),  # 6 tokens; the prefill server computes a long prompt
    ({"prompt": "a chat"}, {PREFILL: 0}, False),  # it computes short ones only: a short wait there
    ({"prompt": "a long prompt, longer than 8"}, {PREFILL: 1}, False),  # never on the decode server
    ({"prompt": ["a", "b"]}, {PREFILL: 1}, False),  # a batch: its length unknown
])
def test_a_short_prompt_is_computed_on_the_decode_server_beside_long_prefills(body, long_in_flight, is_local):
    upstreams = Upstreams()
    in_flight = {PREFILL: 1, DECODE: 2}
    response, router = _post(upstreams, body, in_flight=in_flight, max_local_prefill_length_if_busy=8,
                             long_in_flight=long_in_flight)
    prefills = [b for url, b in upstreams.seen if url.startswith(PREFILL)]
    assert response.status_code == 200 and upstreams.seen[-1] == (f"{DECODE}/v1/completions", body)
    assert (prefills == [], router.stats.num_local_beside_long_prefills) == ((True, 1) if is_local else (False, 0))
    assert router.num_in_flight == in_flight and router.num_long_in_flight == long_in_flight  # counted out


def test_a_prompt_at_the_prefill_server_counts_as_long_while_in_flight():
    class Watching(Upstreams):
        def __call__(self, request):
            if str(request.url).startswith(PREFILL):
                self.long_seen = dict(router.num_long_in_flight)
            return super().__call__(request)

    router = None
    for prompt, num_long in (("a long prompt, longer than 8", 1), ("a chat", 0)):
        upstreams = Watching()
        client = httpx.AsyncClient(transport=httpx.MockTransport(upstreams))
        router = PDRouter(PDConfig((PREFILL,), (DECODE,), policy=PDPolicy(max_local_prefill_length_if_busy=8)), MockUpstream(client))
        asyncio.run(router.prefill("/v1/completions", {"prompt": prompt}, [], DECODE,
                                   router.config.policy.is_long(len(prompt))))
        assert upstreams.long_seen == {PREFILL: num_long} and router.num_long_in_flight == {PREFILL: 0}


def test_prefill_body_drops_what_is_about_the_output():
    body = prefill_body({"messages": [], "max_completion_tokens": 9, "best_of": 2, "n": 2, "min_tokens": 3},
                        "tcp://d:1")
    assert body == {"messages": [], "max_tokens": 1, "stream": False, "n": 1,
                    "kv_transfer_params": {"decode_kv_address": "tcp://d:1"}}


@pytest.mark.parametrize("argv, message", [
    (["route", "--pd-disaggregation", "--prefill", PREFILL], "at least one --prefill URL and one --decode URL"),
    (["route", "--prefill", PREFILL, "--decode", DECODE], "only with --pd-disaggregation"),
    (["route", "--pd-disaggregation", "--prefill", "prefill:1", "--decode", DECODE], "not an http"),
    (["route", "--pd-disaggregation", "--prefill", PREFILL, "--decode", DECODE, "--policy", "round-robin"],
     "--policy: not supported with --pd-disaggregation"),
    (["route", "--pd-disaggregation", "--prefill", PREFILL, "--decode", DECODE, "--backend", f"m={DECODE}"],
     "not --backend"),
    (["route", "--pd-disaggregation", "--prefill", PREFILL, "--decode", DECODE, "--max-local-prefill-length", "-1"],
     "--max-local-prefill-length: must be >= 0"),
    (["route", "--backend", f"m={DECODE}", "--max-local-prefill-length", "64"], "only with --pd-disaggregation"),
    (["route", "--backend", f"m={DECODE}", "--prefill-on-idle-decode"], "only with --pd-disaggregation"),
    (["route", "--backend", f"m={DECODE}", "--max-local-prefill-length-if-busy", "64"], "only with --pd-disagg"),
    (["route", "--pd-disaggregation", "--prefill", PREFILL, "--decode", DECODE, "--max-local-prefill-length-if-busy",
      "-1"], "--max-local-prefill-length-if-busy: must be >= 0"),
])
def test_the_flags_are_validated(argv, message, capsys):
    assert route_main(argv) == 2
    assert message in capsys.readouterr().err
