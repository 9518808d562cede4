"""The playground (GET /) in a real headless Chromium against a real server on the tiny random model:
streamed chat and completion, Stop aborting the engine request, logprobs on hover, structured output, the
API key prompt. Screenshots go to artifacts_dir (docs/ui.md shows them)."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from playwright.sync_api import Page, expect

from llmserve.testing.servers import start_tiny_server, wait_until

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["colour", "size"],
          "properties": {"colour": {"enum": ["red", "green", "blue"]},
                         "size": {"type": "integer", "minimum": 1, "maximum": 9}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory, gate):
    server = start_tiny_server(str(tmp_path_factory.mktemp("model")), "--served-model-name", "tiny",
                               "--max-model-len", "2048", env=gate.env)
    yield server
    assert server.stop() == 0


def open_playground(page: Page, url: str) -> Page:
    page.goto(url + "/")
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    return page


def set_params(page: Page, max_tokens: int, ignore_eos: bool = True, logprobs: bool = True) -> None:
    page.fill("#max_tokens", str(max_tokens))
    page.set_checked("#ignore_eos", ignore_eos)
    page.set_checked("#logprobs", logprobs)


def last_answer(page: Page):
    return page.locator(".turn.assistant").last


def record_partials(page: Page, selector: str) -> None:
    """Every distinct text of `selector` as the page changes it, in window.partials."""
    page.evaluate("""(selector) => {
        window.partials = [];
        new MutationObserver(() => {
            const text = document.querySelector(selector)?.textContent ?? "";
            if (text && text !== window.partials.at(-1)) window.partials.push(text);
        }).observe(document.body, {childList: true, subtree: true, characterData: true});
    }""", selector)


def aborted(server) -> float:
    text = httpx.get(f"{server.url}/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("llmserve:request_success_total{") and 'finished_reason="abort"' in line)


def test_chat_streams_token_by_token(server, gate, page, artifacts_dir):
    """The engine runs one step at a time: each step's token reaches the page as its own span (a
    free-running engine can deliver several tokens in one network read, so counting renders would race)."""
    requested = []
    page.on("request", lambda request: requested.append(request.url))
    open_playground(page, server.url)
    set_params(page, max_tokens=48)
    record_partials(page, ".turn.assistant .answer")
    page.fill("#system", "You are terse.")
    page.fill("#user-input", "Tell me a story.")
    with gate.held() as start:
        page.click("#send")
        gate.wait_for("added", start["added"] + 1)  # the chat request reached the held engine
        tokens = last_answer(page).locator(".tok")
        for num_tokens in (1, 2, 3):  # one step, one token, one more span
            gate.run_steps(1)
            expect(tokens).to_have_count(num_tokens)
    stats = last_answer(page).locator(".stats")
    expect(stats).to_contain_text("finish: length")
    partials = page.evaluate("window.partials")
    final = last_answer(page).locator(".answer").text_content()
    assert partials and partials[-1] == final
    assert all(later.startswith(earlier) and later != earlier for earlier, later in zip(partials, partials[1:]))
    line = stats.text_content()
    for part in ("TTFT", "tokens/s", "48 tokens", "cached prompt tokens"):
        assert part in line, line
    assert requested and all(url.startswith(server.url + "/") for url in requested), requested
    page.screenshot(path=artifacts_dir / "playground-chat.png")


def test_chat_keeps_the_conversation(server, page):
    open_playground(page, server.url)
    set_params(page, max_tokens=4)
    for text in ("first", "second"):
        page.fill("#user-input", text)
        page.click("#send")
        expect(last_answer(page).locator(".stats")).to_contain_text("finish: length")
    expect(page.locator(".turn.user")).to_have_text(["first", "second"])
    line = last_answer(page).locator(".stats").text_content()
    cached = int(line.split("cached prompt tokens ")[1].split(" /")[0])
    assert cached > 0, line  # the second turn's prompt starts with the first's


def test_completion_mode(server, page, artifacts_dir):
    open_playground(page, server.url)
    page.click("#modes button[data-mode=completion]")
    expect(page.locator("#chat-pane")).to_be_hidden()
    set_params(page, max_tokens=16)
    page.fill("#prompt", "Once upon a time")
    page.click("#send")
    stats = page.locator("#completion-output .stats")
    expect(stats).to_contain_text("finish: length")
    assert "16 tokens" in stats.text_content()
    assert page.locator("#completion-output .tok").count() >= 1
    page.screenshot(path=artifacts_dir / "playground-completion.png")


def test_stop_aborts_the_request(server, gate, page, artifacts_dir):
    before = aborted(server)
    open_playground(page, server.url)
    set_params(page, max_tokens=1900)
    page.fill("#user-input", "Go on forever.")
    page.click("#send")
    expect(last_answer(page).locator(".tok").first).to_be_attached()
    with gate.held():  # no token after this: the request cannot finish before Stop reaches it
        page.click("#stop")
        expect(last_answer(page).locator(".stats")).to_contain_text("stopped")
        expect(page.locator("#send")).to_be_enabled()
    wait_until(lambda: aborted(server) == before + 1, what="the aborted request in /metrics")
    page.screenshot(path=artifacts_dir / "playground-stop.png")


def test_logprob_shown_on_hover(server, page, artifacts_dir):
    open_playground(page, server.url)
    set_params(page, max_tokens=12)
    page.fill("#top_logprobs", "3")
    page.fill("#user-input", "Hello")
    page.click("#send")
    expect(last_answer(page).locator(".stats")).to_contain_text("finish: length")
    tooltip = page.locator("#tooltip")
    expect(tooltip).to_be_hidden()
    # a token whose bytes end mid-character shows no text (its span is empty): hover one that shows some
    last_answer(page).locator(".tok.has-logprobs").filter(has_text=re.compile(r"\S")).first.hover()
    expect(tooltip).to_be_visible()
    expect(tooltip.locator("tr.chosen").first).to_contain_text("logprob -")
    assert tooltip.locator("tr").count() >= 2  # the chosen token and its alternatives
    page.screenshot(path=artifacts_dir / "playground-logprobs.png")


@pytest.mark.parametrize("mode", ["chat", "completion"])
def test_json_schema_gives_json(server, page, artifacts_dir, mode):
    open_playground(page, server.url)
    page.click(f"#modes button[data-mode={mode}]")
    set_params(page, max_tokens=400, ignore_eos=False, logprobs=False)
    page.fill("#json-schema", json.dumps(SCHEMA, indent=2))
    if mode == "chat":
        page.fill("#user-input", "Describe a ball in JSON.")
        output = last_answer(page)
    else:
        page.fill("#prompt", "A ball, in JSON:")
        output = page.locator("#completion-output")
    page.click("#send")
    expect(output.locator(".stats")).to_contain_text("valid JSON · finish: stop")
    value = json.loads(output.locator(".answer").text_content())
    assert set(value) == {"colour", "size"} and value["colour"] in ("red", "green", "blue")
    if mode == "chat":
        page.screenshot(path=artifacts_dir / "playground-structured.png")


def test_bad_schema_is_reported_before_sending(server, page):
    open_playground(page, server.url)
    page.fill("#json-schema", "{not json")
    page.fill("#user-input", "x")
    page.click("#send")
    expect(page.locator("#status")).to_contain_text("not valid JSON")
    expect(page.locator(".turn")).to_have_count(0)


def test_schema_refused_by_the_server_shows_its_message(server, page):
    open_playground(page, server.url)
    page.fill("#json-schema", json.dumps({"type": "object", "properties": {"a": {"type": "nope"}}}))
    page.fill("#user-input", "x")
    page.click("#send")
    answer = last_answer(page)
    expect(answer.locator(".error")).to_contain_text("400")
    expect(answer.locator(".stats")).to_contain_text("finish: error")


def test_api_key_prompt(keyed_server, api_key, page, artifacts_dir):
    url = keyed_server.url
    assert httpx.get(url + "/").status_code == 200  # the page itself loads without the key
    assert httpx.post(url + "/", json={"inputs": "x"}).status_code == 401  # TGI's POST / still needs it
    page.goto(url + "/")
    prompt = page.locator("#key-prompt")
    expect(prompt).to_be_visible()
    page.screenshot(path=artifacts_dir / "playground-key.png")
    page.fill("#api-key", "wrong")
    page.click("#key-form button[type=submit]")
    expect(prompt).to_be_visible()  # asked again
    page.fill("#api-key", api_key)
    page.click("#key-form button[type=submit]")
    expect(page.locator("body")).to_have_attribute("data-ready", "true")
    expect(prompt).to_be_hidden()
    set_params(page, max_tokens=5)
    page.fill("#user-input", "hi")
    page.click("#send")
    expect(last_answer(page).locator(".stats")).to_contain_text("finish: length")


def test_tgi_post_root_still_works(server):
    out = httpx.post(server.url + "/", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}}, timeout=60)
    assert out.status_code == 200 and isinstance(out.json()[0]["generated_text"], str)
