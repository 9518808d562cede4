"""/docs in a real headless Chromium: the API's reference drawn from /openapi.json with nothing fetched from
anywhere but the server (Playwright sees every request the page makes), and without the API key."""

from __future__ import annotations

from playwright.sync_api import expect


def test_docs_render_offline_without_the_key(keyed_server, page, artifacts_dir):
    requested = []

    def only_the_server(route):
        requested.append(route.request.url)
        if route.request.url.startswith(keyed_server.url + "/"):
            route.continue_()
        else:
            route.abort()

    page.route("**/*", only_the_server)
    page.goto(keyed_server.url + "/docs")
    expect(page.locator("#routes")).to_contain_text("/v1/chat/completions")
    expect(page.locator("#schema-ChatCompletionRequest")).to_contain_text("messages *")
    page.click("#toc a:has-text('POST /v1/completions')")
    page.screenshot(path=str(artifacts_dir / "docs.png"))
    assert requested and all(url.startswith(keyed_server.url + "/") for url in requested), requested
