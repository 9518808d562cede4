"""Routing policies on scripted load (pure: no processes, no network)."""

from collections import Counter

import pytest

from llmserve.router.hashring import HashRing, load_cap
from llmserve.router.policies import (POLICY_NAMES, BackendLoad, LeastLoad, PrefixAware, RoundRobin, RouteRequest,
                                      SessionAffinity, make_policy)

NAMES = ["http://a", "http://b", "http://c"]


def loads(in_flight=(0, 0, 0), waiting=(0, 0, 0), kv=(0.0, 0.0, 0.0), names=NAMES):
    return [BackendLoad(n, i, w, 0, k) for n, i, w, k in zip(names, in_flight, waiting, kv)]


def req(prefix=b"", user=None):
    return RouteRequest("m", prefix=prefix, user=user)


def test_round_robin_cycles_in_order():
    policy = RoundRobin()
    assert [policy.choose(req(), loads()) for _ in range(7)] == NAMES * 2 + NAMES[:1]


def test_round_robin_over_a_shrunk_set_still_spreads():
    policy = RoundRobin()
    picks = [policy.choose(req(), loads()[:2]) for _ in range(4)]
    assert Counter(picks) == {"http://a": 2, "http://b": 2}


def test_least_load_picks_fewest_in_flight():
    assert LeastLoad().choose(req(), loads(in_flight=(3, 1, 2))) == "http://b"


def test_least_load_counts_scraped_waiting_and_kv():
    # b has fewer in flight, but a long scheduler queue; c has a full KV cache.
    candidates = loads(in_flight=(2, 1, 1), waiting=(0, 5, 0), kv=(0.1, 0.0, 0.95))
    assert LeastLoad().choose(req(), candidates) == "http://a"  # scores 2.2, 6.0, 2.9


def test_least_load_rotates_among_ties():
    policy = LeastLoad()
    assert set(policy.choose(req(), loads()) for _ in range(6)) == set(NAMES)


def test_hash_ring_is_stable_and_moves_few_keys_when_a_backend_leaves():
    ring, smaller = HashRing(NAMES), HashRing(NAMES[:2])
    keys = [f"prefix-{i}".encode() for i in range(600)]
    assert [ring.lookup(k) for k in keys] == [HashRing(list(reversed(NAMES))).lookup(k) for k in keys]
    moved = [k for k in keys if ring.lookup(k) != "http://c" and ring.lookup(k) != smaller.lookup(k)]
    assert moved == []  # only the keys of the removed backend move
    assert min(Counter(ring.lookup(k) for k in keys).values()) > 120  # each of 3 gets a fair share


def test_prefix_aware_same_prefix_same_backend_while_under_cap():
    policy = PrefixAware(epsilon=0.25)
    picks = {policy.choose(req(b"system prompt A"), loads(in_flight=(1, 1, 1))) for _ in range(10)}
    assert len(picks) == 1
    other = {policy.choose(req(f"prompt {i}".encode()), loads()) for i in range(50)}
    assert other == set(NAMES)  # different prefixes spread


def test_prefix_aware_bounded_load_when_one_prefix_dominates():
    """Place 60 requests of one prefix one by one (none finish): no backend exceeds (1+eps) x its share."""
    policy, eps = PrefixAware(epsilon=0.25), 0.25
    in_flight = dict.fromkeys(NAMES, 0)
    for _ in range(60):
        total = sum(in_flight.values())
        name = policy.choose(req(b"hot prefix"), [BackendLoad(n, c) for n, c in in_flight.items()])
        assert in_flight[name] + 1 <= load_cap(total, 3, eps)
        in_flight[name] += 1
    assert max(in_flight.values()) <= 25  # ceil(1.25 x 60 / 3): nobody above (1 + eps) x the fair share of 20
    assert min(in_flight.values()) > 0  # the overflow spread to every backend
    home = HashRing(NAMES).lookup(b"hot prefix")
    assert in_flight[home] == max(in_flight.values())  # the prefix's home keeps the largest share


def test_prefix_aware_without_prefix_falls_back_to_least_load():
    assert PrefixAware().choose(req(), loads(in_flight=(5, 0, 5))) == "http://b"


def test_session_affinity_sticks_to_user_and_ignores_load():
    policy = SessionAffinity()
    first = policy.choose(req(user="alice"), loads())
    assert all(policy.choose(req(user="alice"), loads(in_flight=(9, 9, 9))) == first for _ in range(5))
    users = {policy.choose(req(user=f"user{i}"), loads()) for i in range(40)}
    assert users == set(NAMES)
    assert policy.choose(req(), loads(in_flight=(4, 4, 0))) == "http://c"  # no user: least-load


def test_registry_and_bad_names():
    assert {make_policy(name).name for name in POLICY_NAMES} == set(POLICY_NAMES)
    with pytest.raises(ValueError, match="unknown routing policy"):
        make_policy("random")
    with pytest.raises(ValueError):
        PrefixAware(epsilon=-1)


def test_prefix_aware_balances_prefixes_and_keeps_owners():
    """Plain hashing of 16 prefixes onto 2 backends is often lopsided (12/4); placement is bounded to 8/8."""
    policy, two = PrefixAware(), loads()[:2]
    owners = {i: policy.choose(req(f"system prompt {i}".encode()), two) for i in range(16)}
    assert Counter(owners.values()) == {"http://a": 8, "http://b": 8}
    assert all(policy.choose(req(f"system prompt {i}".encode()), two) == owners[i] for i in range(16))
    # The owner of a prefix leaves: its prefixes move, the others stay.
    moved = {i: policy.choose(req(f"system prompt {i}".encode()), loads()[1:]) for i in range(16)}
    assert all(moved[i] == owners[i] for i in range(16) if owners[i] == "http://b")
    assert sum(1 for i in range(16) if owners[i] == "http://a" and moved[i] == "http://c") >= 3


def test_prefix_aware_forgets_least_recently_used_prefixes():
    policy = PrefixAware(max_prefixes=4)
    for i in range(10):
        policy.choose(req(f"p{i}".encode()), loads())
    assert list(policy.owners) == [b"p6", b"p7", b"p8", b"p9"] and sum(policy.num_owned.values()) == 4
