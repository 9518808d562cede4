"""The browser pages served beside the API: the playground at `GET /` (`POST /` stays TGI's route).

Plain HTML/CSS/JS shipped in the package (static/playground/), no build step, nothing loaded from
elsewhere. The pages themselves are open (middleware.is_open_page: a browser cannot send the key when it
loads them); the API calls they make send `Authorization: Bearer KEY`, which the page asks for on a 401.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
from starlette.staticfiles import StaticFiles

STATIC_DIR = Path(__file__).parent / "static"
PLAYGROUND_DIR = STATIC_DIR / "playground"
PLAYGROUND_ASSETS = "/static/playground"


def add_ui_routes(app: FastAPI) -> None:
    """GET / (the playground page) and its assets under /static/playground/."""

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(PLAYGROUND_DIR / "index.html", headers={"Cache-Control": "no-cache"})

    app.mount(PLAYGROUND_ASSETS, StaticFiles(directory=PLAYGROUND_DIR), name="playground-assets")
