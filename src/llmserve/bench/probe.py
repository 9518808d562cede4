"""Before a run: reach the server, find its model, and settle which optional fields it accepts.

The probe sends one short request. A 4xx answer is retried without `ignore_eos`, then without
`stream_options` (servers that follow the OpenAI schema strictly reject unknown fields); anything else
that fails becomes a ValueError that says what is wrong: unreachable server, wrong endpoint, wrong model.
"""

from __future__ import annotations

from dataclasses import replace

import aiohttp
import msgspec

from llmserve.bench.client import RequestRecord, Target, send_request
from llmserve.bench.config import ENDPOINT_PATHS
from llmserve.bench.datasets import BenchRequest

PROBE_OUTPUT_LEN = 4
MODELS_TIMEOUT_S = 10.0


async def list_models(client: aiohttp.ClientSession, url: str) -> tuple[int, list[str]]:
    """(HTTP status, ids) of GET /v1/models; ValueError if the server cannot be reached."""
    try:
        async with client.get(url + "/v1/models", timeout=aiohttp.ClientTimeout(total=MODELS_TIMEOUT_S)) as response:
            status, body = response.status, await response.read()
    except (aiohttp.ClientError, TimeoutError) as e:
        raise ValueError(f"cannot reach the server at {url} ({type(e).__name__}: {e}); is it running?") from None
    try:
        data = msgspec.json.decode(body).get("data", []) if status == 200 else []
        return status, [str(m["id"]) for m in data if isinstance(m, dict) and "id" in m]
    except (msgspec.DecodeError, AttributeError, TypeError):
        return status, []


async def connect(client: aiohttp.ClientSession, base: Target, sample: BenchRequest) -> tuple[Target, list[str]]:
    """The target with its model filled in and the optional fields it accepts; and notes for the user."""
    status, served = await list_models(client, base.url)
    if not base.model:
        if not served:
            raise ValueError(f"GET {base.url}/v1/models answered {status} without a model: is {base.url} the "
                             "server's base URL (like http://host:8000)? Else name the model with --model")
        base = replace(base, model=served[0])
    return await negotiate(client, base, sample, served)


async def negotiate(client: aiohttp.ClientSession, base: Target, sample: BenchRequest,
                    served: list[str]) -> tuple[Target, list[str]]:
    probe = replace(sample, output_len=min(sample.output_len, PROBE_OUTPUT_LEN))
    first_failure: RequestRecord | None = None
    for target in _variants(base):
        rec = await send_request(client, target, probe, -1)
        if rec.is_success:
            return target, _notes(base, target, rec)
        first_failure = first_failure or rec
        if not (rec.error_kind or "").startswith("http_4"):
            break
    assert first_failure is not None
    raise ValueError(diagnose(base, first_failure, served, sample))


def _variants(base: Target) -> list[Target]:
    variants = [base]
    if base.is_ignore_eos_sent:
        variants.append(replace(variants[-1], is_ignore_eos_sent=False))
    if base.is_streaming and base.is_usage_requested:
        variants.append(replace(variants[-1], is_usage_requested=False))
    return variants


def _notes(base: Target, target: Target, rec: RequestRecord) -> list[str]:
    notes = []
    if base.is_ignore_eos_sent and not target.is_ignore_eos_sent:
        notes.append(f"{target.label}: the server rejects ignore_eos; outputs may stop before max_tokens")
    if base.is_usage_requested and not target.is_usage_requested and target.is_streaming:
        notes.append(f"{target.label}: the server rejects stream_options; output tokens are counted from chunks")
    if rec.output_tokens_source == "usage" and rec.num_output_tokens < rec.output_len and target.is_ignore_eos_sent:
        notes.append(f"{target.label}: asked for {rec.output_len} tokens with ignore_eos, got {rec.num_output_tokens}")
    return notes


def diagnose(target: Target, rec: RequestRecord, served: list[str], sample: BenchRequest) -> str:
    """A message that says what is likely wrong, from the failed probe."""
    where = f"{target.label}: POST {target.api_url}"
    kind = rec.error_kind or ""
    if kind == "connection":
        return f"{where} failed: {rec.error}; is the server running?"
    if kind == "timeout":
        return f"{where}: no answer within {target.timeout_s:g} s (raise --timeout if the server is just slow)"
    hints = _model_hint(target.model, served)
    if kind == "http_404" and not hints:
        other = "chat" if target.endpoint == "completions" else "completions"
        hints.append(f"Does the server serve {ENDPOINT_PATHS[target.endpoint]}? (try --endpoint {other})")
    if kind in ("http_400", "http_422") and not hints and isinstance(sample.prompt, list):
        hints.append("If the server does not take token-id prompts, use --tokenizer DIR (text prompts).")
    if kind in ("http_400", "http_422") and target.json_schema is not None:
        field = "response_format" if target.endpoint == "chat" else "structured_outputs"
        hints.append(f"Does the server take the schema of --json-schema (sent as {field})?")
    if kind == "protocol":
        hints.append(f"The answer is not an OpenAI {target.endpoint} response.")
    return " ".join([f"{where} failed: {rec.error}."] + hints)


def _model_hint(model: str, served: list[str]) -> list[str]:
    if served and not set(model.split(",")) <= set(served):
        return [f"Model {model!r} is not among the served models {served}; pass --model NAME."]
    return []
