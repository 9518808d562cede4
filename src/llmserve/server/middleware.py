"""The front door (pure ASGI, no per-request task): drain (503), API key (401), body size (413), and
the count of requests in flight that a drain waits for. /health, /metrics, the API's description
(/openapi.json, /docs: a browser cannot send the key) and the dashboard (it shows what /metrics does) are
always open, and so are GET and HEAD of the browser pages (ui.py: the playground at `/`, its files under
/static/, the icon); `POST /` (TGI) still needs the key."""

from __future__ import annotations

import hmac

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from llmserve.http.errors import APIError, service_unavailable
from llmserve.server.dashboard import DASHBOARD_PATHS
from llmserve.server.errors import error_response
from llmserve.server.serving_common import ServingContext

OPEN_PATHS = frozenset({"/health", "/metrics", "/openapi.json", "/docs"}) | DASHBOARD_PATHS
OPEN_PAGES = frozenset({"/", "/favicon.ico"})  # open to GET and HEAD only
OPEN_PAGE_PREFIXES = ("/static/",)
PAGE_METHODS = frozenset({"GET", "HEAD"})


def is_open(scope: Scope) -> bool:
    path = scope["path"]
    if path in OPEN_PATHS:
        return True
    is_page = path in OPEN_PAGES or path.startswith(OPEN_PAGE_PREFIXES)
    return is_page and scope["method"] in PAGE_METHODS


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return value
    return None


def is_authorized(scope: Scope, api_key: bytes) -> bool:
    given = _header(scope, b"authorization") or b""
    scheme, _, token = given.partition(b" ")
    if scheme.lower() != b"bearer":
        token = b""
    return hmac.compare_digest(token.strip(), api_key)


class FrontDoor:
    def __init__(self, app: ASGIApp, ctx: ServingContext, api_key: str | None, max_body_bytes: int) -> None:
        self.app = app
        self.ctx = ctx
        self.api_key = api_key.encode() if api_key else None
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or is_open(scope):
            await self.app(scope, receive, send)
            return
        error = self._refusal(scope)
        if error is not None:
            await error_response(error)(scope, receive, send)
            return
        self.ctx.num_http_in_flight += 1
        try:
            await self.app(scope, self._limited(receive), send)
        finally:
            self.ctx.num_http_in_flight -= 1
            self.ctx.release(scope)

    def _refusal(self, scope: Scope) -> APIError | None:
        if self.ctx.is_draining:
            return service_unavailable("the server is shutting down", retry_after=5)
        if self.api_key is not None and not is_authorized(scope, self.api_key):
            return APIError(401, "Invalid or missing API key (send 'Authorization: Bearer KEY').",
                            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})
        length = _header(scope, b"content-length")
        if length is not None and length.isdigit() and int(length) > self.max_body_bytes:
            return self._too_large()
        return None

    def _too_large(self) -> APIError:
        return APIError(413, f"request body over the limit of {self.max_body_bytes} bytes (--max-body-size)",
                        code="request_too_large")

    def _limited(self, receive: Receive) -> Receive:
        """Count body bytes as they arrive (chunked bodies have no Content-Length)."""
        num_bytes = 0

        async def limited_receive() -> Message:
            nonlocal num_bytes
            message = await receive()
            if message["type"] == "http.request":
                num_bytes += len(message.get("body", b""))
                if num_bytes > self.max_body_bytes:
                    raise self._too_large()
            return message

        return limited_receive
