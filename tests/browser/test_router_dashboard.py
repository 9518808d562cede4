"""The router's GET /dashboard in a real browser: two real tiny replicas and one address where nothing
listens, behind a real router, while streaming completions run through it: a row per replica with its
health and routed requests, a row for the pool, charts that follow the load."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from streaming_load import StreamingLoad

from llmserve.router.replicas import free_port
from llmserve.testing.router_servers import RouterProcess, shared_tiny_model
from llmserve.testing.servers import ServerProcess

REPLICA_ARGS = ("--max-model-len", "512", "--num-kv-blocks", "200", "--served-model-name", "tiny",
                "--log-level", "warning")
HEALTH = ("--health-interval-s", "0.3", "--failure-threshold", "2", "--cooldown-s", "600",
          "--scrape-interval-s", "0.5")
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def replicas(tmp_path_factory):
    model_dir = shared_tiny_model(str(tmp_path_factory.getbasetemp()))
    servers = [ServerProcess(["--model", model_dir, *REPLICA_ARGS]) for _ in range(2)]
    with ThreadPoolExecutor(len(servers)) as pool:
        list(pool.map(lambda s: s.start(), servers))
    yield servers
    for server in servers:
        server.stop()


@pytest.fixture(scope="module")
def dead_url():
    return f"http://127.0.0.1:{free_port()}"  # nothing listens: probes fail, the router ejects it


@pytest.fixture(scope="module")
def router(replicas, dead_url):
    backends = [arg for url in [*(s.url for s in replicas), dead_url] for arg in ("--backend", f"tiny={url}")]
    with RouterProcess([*backends, *HEALTH]) as router:
        yield router


def cell(url: str, column: str) -> str:
    return f"document.querySelector('#backends tr[data-key=\"{url}\"] td[data-column=\"{column}\"]')?.textContent"


def wait_for(page, js: str):
    return page.wait_for_function(js, timeout=TIMEOUT_MS).json_value()


def test_router_state_is_open_and_lists_the_backends(router, replicas, dead_url):
    state = httpx.get(f"{router.url}/dashboard/state").json()
    assert state["kind"] == "router" and [p["name"] for p in state["pools"]] == ["tiny"]
    assert {b["url"] for b in state["backends"]} == {*(s.url for s in replicas), dead_url}


def test_router_dashboard_has_a_row_per_replica(router, replicas, dead_url, page, artifacts_dir):
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(f"{router.url}/dashboard")
    wait_for(page, "document.querySelectorAll('#backends tbody tr').length === 3")
    wait_for(page, f"{cell(dead_url, 'Health')} === 'ejected'")
    assert wait_for(page, f"{cell(dead_url, 'LoRA adapters (in slots)')}") == "–"  # these replicas serve none
    with StreamingLoad(router.url, "tiny", num_streams=4) as load:
        for server in replicas:
            wait_for(page, f"{cell(server.url, 'Health')} === 'healthy'")
            wait_for(page, f"Number({cell(server.url, 'Routed')}) > 0")
            wait_for(page, f"Number({cell(server.url, 'Running')}) > 0")  # the load scraped from its /metrics
        wait_for(page, "Number(document.querySelector('[data-chart=in_flight]')?.dataset.max) > 0")
        wait_for(page, "Number(document.querySelector('#pools tbody tr[data-key=tiny] td[data-column=\"In flight\"]')"
                   "?.textContent) > 0")
        wait_for(page, "Number(document.querySelector('[data-chart=requests_per_s]')?.dataset.points) >= 4")
        page.set_viewport_size({"width": 1280, "height": 400})  # full_page: as tall as the content
        page.screenshot(path=str(artifacts_dir / "router-dashboard.png"), full_page=True)
    assert load.num_chunks > 0 and not load.errors
    assert requested and all(url.startswith(router.url + "/") for url in requested), requested
