"""The ingress of `llmserve serve-ray --pd-disaggregation`: router/pd.py's two calls over Ray Serve handles.

For a completion or chat request it asks a decode replica (Ray's pick through our request router: the least
loaded) for its KV receiver's address, sends a prefill replica the request's one-token copy naming that
address (router/pd.prefill_body; the prefill replica answers once the prompt's blocks are at the decode
replica), then forwards the client's request to that same decode replica, pinned by its id; the decode
replica loads the blocks and streams the answer. Other requests go to the decode replicas.

A prefill replica that fails costs only time (the decode replica computes the whole prompt); its 4xx is the
client's error and goes back as it is. A decode replica that dies between the two calls is no longer a
candidate, so the pin falls through to another one, which computes the prompt itself. A client that leaves
during the prefill cancels it there.

Whether a prompt goes to a prefill replica at all is the P/D router's policy (router/pd_policy.py, the same
flags): the ingress counts what it has in flight at each decode replica and at the prefill replicas together
(Ray's router spreads prompts over the least loaded, so k prompts in flight busy min(k, replicas) of them), and
reads how many prefill replicas run from Ray's controller when they autoscale.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import time
from collections import Counter
from typing import TYPE_CHECKING

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from llmserve.rayserve.ingress import Ingress
from llmserve.rayserve.messages import ForwardedRequest, ResponseHead
from llmserve.router.pd import GENERATION_PATHS, prefill_body
from llmserve.router.pd_policy import PDLoad, place_prefill, prompt_length_query

if TYPE_CHECKING:
    from llmserve.rayserve.config import Deployment

logger = logging.getLogger("llmserve.rayserve")


def generation_body(request: ForwardedRequest) -> dict | None:
    """The JSON object of a completion or chat request; None for anything else (forwarded as it is: a body
    that is not JSON gets its 400 from the decode replica)."""
    if request.method != "POST" or request.path not in GENERATION_PATHS:
        return None
    try:
        body = json.loads(request.body)
    except ValueError:
        return None
    return body if isinstance(body, dict) else None


def prefill_request(request: ForwardedRequest, body: dict, decode_kv_address: str) -> ForwardedRequest:
    """The prefill replica's copy of `request`: its body router/pd.py's, its old content-length dropped."""
    raw = json.dumps(prefill_body(body, decode_kv_address)).encode()
    headers = tuple((k, v) for k, v in request.headers if k.lower() != b"content-length")
    return dataclasses.replace(request, body=raw, headers=(*headers, (b"content-length", str(len(raw)).encode())),
                               pinned_replica=None)


def tokenize_request(request: ForwardedRequest, query: dict) -> ForwardedRequest:
    """A `POST /tokenize` counting the request's prompt (router/pd_policy.prompt_length_query's body), with
    the request's credentials."""
    raw = json.dumps(query).encode()
    auth = tuple((k, v) for k, v in request.headers if k.lower() == b"authorization")
    headers = ((b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()), *auth)
    return ForwardedRequest("POST", "/tokenize", b"", headers, raw)


class ReplicaCount:
    """How many replicas of a deployment run: a fixed count, or (autoscaling) Ray controller's count read at
    most every `period_s` in a thread, the last one known meanwhile."""

    def __init__(self, deployment_name: str, num_fixed: int | None, num_min: int, period_s: float = 2.0) -> None:
        self.deployment_name, self.num_fixed, self.period_s = deployment_name, num_fixed, period_s
        self.num = num_fixed or num_min
        self.read_at = time.monotonic()
        self.reading: asyncio.Task | None = None

    def __call__(self) -> int:
        if self.num_fixed is None and self.reading is None and time.monotonic() - self.read_at >= self.period_s:
            self.reading = asyncio.get_running_loop().create_task(self._read())
        return self.num

    async def _read(self) -> None:
        try:
            self.num = max(1, await asyncio.to_thread(_num_running, self.deployment_name))
        except Exception as e:  # the controller busy or restarting: keep the last count
            logger.warning("reading %s's replica count failed: %r", self.deployment_name, e)
        finally:
            self.read_at, self.reading = time.monotonic(), None


def _num_running(deployment_name: str) -> int:
    from ray import serve

    app = serve.get_replica_context().app_name
    states = serve.status().applications[app].deployments[deployment_name].replica_states
    return sum(n for state, n in states.items() if state == "RUNNING")


