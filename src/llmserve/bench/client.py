"""One benchmark request against an OpenAI-compatible server, timed chunk by chunk (async, aiohttp).

aiohttp rather than httpx: at 256 streams httpx's connection pool scans every connection on each event, and
the client process, not the server, capped `bench serve` at one core (docs/benchmarks.md, "H200, sixth run").

Timing follows vLLM's `bench serve`: the clock starts just before the request is sent; TTFT is the first
chunk that carries text, ITL the gap between successive such chunks, E2E the last one (or the whole body
when not streaming). Output tokens come from the server's `usage` when it gives one, else the chunk count.
"""

from __future__ import annotations

import asyncio
import time
import zlib
from dataclasses import dataclass, field

import aiohttp
import msgspec

from llmserve.bench.config import ENDPOINT_PATHS
from llmserve.bench.datasets import BenchRequest
from llmserve.bench.sse import Chunk, ProtocolError, SSEDecoder, parse_chunk

ERROR_KINDS = ("http_<status>", "timeout", "connection", "protocol", "stream_error")
_MAX_ERROR_CHARS = 500
SCHEMA_NAME = "bench_schema"  # response_format.json_schema.name (required by OpenAI)
MAX_STALE_RETRIES = 1  # sends again after a kept-alive connection closed unanswered (`_send`)


@dataclass(frozen=True)
class Target:
    """A server, as the benchmark talks to it (after the probe has settled what it accepts)."""

    label: str
    url: str  # base URL, no /v1
    model: str
    endpoint: str = "completions"
    is_streaming: bool = True
    is_ignore_eos_sent: bool = True
    is_usage_requested: bool = True  # stream_options.include_usage
    extra_body: dict = field(default_factory=dict)
    timeout_s: float = 300.0
    json_schema: dict | None = None  # every request asks for JSON that follows it

    @property
    def api_url(self) -> str:
        return self.url + ENDPOINT_PATHS[self.endpoint]

    def model_for(self, req: BenchRequest) -> str:
        """The model a request names: one of --model's comma-separated names (e.g. LoRA adapters), picked by
        a hash of its prompt (random across requests, the same request the same on every run)."""
        models = self.model.split(",")
        return models[zlib.crc32(repr(req.prompt).encode()) % len(models)] if len(models) > 1 else self.model


@dataclass
class RequestRecord:
    """What happened to one request. Times in seconds; `start_s` from the start of its load level."""

    index: int  # position in the level's request list (the same request on every server)
    prompt_len: int  # the dataset's count
    output_len: int  # max_tokens asked for
    is_success: bool = False
    start_s: float = 0.0
    queue_s: float = 0.0  # waiting for a concurrency slot in the client (open loop with a cap)
    ttft_s: float | None = None
    e2e_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    num_prompt_tokens: int = 0  # the server's usage.prompt_tokens, else prompt_len
    num_output_tokens: int = 0
    output_tokens_source: str = ""  # usage | chunks | requested (non-streamed answer without usage)
    num_chunks: int = 0  # chunks that carried text
    has_response: bool = False  # the server's status line arrived
    num_retries: int = 0  # sent again after the server closed a kept-alive connection without answering
    error_kind: str | None = None  # one of ERROR_KINDS (http_<status> with the status filled in)
    error: str | None = None


class HTTPStatusError(Exception):
    def __init__(self, status: int, body: str):
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


class StreamError(Exception):
    """The server sent an error object in place of a chunk."""


def build_payload(target: Target, req: BenchRequest) -> dict:
    body: dict = {"model": target.model_for(req), "max_tokens": req.output_len, "stream": target.is_streaming}
    if target.endpoint == "completions":
        body["prompt"] = req.prompt
    else:
        system = [{"role": "system", "content": req.system}] if req.system else []
        body["messages"] = system + [{"role": "user", "content": req.prompt}]
    if target.is_streaming and target.is_usage_requested:
        body["stream_options"] = {"include_usage": True}
    if target.is_ignore_eos_sent:
        body["ignore_eos"] = True
    if target.json_schema is not None:
        body.update(schema_fields(target.endpoint, target.json_schema))
    body.update(target.extra_body)
    return body


def schema_fields(endpoint: str, schema: dict) -> dict:
    """The request field that asks for JSON following `schema`: OpenAI's response_format on chat (the form
    every chat server takes), vLLM's structured_outputs on completions (OpenAI's has no response_format)."""
    if endpoint == "chat":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": SCHEMA_NAME, "schema": schema}}}
    return {"structured_outputs": {"json": schema}}


def make_http_client() -> aiohttp.ClientSession:
    """No client-side timeouts (send_request enforces one per request); connections kept alive, no cap on them
    (the load shape caps the requests in flight)."""
    connector = aiohttp.TCPConnector(limit=0, limit_per_host=0)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None))


