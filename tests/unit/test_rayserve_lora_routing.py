"""Ray Serve's request router sends a LoRA adapter's requests only to the replicas that serve it (as their
routing stats say), those holding it in a slot first, choosing among those by prefix and load; the base
model's requests go anywhere. No Ray cluster: the router is driven with stand-in replicas."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("ray.serve")

from llmserve.rayserve.messages import ForwardedRequest  # noqa: E402
from llmserve.rayserve.request_router import PrefixAwareRequestRouter  # noqa: E402


def _replica(name: str, adapters: list[str] | None, resident: tuple[str, ...] = ()):
    stats = {} if adapters is None else {"adapters": adapters, "resident": list(resident)}
    return SimpleNamespace(replica_id=SimpleNamespace(unique_id=name), routing_stats=stats)


def _router(loads: dict[str, int]) -> PrefixAwareRequestRouter:
    router = object.__new__(PrefixAwareRequestRouter)  # Ray's constructor needs a running deployment
    router._replica_queue_len_cache = SimpleNamespace(get=lambda replica_id: loads[replica_id.unique_id])
    router.initialize_state()
    return router


def _ranks(router, replicas, model: str, prefix: bytes = b"") -> list[list[str]]:
    request = SimpleNamespace(args=[ForwardedRequest("POST", "/v1/completions", b"", (), b"{}", prefix, None, model)])
    ranks = asyncio.run(router.choose_replicas(replicas, request))
    return [[r.replica_id.unique_id for r in rank] for rank in ranks]


REPLICAS = [_replica("a", []), _replica("b", ["sql"]), _replica("c", ["sql", "chat"]), _replica("d", None)]


def test_an_adapters_request_goes_to_the_replicas_serving_it_least_loaded_first():
    router = _router({"a": 0, "b": 5, "c": 2, "d": 0})
    assert _ranks(router, REPLICAS, "sql") == [["c", "b"]]
    assert _ranks(router, REPLICAS, "chat") == [["c"]]


def test_with_a_prefix_the_policy_picks_among_the_serving_replicas_only():
    router = _router({"a": 0, "b": 0, "c": 0, "d": 0})
    for i in range(20):
        ranks = _ranks(router, REPLICAS, "sql", prefix=f"prompt {i}".encode())
        assert sorted(name for rank in ranks for name in rank) == ["b", "c"]


def test_the_base_model_or_an_adapter_no_replica_reports_goes_anywhere():
    router = _router({"a": 3, "b": 1, "c": 2, "d": 0})
    assert _ranks(router, REPLICAS, "tiny") == [["d", "b", "c", "a"]]
    assert _ranks(router, REPLICAS, "") == [["d", "b", "c", "a"]]


def test_replicas_holding_the_adapter_in_a_slot_come_first():
    replicas = [_replica("a", ["sql"]), _replica("b", ["sql"], resident=("sql",)), _replica("c", [])]
    router = _router({"a": 0, "b": 4, "c": 0})
    assert _ranks(router, replicas, "sql") == [["b"], ["a"]]
    for i in range(10):  # with a prefix too: the holder is picked, the other serving replica next
        assert _ranks(router, replicas, "sql", prefix=f"p{i}".encode()) == [["b"], ["a"]]
