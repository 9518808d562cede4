"""A real headless Chromium (Debian's package; .ci/run installs it when missing) driven by Playwright.

Playwright's own browser download cannot work here, so it is pointed at the system executable. Tests skip,
saying why, only where no Chromium is installed. Screenshots go to $LLMSERVE_ARTIFACTS (default:
test-artifacts/ in the checkout) for docs/ui.md.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")


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
