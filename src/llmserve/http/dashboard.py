"""The dashboard page both fronts serve (the server's and the router's /dashboard): its static files
(static/dashboard/, nothing loaded from outside) and the answer of /dashboard/state. What the state holds
is each front's own (server/dashboard.py, router/dashboard.py), read from its registry by dashboard_state.py."""

from __future__ import annotations

from importlib import resources

import msgspec
from starlette.responses import Response

STATIC_FILES = {"dashboard.js": "text/javascript", "dashboard.css": "text/css"}


def static_file(name: str) -> bytes:
    return resources.files("llmserve.http").joinpath("static", "dashboard", name).read_bytes()


def page_response() -> Response:
    return Response(static_file("dashboard.html"), media_type="text/html; charset=utf-8",
                    headers={"Cache-Control": "no-cache"})


def asset_response(name: str) -> Response:
    return Response(static_file(name), media_type=f"{STATIC_FILES[name]}; charset=utf-8",
                    headers={"Cache-Control": "no-cache"})


def state_response(state: dict) -> Response:
    """/dashboard/state's answer: the state as JSON, never cached (the page polls it)."""
    return Response(msgspec.json.encode(state), media_type="application/json", headers={"Cache-Control": "no-store"})
