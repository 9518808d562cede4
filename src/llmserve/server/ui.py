"""The browser pages served beside the API: the playground at `GET /` (`POST /` stays TGI's route) and the
API's reference at `GET /docs` (drawn from /openapi.json by a page of our own, so that it works offline).

Plain HTML/CSS/JS shipped in the package (static/playground/), no build step, nothing loaded from
elsewhere. The pages themselves are open (middleware.is_open_page: a browser cannot send the key when it
loads them); the API calls they make send `Authorization: Bearer KEY`, which the page asks for on a 401.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse, Response
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
PLAYGROUND_DIR = STATIC_DIR / "playground"
PLAYGROUND_ASSETS = "/static/playground"
DOCS_DIR = STATIC_DIR / "docs"
DOCS_ASSETS = "/static/docs"


# The pages' icon, inline: a browser asks for /favicon.ico, and a 404 there is noise in its console.
FAVICON_SVG = (b'<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 16 16"><rect width="16" height="16" rx="3" '
               b'fill="#2563eb"/><path d="M5 3v10M10 3v10" stroke="#fff" stroke-width="2"/></svg>')


def add_ui_routes(app: FastAPI) -> None:
    """GET / (the playground page), GET /docs (the API's reference), their assets under /static/ and the
    pages' icon."""

    @app.get("/docs", include_in_schema=False)
    async def docs() -> FileResponse:
        return FileResponse(DOCS_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    @app.get("/favicon.ico", include_in_schema=False)
    async def favicon() -> Response:
        return Response(FAVICON_SVG, media_type="image/svg+xml", headers={"Cache-Control": "max-age=86400"})

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(PLAYGROUND_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount(PLAYGROUND_ASSETS, StaticFiles(directory=PLAYGROUND_DIR), name="playground-assets")
    app.mount(DOCS_ASSETS, StaticFiles(directory=DOCS_DIR), name="docs-assets")
