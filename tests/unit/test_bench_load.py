"""Load shapes: the gamma arrival process, and the closed and open loops on a fake send."""

import asyncio
import time

import numpy as np
import pytest

from llmserve.bench.client import RequestRecord
from llmserve.bench.datasets import BenchRequest
from llmserve.bench.load import arrival_times, run_closed_loop, run_open_loop


@pytest.mark.parametrize("rate, burstiness", [(4.0, 1.0), (50.0, 0.25), (0.5, 4.0)])
def test_gamma_arrivals_mean_rate_and_shape(rate, burstiness):
    at = arrival_times(20001, rate, burstiness, np.random.default_rng(0))
    gaps = np.diff(at)
    assert at[0] == 0.0 and np.all(gaps >= 0)
    assert len(gaps) / at[-1] == pytest.approx(rate, rel=0.03)
    cv = gaps.std() / gaps.mean()  # a gamma of shape k has a coefficient of variation 1 / sqrt(k)
    assert cv == pytest.approx(1 / np.sqrt(burstiness), rel=0.05)


def test_arrivals_seeded_and_validated():
    a = arrival_times(10, 2.0, 1.0, np.random.default_rng(3))
    assert np.array_equal(a, arrival_times(10, 2.0, 1.0, np.random.default_rng(3)))
    assert len(arrival_times(1, 2.0, 1.0, np.random.default_rng(3))) == 1
    with pytest.raises(ValueError):
        arrival_times(10, 0.0, 1.0, np.random.default_rng(3))


class FakeSend:
    def __init__(self, seconds):
        self.seconds = seconds
        self.in_flight = 0
        self.peak = 0

    async def __call__(self, req, index):
        rec = RequestRecord(index, req.prompt_len, req.output_len, is_success=True, start_s=time.perf_counter())
        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        await asyncio.sleep(self.seconds)
        self.in_flight -= 1
        rec.e2e_s = self.seconds
        return rec


REQS = [BenchRequest([1], 1, 1)] * 12


def test_closed_loop_keeps_concurrency():
    send = FakeSend(0.02)
    records, seconds = asyncio.run(run_closed_loop(send, REQS, range(12), 4))
    assert send.peak == 4 and [r.index for r in records] == list(range(12))
    assert 0.06 <= seconds < 1.0  # three waves of 20 ms
    assert records[0].start_s < records[4].start_s


def test_open_loop_follows_arrivals_under_a_cap():
    send = FakeSend(0.05)
    arrivals = [0.0, 0.0, 0.0, 0.1]
    records, seconds = asyncio.run(run_open_loop(send, REQS, [0, 1, 2, 3], arrivals, 2))
    assert send.peak == 2
    assert records[2].queue_s >= 0.04  # waited for a slot
    assert records[3].start_s >= 0.099 and records[3].queue_s < records[2].queue_s
    assert 0.149 <= seconds < 1.0
