"""A real headless Chromium (Debian's package; .ci/run installs it when missing) driven by Playwright.

Playwright's own browser download cannot work here, so it is pointed at the system executable. Tests skip,
saying why, only where no Chromium is installed. Screenshots go to $LLMSERVE_ARTIFACTS (default:
test-artifacts/ in the checkout) for docs/ui.md.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from llmserve.testing.servers import ServerProcess, start_tiny_server

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


@pytest.fixture(scope="session")
def api_key() -> str:
    return "browser-secret"


@pytest.fixture(scope="session")
def keyed_server(tmp_path_factory: pytest.TempPathFactory, api_key: str) -> Iterator[ServerProcess]:
    """A server that wants `api_key`, shared by the browser modules (the playground's key prompt, the dashboard)."""
    server = start_tiny_server(str(tmp_path_factory.mktemp("keyed-model")), "--served-model-name", "tiny",
                               "--api-key", api_key)
    yield server
    assert server.stop() == 0


def chromium_path() -> str | None:
    for name in CHROMIUM_NAMES:
        path = shutil.which(name)
        if path:
            return path
    return None


@pytest.fixture(scope="session")
def artifacts_dir() -> Path:
    path = Path(os.environ.get("LLMSERVE_ARTIFACTS", Path(__file__).resolve().parents[2] / "test-artifacts"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")  # not session: sync Playwright keeps an event loop running while open,
def browser():                   # which would break asyncio.run in every test after the browser tests
    executable = chromium_path()
    if executable is None:
        pytest.skip("no Chromium installed (apt-get install chromium); .ci/run installs it")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=executable, headless=True,
                                             args=["--no-sandbox", "--disable-gpu"])
        yield browser
        browser.close()


@pytest.fixture
def page(browser):
    context = browser.new_context(viewport={"width": 1280, "height": 860})
    page = context.new_page()
    yield page
    context.close()
