"""The playground's routes and files without a server: which paths the front door leaves open, the
files served, nothing loaded from elsewhere, every file covered by the package data."""

from __future__ import annotations

import fnmatch
import re
import tomllib
from pathlib import Path

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

import llmserve.http
from llmserve.server.middleware import is_open
from llmserve.server.ui import DOCS_DIR, PLAYGROUND_DIR, STATIC_DIR, add_ui_routes

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIR = Path(llmserve.http.__file__).parent / "static" / "dashboard"


def scope(method: str, path: str) -> dict:
    return {"type": "http", "method": method, "path": path, "headers": []}


@pytest.mark.parametrize("method, path, expected", [
    ("GET", "/", True), ("HEAD", "/", True), ("POST", "/", False),  # POST / is TGI's: the key still applies
    ("GET", "/static/playground/playground.js", True), ("POST", "/static/playground/x", False),
    ("GET", "/health", True), ("POST", "/v1/completions", False), ("GET", "/v1/models", False),
    ("GET", "/staticfoo", False), ("GET", "/favicon.ico", True), ("GET", "/docs", True),
    ("GET", "/static/docs/docs.js", True),
])
def test_open_paths(method, path, expected):
    assert is_open(scope(method, path)) is expected


@pytest.fixture(scope="module")
def client():
    app = FastAPI(docs_url=None, redoc_url=None)  # /docs is ours, as in build_app
    add_ui_routes(app)
    return TestClient(app)


def test_page_and_assets_are_served(client):
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    assert len(assets) == 2
    for asset in assets:
        response = client.get(asset)
        assert response.status_code == 200, asset
    script = client.get("/static/playground/playground.js")
    assert "javascript" in script.headers["content-type"]
    assert client.get("/static/playground/missing.js").status_code == 404


def test_the_icon_is_served_not_a_404(client):
    icon = client.get("/favicon.ico")
    assert icon.status_code == 200 and icon.headers["content-type"].startswith("image/svg+xml")
    assert icon.content.startswith(b"<svg")


def test_the_docs_page_and_its_assets_are_served(client):
    page = client.get("/docs")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assets = re.findall(r'(?:src|href)="(/static/[^"]+)"', page.text)
    assert len(assets) == 2
    for asset in assets:
        assert client.get(asset).status_code == 200, asset
    assert 'fetch("/openapi.json")' in client.get("/static/docs/docs.js").text


def test_module_imports_resolve(client):
    for path in PLAYGROUND_DIR.glob("*.js"):
        for name in re.findall(r'from "\./([^"]+)"', path.read_text()):
            assert (PLAYGROUND_DIR / name).is_file(), f"{path.name} imports {name}"


def test_nothing_loaded_from_elsewhere():
    for path in [*PLAYGROUND_DIR.iterdir(), *DOCS_DIR.iterdir()]:
        text = path.read_text()
        assert not re.search(r"https?://|//cdn|@import", text), path.name


@pytest.mark.parametrize("package, static_dir", [("llmserve.server", STATIC_DIR),
                                                 ("llmserve.http", DASHBOARD_DIR.parent)])
def test_package_data_covers_every_static_file(package, static_dir):
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["package-data"][package]
    for path in static_dir.rglob("*"):
        if path.is_file():
            relative = path.relative_to(static_dir.parent).as_posix()
            assert any(fnmatch.fnmatch(relative, p) for p in patterns), relative


def test_the_dashboards_percentages_stay_distinct_at_low_usage():
    """The KV chart's axis at 0.1% top: 0%, 0.05%, 0.1% (not 0.1% twice); run with node where it is installed."""
    import shutil
    import subprocess

    if shutil.which("node") is None:
        pytest.skip("no node on this machine")
    source = (DASHBOARD_DIR / "dashboard.js").read_text()
    pct = re.search(r"^function pct\(v\) \{.*?^\}", source, re.M | re.S).group(0)
    script = pct + "\nconsole.log([0, 0.0005, 0.001, 0.25, 1].map(pct).join(' '));"
    out = subprocess.run(["node", "-e", script], capture_output=True, text=True, timeout=30, check=True).stdout
    assert out.split() == ["0.0%", "0.050%", "0.10%", "25.0%", "100.0%"]
