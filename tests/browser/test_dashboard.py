"""GET /dashboard of a real server (tiny model, an API key set) in a real browser, while streaming
completions run: the running-requests figure and the charts follow the load; nothing loads from outside
the server; the page asks for the key when the state answers 401; a Mixture-of-Experts model's server adds
the expert load balance, a dense one's has none."""

from __future__ import annotations

import httpx
import pytest
from streaming_load import StreamingLoad

from llmserve.testing.maker import make_model
from llmserve.testing.servers import SMALL_ENGINE_ARGS, ServerProcess


TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def server(keyed_server):
    return keyed_server


def wait_for(page, js: str):
    """Wait until the expression over the DOM is truthy; returns its value."""
    return page.wait_for_function(js, timeout=TIMEOUT_MS).json_value()


def tile_value(field: str) -> str:
    return f"Number(document.querySelector('[data-field={field}]')?.dataset.value)"


def chart_attr(chart: str, attr: str) -> str:
    return f"Number(document.querySelector('[data-chart={chart}]')?.dataset.{attr})"


def test_page_and_state_are_open_like_metrics_while_the_api_needs_the_key(server):
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    for path in ("/metrics", "/dashboard", "/dashboard/dashboard.js", "/dashboard/dashboard.css"):
        assert httpx.get(server.url + path).status_code == 200, path
    state = httpx.get(f"{server.url}/dashboard/state").json()
    assert state["kind"] == "server" and state["model"] == "tiny" and state["kv_cache"]["blocks"] == 512


def test_dashboard_follows_a_streaming_load(server, api_key, page, artifacts_dir):
    requested: list[str] = []
    page.on("request", lambda request: requested.append(request.url))
    page.goto(f"{server.url}/dashboard")
    wait_for(page, "document.querySelector('#status').dataset.state === 'live'")
    with StreamingLoad(server.url, "tiny", num_streams=4, api_key=api_key) as load:
        assert wait_for(page, f"{tile_value('running')} > 0")
        assert wait_for(page, f"{chart_attr('tokens', 'max')} > 0")
        assert wait_for(page, f"{chart_attr('requests', 'max')} > 0")
        wait_for(page, "document.querySelector('[data-field=itl] .value').textContent !== '–'")
        wait_for(page, f"{chart_attr('tokens', 'points')} >= 4")  # a few seconds of history for the picture
        page.set_viewport_size({"width": 1280, "height": 400})  # full_page: as tall as the content
        page.screenshot(path=str(artifacts_dir / "dashboard.png"), full_page=True)
    assert load.num_chunks > 0 and not load.errors
    assert page.locator("[data-field=moe], [data-chart=moe]").count() == 0  # a dense model: no expert panel
    assert requested and all(url.startswith(server.url + "/") for url in requested), requested


def test_the_page_asks_for_the_key_when_the_state_answers_401(server, api_key, page):
    """The state is open (like /metrics); a proxy that closes it is played here by intercepting the fetch."""
    seen: list[str | None] = []

    def guard(route):
        authorization = route.request.headers.get("authorization")
        seen.append(authorization)
        if authorization == f"Bearer {api_key}":
            route.continue_()
        else:
            route.fulfill(status=401, body="{}", content_type="application/json")

    page.route("**/dashboard/state", guard)
    page.goto(f"{server.url}/dashboard")
    page.locator("#key-form").wait_for(state="visible", timeout=TIMEOUT_MS)
    page.fill("#key-input", api_key)
    page.click("#key-form button")
    wait_for(page, "document.querySelector('#status').dataset.state === 'live'")
    assert page.locator("#key-form").is_hidden()
    assert seen[0] is None and f"Bearer {api_key}" in seen


@pytest.fixture(scope="module")
def moe_server(tmp_path_factory):
    path = make_model("qwen3_moe", "tiny-moe", str(tmp_path_factory.mktemp("moe-model")), seed=0)
    server = ServerProcess(["--model", path, *SMALL_ENGINE_ARGS, "--served-model-name", "tiny-moe"]).start()
    yield server
    assert server.stop() == 0


def test_a_moe_model_shows_its_expert_load_balance(moe_server, page):
    page.goto(f"{moe_server.url}/dashboard")
    wait_for(page, "document.querySelector('#status').dataset.state === 'live'")
    with StreamingLoad(moe_server.url, "tiny-moe", num_streams=4) as load:
        assert wait_for(page, f"{tile_value('moe')} >= 1")  # max over mean is 1 when even, more otherwise
        assert wait_for(page, f"{chart_attr('moe', 'max')} >= 1")
    assert load.num_chunks > 0 and not load.errors
