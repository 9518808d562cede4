"""The Ray Serve P/D ingress's placement (rayserve/pd_ingress.py) over scripted deployment handles, no Ray: it
follows the P/D router's policy (router/pd_policy.py) from what it counts in flight, the prompt's length
counted by a decode replica's /tokenize, and a prompt it keeps off the prefill replicas goes to the decode
replica it asked."""

from __future__ import annotations

import asyncio
import json

import pytest
from starlette.requests import Request
from starlette.responses import StreamingResponse

from llmserve.config import EngineConfig
from llmserve.rayserve.config import Deployment, RayServeConfig
from llmserve.rayserve.messages import ForwardedRequest, ResponseHead
from llmserve.rayserve.pd_ingress import PDIngress
from llmserve.server.config import ServerConfig

DECODE_REPLICA = "d1"


class Stream:
    """A streaming handle call's answer: a ResponseHead, then body chunks."""

    def __init__(self, *items) -> None:
        self.items = list(items)

    def __aiter__(self):
        return self

    async def __anext__(self):
        if not self.items:
            raise StopAsyncIteration
        return self.items.pop(0)

    def cancel(self) -> None:
        self.items = []


class Handle:
    """A deployment's handle: records (role, path) of each call; a decode replica counts a prompt's tokens a
    character each and streams its answer in two chunks."""

    def __init__(self, role: str, calls: list) -> None:
        self.role, self.calls = role, calls

    def options(self, method_name: str, stream: bool = False) -> Method:
        return Method(self, method_name)


class Method:
    def __init__(self, handle: Handle, name: str) -> None:
        self.handle, self.name = handle, name

    def remote(self, request: ForwardedRequest | None = None):
        role = self.handle.role
        if self.name == "kv_address":
            self.handle.calls.append((role, "kv_address"))
            return _value((DECODE_REPLICA, "tcp://10.0.0.2:5555"))
        self.handle.calls.append((role, request.path))
        if request.path == "/tokenize":
            count = len(json.loads(request.body)["prompt"])
            return Stream(ResponseHead(200, (), json.dumps({"count": count}).encode(), is_complete=True))
        if role == "prefill":
            return Stream(ResponseHead(200, (), b"{}", is_complete=True))
        return Stream(ResponseHead(200, ((b"content-type", b"text/event-stream"),), b"data: 1\n\n"), b"data: 2\n\n")


async def _value(value):
    return value


def _ingress(calls: list, **policy) -> PDIngress:
    config = RayServeConfig(pd_disaggregation=True, num_prefill_replicas=1, **policy)
    deployment = Deployment(EngineConfig(), ServerConfig(), config)
    return PDIngress(Handle("decode", calls), Handle("prefill", calls), deployment)


def _request(body: dict) -> Request:
    raw = json.dumps(body).encode()
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "root_path": "", "query_string": b"",
             "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]}

    async def receive():
        return {"type": "http.request", "body": raw, "more_body": False}

    return Request(scope, receive)


async def _call(ingress: PDIngress, body: dict) -> bytes:
    """The streamed body; the request counted in flight at its decode replica while it streams."""
    num_before = ingress.num_decode_in_flight[DECODE_REPLICA]
    response = await ingress(_request(body))
    assert isinstance(response, StreamingResponse)
    assert ingress.num_decode_in_flight[DECODE_REPLICA] == num_before + 1
    return b"".join([chunk async for chunk in response.body_iterator])


@pytest.mark.parametrize("prompt, decode_in_flight, num_long, is_local", [
    ("a chat", 2, 1, True),  # 6 tokens; the one prefill replica computes a long prompt
    ("a chat", 2, 0, False),  # it computes a short one: a short wait there
    ("a prompt longer than 8", 2, 1, False),  # a long prompt never goes to a busy decode replica
    ("a prompt longer than 8", 0, 1, True),  # ... but to an idle one (prefill_on_idle_decode)
])
def test_the_ingress_places_prompts_by_the_routers_policy(prompt, decode_in_flight, num_long, is_local):
    calls = []
    ingress = _ingress(calls, max_local_prefill_length_if_busy=8, prefill_on_idle_decode=True)
    ingress.num_prefills_in_flight = ingress.num_long_prefills_in_flight = num_long
    if num_long == 0:
        ingress.num_prefills_in_flight = 1  # a short prompt in flight there
    if decode_in_flight:
        ingress.num_decode_in_flight[DECODE_REPLICA] = decode_in_flight
    body = asyncio.run(_call(ingress, {"prompt": prompt, "stream": True}))
    assert body == b"data: 1\n\ndata: 2\n\n"
    prefill_calls = [call for call in calls if call[0] == "prefill"]
    assert prefill_calls == ([] if is_local else [("prefill", "/v1/completions")])
    assert calls[:2] == [("decode", "kv_address"), ("decode", "/tokenize")]
    assert calls[-1] == ("decode", "/v1/completions")
    assert ingress.num_decode_in_flight[DECODE_REPLICA] == decode_in_flight  # counted out at the body's end


def test_without_a_rule_every_prompt_goes_to_a_prefill_replica_and_nothing_is_tokenized():
    calls = []
    ingress = _ingress(calls)
    ingress.num_prefills_in_flight = ingress.num_long_prefills_in_flight = 5
    asyncio.run(_call(ingress, {"prompt": "hi", "stream": True}))
    assert calls == [("decode", "kv_address"), ("prefill", "/v1/completions"), ("decode", "/v1/completions")]
    assert (ingress.num_prefills_in_flight, ingress.num_long_prefills_in_flight) == (5, 5)  # counted out again


def test_a_prompt_of_ids_is_counted_without_tokenize():
    calls = []
    ingress = _ingress(calls, max_local_prefill_length=8)
    asyncio.run(_call(ingress, {"prompt": [1, 2, 3], "stream": True}))
    assert calls == [("decode", "kv_address"), ("decode", "/v1/completions")]