async def send_request(client: aiohttp.ClientSession, target: Target, req: BenchRequest,
                       index: int) -> RequestRecord:
    """Send one request and time it; failures are recorded in the result, never raised."""
    rec = RequestRecord(index, req.prompt_len, req.output_len, num_prompt_tokens=req.prompt_len)
    rec.start_s = time.perf_counter()
    try:
        async with asyncio.timeout(target.timeout_s):
            await _send(client, target, build_payload(target, req), rec)
        rec.is_success = True
    except TimeoutError:
        _fail(rec, "timeout", f"no complete answer within {target.timeout_s:g} s")
    except HTTPStatusError as e:
        _fail(rec, f"http_{e.status}", str(e))
    except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError) as e:
        _fail(rec, "connection", f"{type(e).__name__}: {e}")
    except (ProtocolError, aiohttp.ClientError) as e:
        _fail(rec, "protocol", str(e))
    except StreamError as e:
        _fail(rec, "stream_error", str(e))
    return rec


def _fail(rec: RequestRecord, kind: str, message: str) -> None:
    rec.is_success = False
    rec.error_kind = kind
    rec.error = message[:_MAX_ERROR_CHARS]


async def _send(client: aiohttp.ClientSession, target: Target, body: dict, rec: RequestRecord) -> None:
    """The exchange, sent once more on a new connection when the server closed the kept-alive one it went out
    on without answering (HTTP keep-alive's race: llama-server closes connections idle for 5 s, which a
    --compare run leaves idle while the other server answers, and closes many right after a streamed answer while
    its headers said keep-alive); the clock restarts with the second send."""
    try:
        await _exchange(client, target, body, rec)
    except (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError) as e:
        # the close seen as the request went out (a failed write) or after it; a refused new connection is no race
        if isinstance(e, aiohttp.ClientConnectorError) or rec.has_response or rec.num_retries >= MAX_STALE_RETRIES:
            raise
        rec.num_retries += 1
        rec.start_s = time.perf_counter()
        await _exchange(client, target, body, rec)


_JSON_HEADERS = {"Content-Type": "application/json"}


async def _exchange(client: aiohttp.ClientSession, target: Target, body: dict, rec: RequestRecord) -> None:
    async with client.post(target.api_url, data=msgspec.json.encode(body), headers=_JSON_HEADERS) as response:
        rec.has_response = True
        if response.status != 200:
            text = (await response.read()).decode(errors="replace")
            raise HTTPStatusError(response.status, text[:_MAX_ERROR_CHARS])
        if target.is_streaming:
            await _read_stream(response, rec)
        else:
            _on_body(await response.read(), rec, time.perf_counter())


async def _read_stream(response: aiohttp.ClientResponse, rec: RequestRecord) -> None:
    decoder = SSEDecoder()
    usage_tokens: int | None = None
    async for raw in response.content.iter_any():
        now = time.perf_counter()
        for data in decoder.feed(raw):
            usage_tokens = _on_event(data, rec, now, usage_tokens)
    for data in decoder.close():
        usage_tokens = _on_event(data, rec, time.perf_counter(), usage_tokens)
    if rec.num_chunks == 0:
        raise ProtocolError("the stream ended without a chunk of generated text")
    _set_output_tokens(rec, usage_tokens, rec.num_chunks, "chunks")


def _on_event(data: str, rec: RequestRecord, now: float, usage_tokens: int | None) -> int | None:
    """Apply one event; returns the usage's completion tokens seen so far."""
    if data.strip() == "[DONE]":
        return usage_tokens
    chunk = parse_chunk(data)
    if chunk.error is not None:
        raise StreamError(chunk.error)
    if chunk.text:
        _on_text(rec, now)
    return _apply_usage(rec, chunk, usage_tokens)


def _on_text(rec: RequestRecord, now: float) -> None:
    elapsed = now - rec.start_s
    if rec.num_chunks == 0:
        rec.ttft_s = elapsed
    else:
        assert rec.e2e_s is not None
        rec.itl_s.append(elapsed - rec.e2e_s)
    rec.e2e_s = elapsed
    rec.num_chunks += 1


def _apply_usage(rec: RequestRecord, chunk: Chunk, usage_tokens: int | None) -> int | None:
    if chunk.usage is None:
        return usage_tokens
    if chunk.usage.num_prompt_tokens is not None:
        rec.num_prompt_tokens = chunk.usage.num_prompt_tokens
    return chunk.usage.num_completion_tokens if chunk.usage.num_completion_tokens is not None else usage_tokens


def _on_body(body: bytes, rec: RequestRecord, now: float) -> None:
    chunk = parse_chunk(body)
    if chunk.error is not None:
        raise StreamError(chunk.error)
    rec.e2e_s = now - rec.start_s
    usage_tokens = _apply_usage(rec, chunk, None)
    _set_output_tokens(rec, usage_tokens, rec.output_len, "requested")


def _set_output_tokens(rec: RequestRecord, usage_tokens: int | None, fallback: int, fallback_source: str) -> None:
    if usage_tokens is not None:
        rec.num_output_tokens, rec.output_tokens_source = usage_tokens, "usage"
    else:
        rec.num_output_tokens, rec.output_tokens_source = fallback, fallback_source
