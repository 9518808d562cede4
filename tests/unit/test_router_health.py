"""The backend health state machine, the token bucket and the autoscaler's decisions (pure, scripted clocks)."""

import pytest

from llmserve.router.autoscaler import AutoscalePolicy, Autoscaler, LoadSample, ScaleAction
from llmserve.router.health import BackendHealth, HealthState
from llmserve.router.ratelimit import RateLimit, RateLimiter, TokenBucket, retry_after_header


def test_eject_after_k_consecutive_failures_only():
    h = BackendHealth(failure_threshold=3, cooldown_s=5.0)
    assert not h.record_failure(0.0) and not h.record_failure(0.1)
    h.record_success()  # resets the count
    assert not h.record_failure(0.2) and not h.record_failure(0.3)
    assert h.is_routable(0.3)
    assert h.record_failure(0.4)
    assert h.state is HealthState.EJECTED and h.num_ejections == 1
    assert not h.is_routable(1.0) and not h.should_probe(1.0)


def test_half_open_after_cooldown_one_trial_then_recover():
    h = BackendHealth(failure_threshold=1, cooldown_s=5.0)
    h.record_failure(10.0)
    assert not h.is_routable(14.9)
    assert h.is_routable(15.0) and h.state is HealthState.HALF_OPEN
    h.on_dispatch()  # the one trial request
    assert not h.is_routable(15.1)
    h.record_success()
    assert h.state is HealthState.HEALTHY and h.is_routable(15.2)


def test_half_open_failure_ejects_again_with_fresh_cooldown():
    h = BackendHealth(failure_threshold=3, cooldown_s=2.0)
    for t in (0.0, 0.1, 0.2):
        h.record_failure(t)
    assert h.refresh(2.2) is HealthState.HALF_OPEN
    assert h.record_failure(2.3)  # a single failure in half-open is enough
    assert h.state is HealthState.EJECTED and h.num_ejections == 2
    assert not h.is_routable(4.2) and h.is_routable(4.3)


def test_starting_backend_waits_for_first_success():
    h = BackendHealth(failure_threshold=1, cooldown_s=1.0, state=HealthState.STARTING)
    assert not h.is_routable(0.0) and h.should_probe(0.0)
    assert not h.record_failure(0.5)  # a replica still loading is not ejected
    h.record_success()
    assert h.state is HealthState.HEALTHY


def test_token_bucket_burst_refill_and_wait():
    bucket = TokenBucket.full(RateLimit(rate=2.0, burst=3), now=0.0)
    assert [bucket.try_take(0.0) for _ in range(4)] == [True, True, True, False]
    assert bucket.seconds_until(0.0) == pytest.approx(0.5)
    assert bucket.try_take(0.5) and not bucket.try_take(0.5)
    assert bucket.try_take(100.0) and bucket.num_tokens == pytest.approx(2.0)  # capped at the burst


def test_rate_limiter_per_key():
    limiter = RateLimiter(RateLimit(1.0, 1), {"vip": RateLimit(100.0, 10)})
    assert limiter.check("a", 0.0) is None
    assert limiter.check("a", 0.0) == pytest.approx(1.0)
    assert limiter.check("b", 0.0) is None  # another key has its own bucket
    assert all(limiter.check("vip", 0.0) is None for _ in range(10))
    assert retry_after_header(0.2) == "1" and retry_after_header(2.1) == "3"
    assert RateLimiter(None).check("x", 0.0) is None


def test_rate_limiter_memory_is_bounded():
    limiter = RateLimiter(RateLimit(1000.0, 1), max_keys=10)
    for i in range(100):
        limiter.check(f"k{i}", float(i))
    assert len(limiter.buckets) <= 10


def run(scaler, series, num_replicas=1, step=1.0):
    """Feed (waiting, in_flight) samples one second apart, applying the decisions to the replica count."""
    actions = []
    for i, (waiting, in_flight) in enumerate(series):
        action = scaler.observe(LoadSample(i * step, num_replicas, waiting, in_flight))
        num_replicas += action.value
        actions.append(action)
    return actions, num_replicas


def test_autoscaler_scales_up_after_sustained_queue_and_down_when_idle():
    scaler = Autoscaler(AutoscalePolicy(1, 3, target_waiting_per_replica=2, scale_up_window_s=3,
                                        scale_down_idle_s=4, cooldown_s=2))
    burst = [(10, 8)] * 10
    idle = [(0, 0)] * 12
    actions, n = run(scaler, burst + idle)
    ups = [i for i, a in enumerate(actions) if a is ScaleAction.UP]
    downs = [i for i, a in enumerate(actions) if a is ScaleAction.DOWN]
    assert ups == [3, 7]  # 3 s over target; then the window starts again (cool-down 2 s is within it)
    assert n == 1 and downs == [14, 19]


def test_autoscaler_ignores_short_spikes_and_respects_bounds():
    policy = AutoscalePolicy(1, 2, target_waiting_per_replica=2, scale_up_window_s=3, scale_down_idle_s=2,
                             cooldown_s=0)
    actions, n = run(Autoscaler(policy), [(10, 5), (10, 5), (0, 5), (10, 5), (10, 5), (0, 1)])
    assert set(actions) == {ScaleAction.NONE} and n == 1
    actions, n = run(Autoscaler(policy), [(50, 5)] * 20)
    assert n == 2  # capped at max_replicas
    actions, n = run(Autoscaler(policy), [(0, 0)] * 20)
    assert n == 1  # never below min_replicas


def test_autoscaler_waiting_is_per_replica_and_min_is_enforced():
    policy = AutoscalePolicy(2, 4, target_waiting_per_replica=4, scale_up_window_s=1, scale_down_idle_s=100,
                             cooldown_s=0)
    scaler = Autoscaler(policy)
    assert scaler.observe(LoadSample(0.0, 0, 0, 0)) is ScaleAction.UP  # below min: at once
    assert run(Autoscaler(policy), [(7, 7)] * 5, num_replicas=2)[1] == 2  # 3.5 per replica: under target
    with pytest.raises(ValueError):
        AutoscalePolicy(3, 2)