class PDIngress(Ingress):
    def __init__(self, decodes, prefills, deployment: Deployment) -> None:
        """`decodes`, `prefills`: the two engine deployments' handles (Ray resolves the bound deployments)."""
        from llmserve.rayserve.app import PREFILL_DEPLOYMENT

        super().__init__(decodes, deployment)
        self.kv_addresses = decodes.options(method_name="kv_address")
        self.prefills = prefills.options(method_name="forward", stream=True)
        self.policy = self.config.pd_policy
        self.num_prefill_replicas = ReplicaCount(PREFILL_DEPLOYMENT, self.config.num_prefill_replicas,
                                                 self.config.prefill_min_replicas)
        self.num_decode_in_flight: Counter[str] = Counter()  # decode replica id -> requests sent, not ended
        self.num_prefills_in_flight = 0
        self.num_long_prefills_in_flight = 0  # of them, long prompts (PDPolicy.is_long)

    async def __call__(self, request: Request) -> Response:
        forwarded = await self.forwarded(request)
        body = generation_body(forwarded)
        if body is None:
            return await self.respond(forwarded)
        try:
            decode_replica, address = await self.kv_addresses.remote()
        except Exception as e:  # no decode replica answered: the forward fails or finds one itself
            logger.warning("%s: no decode replica gave its KV address (%r): no prefill replica", forwarded.path, e)
            return await self.respond(forwarded)
        prompt_length = await self.prompt_length(forwarded, body)
        place = place_prefill(self.policy, prompt_length, self.load(decode_replica))
        if not place.is_local:
            error = await self.prefill(forwarded, body, address, self.policy.is_long(prompt_length))
            if error is not None:
                return error
        forwarded = dataclasses.replace(forwarded, pinned_replica=decode_replica)
        return await self.respond_counted(forwarded, decode_replica)

    def load(self, decode_replica: str) -> PDLoad:
        num_prefill = self.num_prefill_replicas()
        return PDLoad(self.num_decode_in_flight[decode_replica], num_prefill,
                      min(self.num_prefills_in_flight, num_prefill), min(self.num_long_prefills_in_flight, num_prefill))

    async def prompt_length(self, request: ForwardedRequest, body: dict) -> int | None:
        """The prompt's length in tokens when a rule needs it (a decode replica's /tokenize of a text prompt);
        None when unknown."""
        if not self.policy.needs_prompt_length:
            return None
        query = prompt_length_query(body)
        if query is None or isinstance(query, int):
            return query
        try:
            head, answer = await _read_all(self.replicas.remote(tokenize_request(request, query)))
            return json.loads(answer)["count"] if head.status == 200 else None
        except asyncio.CancelledError:
            raise
        except Exception as e:
            logger.warning("%s: counting the prompt's tokens failed (%r)", request.path, e)
            return None

    async def respond_counted(self, forwarded: ForwardedRequest, decode_replica: str) -> Response:
        """`respond`, the request counted in flight at its decode replica until its response ends."""
        self.num_decode_in_flight[decode_replica] += 1
        is_counted = True

        def count_out() -> None:  # once, whichever of the body's end and the background task comes first
            nonlocal is_counted
            if is_counted:
                is_counted = False
                self.num_decode_in_flight[decode_replica] -= 1
                if not self.num_decode_in_flight[decode_replica]:
                    del self.num_decode_in_flight[decode_replica]

        try:
            response = await self.respond(forwarded)
        except BaseException:
            count_out()
            raise
        if not isinstance(response, StreamingResponse):
            count_out()
            return response
        body = response.body_iterator

        async def counted():
            try:
                async for chunk in body:
                    yield chunk
            finally:
                count_out()

        response.body_iterator = counted()
        response.background = BackgroundTask(count_out)
        return response

    async def prefill(self, request: ForwardedRequest, body: dict, address: str, is_long: bool) -> Response | None:
        """Run the prompt on a prefill replica, its blocks sent to `address`: its answer when it is the
        client's error, else None. Failures are logged and cost the decode replica its own prefill."""
        self.num_prefills_in_flight += 1
        self.num_long_prefills_in_flight += is_long
        try:
            return await self._prefill(request, body, address)
        finally:
            self.num_prefills_in_flight -= 1
            self.num_long_prefills_in_flight -= is_long

    async def _prefill(self, request: ForwardedRequest, body: dict, address: str) -> Response | None:
        stream = self.prefills.remote(prefill_request(request, body, address))
        try:
            head, answer = await _read_all(stream)
        except asyncio.CancelledError:  # the client left: stop the prefill too
            stream.cancel()
            raise
        except Exception as e:
            logger.warning("%s: the prefill replica failed (%r): the decode replica computes the prompt",
                           request.path, e)
            return None
        if 400 <= head.status < 500:
            return Response(answer, head.status, media_type="application/json")
        if head.status != 200:
            logger.warning("%s: the prefill replica answered HTTP %d: the decode replica computes the prompt",
                           request.path, head.status)
        return None


async def _read_all(stream) -> tuple[ResponseHead, bytes]:
    """A replica's whole (non-streamed) answer: its head and body."""
    head = await stream.__anext__()
    chunks = [head.body]
    async for chunk in stream:
        chunks.append(chunk)
    return head, b"".join(chunks)
