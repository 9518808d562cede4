"""The router and LoRA adapters: it learns which backend serves which adapter (GET /v1/models cards with a
parent, read again when a backend's adapter count changes) and sends an adapter's requests there, the
adapter's name unchanged, preferring backends whose /metrics say the adapter is in a slot."""

import asyncio
import json

import httpx
from test_router_proxy import A, B, backend, call, json_response, make_gateway, ok

from llmserve.router.app import build_app
from llmserve.router.monitor import learn_model, scrape

ADAPTERS = {"a": [], "b": ["sql"]}
RESIDENT = {"a": [], "b": []}


def handler(request: httpx.Request) -> httpx.Response:
    host = request.url.host
    if request.url.path == "/v1/models":
        cards = [{"id": "m"}, *({"id": name, "parent": "m"} for name in ADAPTERS.get(host, []))]
        return json_response(200, {"object": "list", "data": cards})
    if request.url.path == "/metrics":
        text = f"llmserve:lora_adapters{{model_name=\"m\"}} {len(ADAPTERS.get(host, []))}\n"
        text += "".join(f'llmserve:lora_adapter_resident{{lora_name="{name}",model_name="m"}} '
                        f'{float(name in RESIDENT.get(host, []))}\n' for name in ADAPTERS.get(host, []))
        return httpx.Response(200, text=text)
    return ok(request)


def test_an_adapters_requests_go_to_the_backends_that_serve_it():
    async def run():
        gw = make_gateway(handler)
        for url in (A, B):
            assert await learn_model(gw, backend(gw, url))
        assert backend(gw, B).adapters == {"sql"} and backend(gw, B).served_model == "m"
        for _ in range(3):
            r = await call(gw, {"model": "sql", "prompt": "hi"})
            assert r.status_code == 200 and r.json()["served_by"] == "b"
            assert r.json()["body"]["model"] == "sql"  # the adapter's name reaches the backend
        served = {(await call(gw, {"model": "m", "prompt": "hi"})).json()["served_by"] for _ in range(2)}
        assert served == {"a", "b"}  # the base model: every backend, as before
        assert (await call(gw, {"model": "nope", "prompt": "hi"})).status_code == 404

    asyncio.run(run())


def test_a_scrape_learns_adapters_loaded_at_run_time():
    async def run():
        gw = make_gateway(handler)
        a = backend(gw, A)
        assert await learn_model(gw, a) and a.adapters == frozenset()
        ADAPTERS["a"] = ["chat"]
        try:
            await scrape(gw, a)
            assert a.adapters == {"chat"} and a.scraped.num_adapters == 1
            r = await call(gw, {"model": "chat", "prompt": "hi"})
            assert json.loads(r.content)["served_by"] == "a"
        finally:
            ADAPTERS["a"] = []

    asyncio.run(run())


def test_an_adapters_requests_prefer_the_backend_holding_it_in_a_slot():
    async def run():
        gw = make_gateway(handler)
        ADAPTERS["a"], RESIDENT["a"] = ["sql", "chat"], ["chat"]
        try:
            for url in (A, B):
                assert await learn_model(gw, backend(gw, url))
                await scrape(gw, backend(gw, url))
            assert backend(gw, A).scraped.resident_adapters == {"chat"}
            assert backend(gw, B).scraped.resident_adapters == frozenset()
            served = {(await call(gw, {"model": "chat", "prompt": "hi"})).json()["served_by"] for _ in range(4)}
            assert served == {"a"}
            served = {(await call(gw, {"model": "sql", "prompt": "hi"})).json()["served_by"] for _ in range(4)}
            assert served == {"a", "b"}  # held by neither: both serve it
        finally:
            ADAPTERS["a"], RESIDENT["a"] = [], []

    asyncio.run(run())


def test_the_routers_models_list_the_adapters_its_backends_serve():
    async def run():
        gw = make_gateway(handler)
        for url in (A, B):
            assert await learn_model(gw, backend(gw, url))
        transport = httpx.ASGITransport(app=build_app(gw))
        async with httpx.AsyncClient(transport=transport, base_url="http://router") as client:
            cards = {c["id"]: c for c in (await client.get("/v1/models")).json()["data"]}
            assert cards["sql"]["parent"] == "m" and "parent" not in cards["m"]
            one = await client.get("/v1/models/sql")
            assert one.status_code == 200 and one.json()["parent"] == "m"
            backend(gw, B).is_draining = True  # the only backend serving it leaves: no longer listed
            assert "sql" not in {c["id"] for c in (await client.get("/v1/models")).json()["data"]}
            assert (await client.get("/v1/models/sql")).status_code == 404

    asyncio.run(run())
