"""The prefill/decode router (`llmserve route --pd-disaggregation --prefill URL ... --decode URL ...`).

A generation request goes first to a prefill server (round robin) as a one-token, non-streamed copy
carrying `kv_transfer_params.decode_kv_address`, the KV receiver of the decode server chosen for it
(round robin; its port read once from the decode server's GET /kv_transfer). The prefill server computes
the prompt, sends its full KV blocks there and answers once they are acked; the router then forwards the
client's request unchanged to that decode server, which loads the blocks, computes the prompt's last
partial block and streams the rest; its bytes pass through untouched. A prefill server that fails (no
connection, 5xx, timeout) costs nothing but time: the decode server computes the whole prompt. A 4xx from
the prefill server is the client's error and is returned as is. Every call goes through the router's one
upstream client (router/upstream.py).

With `max_local_prefill_length` N > 0 (Dynamo's conditional disaggregation), a prompt of at most N tokens skips
the prefill server: the decode server computes it, as a colocated server would (a short prompt costs a decode
server little, and waiting behind long prompts at a prefill server would cost it its TTFT). The length is the
prompt's token ids when it is given as ids, else the decode server's `POST /tokenize` of it.

With `prefill_on_idle_decode`, a decode server with nothing in flight computes a prompt itself when every
prefill server already has one in flight: no stream decodes there to be stalled, and the prompt would only
queue behind another at a prefill server while that core idles (work conserving; the router counts what it
has in flight at each server).

With `max_local_prefill_length_if_busy` N, a prompt of at most N tokens is computed on the decode server when
every prefill server is computing a longer one: a chat's prompt does not wait behind a long prompt's chunks.
The three rules are router/pd_policy.py's, which the Ray Serve P/D ingress follows too.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from llmserve.router.fetch import fetch, fetch_json
from llmserve.router.pd_policy import PDLoad, PDPolicy, PrefillPlace, place_prefill, prompt_length_query
from llmserve.router.upstream import Header, Upstream, UpstreamError, UpstreamPool

logger = logging.getLogger("llmserve.router.pd")
GENERATION_PATHS = ("/v1/completions", "/v1/chat/completions")
_FORWARDED_HEADERS = frozenset({b"content-type", b"authorization", b"accept", b"x-request-id"})
_KEPT_HEADERS = frozenset({b"content-type", b"x-request-id"})  # of the decode server's response
CONNECT_TIMEOUT_S = 5.0
PROBE_TIMEOUT_S = 5.0
HEALTH_TIMEOUT_S = 2.0


@dataclass(frozen=True)
class PDConfig:
    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    prefill_timeout_s: float = 600.0
    upstream_timeout_s: float = 600.0
    policy: PDPolicy = PDPolicy()  # where a prompt is computed (router/pd_policy.py)

    def __post_init__(self) -> None:
        if not self.prefill_urls or not self.decode_urls:
            raise ValueError("--pd-disaggregation needs at least one --prefill URL and one --decode URL")
        for url in (*self.prefill_urls, *self.decode_urls):
            parts = urlsplit(url)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise ValueError(f"--prefill / --decode: {url!r} is not an http(s) URL")


@dataclass
class PDStats:
    num_requests: int = 0
    num_prefill_failures: int = 0  # requests the decode server computed whole
    num_local_prefills: int = 0  # prompts short enough for the decode server (max_local_prefill_length)
    num_idle_decode_prefills: int = 0  # prompts an idle decode server took from busy prefill servers
    num_local_beside_long_prefills: int = 0  # short prompts a decode server took beside long prefills
    prefill_by_url: dict[str, int] = field(default_factory=dict)
    decode_by_url: dict[str, int] = field(default_factory=dict)


def prefill_body(obj: dict, decode_kv_address: str) -> dict:
    """The prefill server's copy of a request: one token, not streamed, its KV sent to the decode server."""
    body = {**obj, "max_tokens": 1, "stream": False, "n": 1,
            "kv_transfer_params": {"decode_kv_address": decode_kv_address}}
    for name in ("stream_options", "max_completion_tokens", "best_of", "min_tokens"):  # all about the output
        body.pop(name, None)
    return body


