"""Our prefix-aware policy (router/policies.PrefixAware: bounded-load consistent hashing of the prompt's
leading blocks) as a Ray Serve request router, so that requests sharing a prefix reach the replica whose
prefix cache holds it.

Ray calls `choose_replicas` in the caller's process (here: the ingress, through its DeploymentHandle) and
then sends the request to the least-loaded replica of the first rank that has room (fewer than
max_ongoing_requests); the next ranks are tried when the first has none. We answer two ranks: the policy's
pick, then the other replicas, least loaded first. A replica's load is Ray's count of the requests this
handle has open on it (its queue-length cache). A request without a prefix goes to the least loaded.

A request naming a LoRA adapter goes only to the replicas that serve it (their routing stats: replica.py's
`record_routing_stats`, every few seconds), the policy choosing first among those holding it in a slot (no
swap), then the other replicas serving it; when no replica reports it (stats not in yet), among all, whose
answer for an adapter it lacks is a 404.
"""

from __future__ import annotations

from ray.serve.request_router import PendingRequest, RequestRouter, RunningReplica

from llmserve.rayserve.messages import ForwardedRequest
from llmserve.router.policies import BackendLoad, PrefixAware, RouteRequest


class PrefixAwareRequestRouter(RequestRouter):
    def initialize_state(self, load_factor: float = 1.0) -> None:
        """Ray passes `request_router_kwargs` here."""
        self.policy = PrefixAware(epsilon=load_factor)

    def load_of(self, replica: RunningReplica) -> int:
        return self.replica_queue_len_cache.get(replica.replica_id) or 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica],
                              pending_request: PendingRequest | None = None) -> list[list[RunningReplica]]:
        if not candidate_replicas:
            return []
        request = _forwarded(pending_request)
        pinned = [r for r in candidate_replicas if request is not None and r.replica_id.unique_id ==
                  request.pinned_replica]
        if pinned:
            return [pinned]
        serving = candidate_replicas if request is None or not request.model else \
            with_adapter(candidate_replicas, request.model, "adapters")
        preferred = serving if request is None or not request.model else \
            with_adapter(serving, request.model, "resident")
        by_load = sorted(serving, key=self.load_of)
        if request is None or not request.prefix:
            return _ranks(sorted(preferred, key=self.load_of), by_load)
        loads = [BackendLoad(r.replica_id.unique_id, num_in_flight=self.load_of(r)) for r in preferred]
        name = self.policy.choose(RouteRequest(model="", prefix=request.prefix), loads)
        picked = next(r for r in preferred if r.replica_id.unique_id == name)
        return [[picked], [r for r in by_load if r is not picked]]


def with_adapter(replicas: list[RunningReplica], model: str, key: str) -> list[RunningReplica]:
    """The replicas whose routing stats list `model` under `key` ("adapters": served, "resident": in a slot);
    all of them when none does (the base model's name, or stats not in yet)."""
    having = [r for r in replicas if model in ((r.routing_stats or {}).get(key) or ())]
    return having or replicas


def _ranks(first: list[RunningReplica], rest: list[RunningReplica]) -> list[list[RunningReplica]]:
    """`first`, then the replicas of `rest` not in it (one rank when none is left)."""
    others = [r for r in rest if r not in first]
    return [first, others] if others else [first]


def _forwarded(pending_request: PendingRequest | None) -> ForwardedRequest | None:
    if pending_request is None or not pending_request.args:
        return None
    first = pending_request.args[0]
    return first if isinstance(first, ForwardedRequest) else None