class PDRouter:
    def __init__(self, config: PDConfig, upstream: Upstream | None = None) -> None:
        """Calls go through `upstream` (by default the connection pool of upstream.py); tests pass in-memory ones."""
        self.config = config
        self.upstream: Upstream = upstream or UpstreamPool(CONNECT_TIMEOUT_S, config.upstream_timeout_s)
        self.prefills = itertools.cycle(config.prefill_urls)
        self.decodes = itertools.cycle(config.decode_urls)
        self.kv_addresses: dict[str, str] = {}  # decode URL -> tcp://host:port of its KV receiver
        self.stats = PDStats()
        self.num_in_flight: dict[str, int] = {}  # server URL -> requests the router has sent it, not yet answered
        self.num_long_in_flight: dict[str, int] = {}  # prefill URL -> its long prompts in flight (PDPolicy.is_long)

    async def kv_address(self, decode_url: str) -> str:
        if decode_url not in self.kv_addresses:
            info = (await fetch(self.upstream, decode_url, "/kv_transfer", PROBE_TIMEOUT_S)).json()
            if info.get("disaggregation_mode") != "decode":
                raise ValueError(f"{decode_url} is not a decode server (--disaggregation-mode decode)")
            self.kv_addresses[decode_url] = f"tcp://{urlsplit(decode_url).hostname}:{info['kv_port']}"
        return self.kv_addresses[decode_url]

    async def prefill(self, path: str, obj: dict, headers: list[Header], decode_url: str,
                      is_long: bool = True) -> Response | None:
        """Run the prompt on a prefill server; its error response when it is the client's (4xx), else None
        (done, or failed: the decode server then computes the prompt itself)."""
        url = next(self.prefills)
        self.stats.prefill_by_url[url] = self.stats.prefill_by_url.get(url, 0) + 1
        self._count_in(url, 1)
        num_long = int(is_long)
        self.num_long_in_flight[url] = self.num_long_in_flight.get(url, 0) + num_long
        try:
            body = prefill_body(obj, await self.kv_address(decode_url))
            response = await fetch_json(self.upstream, url, path, self.config.prefill_timeout_s, body, headers)
        except (UpstreamError, ValueError, KeyError, AttributeError) as e:
            return self._prefill_failed(url, repr(e))
        finally:
            self._count_in(url, -1)
            self.num_long_in_flight[url] -= num_long
        if 400 <= response.status < 500:
            return Response(response.body, response.status, media_type="application/json")
        if response.status != 200:
            return self._prefill_failed(url, f"HTTP {response.status}")
        return None

    async def prompt_length(self, decode_url: str, obj: dict, headers: list[Header]) -> int | None:
        """The request's prompt length in tokens, when a rule needs it: counted when given as ids, else the
        decode server's `POST /tokenize` of it; None when unknown (a batch of prompts, a failed tokenizer call)."""
        if not self.config.policy.needs_prompt_length:
            return None
        query = prompt_length_query(obj)
        if query is None or isinstance(query, int):
            return query
        try:
            response = await fetch_json(self.upstream, decode_url, "/tokenize", PROBE_TIMEOUT_S, query, headers)
            return response.json()["count"] if response.status == 200 else None
        except (UpstreamError, ValueError, KeyError, TypeError):
            return None

    def load(self, decode_url: str) -> PDLoad:
        """What the router has in flight, for the policy (router/pd_policy.py)."""
        prefill_urls = self.config.prefill_urls
        return PDLoad(self.num_in_flight.get(decode_url, 0), len(prefill_urls),
                      sum(1 for url in prefill_urls if self.num_in_flight.get(url)),
                      sum(1 for url in prefill_urls if self.num_long_in_flight.get(url)))

    def _count_in(self, url: str, num: int) -> None:
        self.num_in_flight[url] = self.num_in_flight.get(url, 0) + num

    def _count_local(self, place: PrefillPlace) -> None:
        stats = self.stats
        if place is PrefillPlace.LOCAL_SHORT:
            stats.num_local_prefills += 1
        elif place is PrefillPlace.LOCAL_BESIDE_LONG:
            stats.num_local_beside_long_prefills += 1
        else:
            stats.num_idle_decode_prefills += 1

    def _prefill_failed(self, url: str, reason: str) -> None:
        self.stats.num_prefill_failures += 1
        logger.warning("prefill server %s failed (%s): the decode server computes the prompt", url, reason)
        return None

    async def generate(self, request: Request) -> Response:
        raw = await request.body()
        try:
            obj = json.loads(raw)
        except ValueError:
            return _error(400, "the body is not JSON")
        if not isinstance(obj, dict):
            return _error(400, "the body must be a JSON object")
        headers = [(k, v) for k, v in request.headers.raw if k.lower() in _FORWARDED_HEADERS]
        self.stats.num_requests += 1
        decode_url = next(self.decodes)
        self.stats.decode_by_url[decode_url] = self.stats.decode_by_url.get(decode_url, 0) + 1
        policy = self.config.policy
        prompt_length = await self.prompt_length(decode_url, obj, headers)
        place = place_prefill(policy, prompt_length, self.load(decode_url))
        if place.is_local:
            self._count_local(place)
            return await self._forward(decode_url, request.url.path, raw, headers)
        error = await self.prefill(request.url.path, obj, headers, decode_url, policy.is_long(prompt_length))
        if error is not None:
            return error
        return await self._forward(decode_url, request.url.path, raw, headers)

    async def _forward(self, url: str, path: str, body: bytes, headers: list[Header]) -> Response:
        """The decode server's response, its bytes passed through as they come (SSE included); a client that
        goes away closes the upstream connection, which aborts the request there."""
        self._count_in(url, 1)
        is_counted = True

        def count_out() -> None:  # once, whichever of the body's end and the background task comes first
            nonlocal is_counted
            if is_counted:
                is_counted = False
                self._count_in(url, -1)

        try:
            response = await self.upstream.send(url, path, body, headers)
        except UpstreamError as e:
            count_out()
            return _error(502, f"the decode server failed: {e!r}", "bad_gateway")

        async def body_parts():
            try:
                while part := await response.read():
                    yield part
            finally:
                count_out()
                await response.aclose()  # read to its end: back to the pool; cut short: closed

        async def close() -> None:
            count_out()
            await response.aclose()

        kept = {k.decode(): v.decode("latin-1") for k, v in response.headers if k in _KEPT_HEADERS}
        return StreamingResponse(body_parts(), response.status, headers=kept, background=BackgroundTask(close))

    async def get(self, request: Request) -> Response:
        """Read-only routes from a decode server (models, version)."""
        try:
            response = await fetch(self.upstream, next(self.decodes), request.url.path, self.config.upstream_timeout_s)
        except UpstreamError as e:
            return _error(502, f"the decode server failed: {e!r}", "bad_gateway")
        media_type = response.header(b"content-type")
        return Response(response.body, response.status, media_type=media_type and media_type.decode("latin-1"))

    async def health(self, request: Request) -> Response:
        """Healthy when some prefill and some decode server answer their /health."""
        async def is_up(url: str) -> bool:
            try:
                return (await fetch(self.upstream, url, "/health", HEALTH_TIMEOUT_S)).status == 200
            except UpstreamError:
                return False

        roles = {}
        for role, urls in (("prefill", self.config.prefill_urls), ("decode", self.config.decode_urls)):
            roles[role] = {url: await is_up(url) for url in urls}
        is_healthy = any(roles["prefill"].values()) and any(roles["decode"].values())
        return JSONResponse(roles, status_code=200 if is_healthy else 503)

    async def pd_stats(self, request: Request) -> Response:
        stats = self.stats
        return JSONResponse({"num_requests": stats.num_requests, "num_prefill_failures": stats.num_prefill_failures,
                             "num_local_prefills": stats.num_local_prefills,
                             "num_idle_decode_prefills": stats.num_idle_decode_prefills,
                             "num_local_beside_long_prefills": stats.num_local_beside_long_prefills,
                             "prefill": stats.prefill_by_url, "decode": stats.decode_by_url})


def _error(status: int, message: str, code: str = "invalid_request_error") -> Response:
    return JSONResponse({"error": {"message": message, "type": code, "param": None, "code": None}}, status)


def build_pd_app(router: PDRouter) -> Starlette:
    routes = [*(Route(path, router.generate, methods=["POST"]) for path in GENERATION_PATHS),
              Route("/v1/models", router.get, methods=["GET"]), Route("/version", router.get, methods=["GET"]),
              Route("/health", router.health, methods=["GET"]), Route("/pd_stats", router.pd_stats, methods=["GET"])]
    app = Starlette(routes=routes)
    app.state.router = router
    return app
