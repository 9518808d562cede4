"""Metrics math of `llmserve bench serve` on synthetic records (vLLM's definitions, exact values)."""

import pytest

from llmserve.bench.client import RequestRecord
from llmserve.bench.metrics import Stats, compute_metrics, is_within_slo, tpot_s


def _ok(index, prompt_len, ttft, e2e, num_out, itl):
    return RequestRecord(index, prompt_len, 16, is_success=True, ttft_s=ttft, e2e_s=e2e, itl_s=itl,
                         num_prompt_tokens=prompt_len, num_output_tokens=num_out, output_tokens_source="usage")


def _failed(index, kind):
    return RequestRecord(index, 5, 16, error_kind=kind, error="boom")


RECORDS = [
    _ok(0, 10, 0.1, 0.5, 5, [0.1, 0.1, 0.1, 0.1]),  # TPOT (0.5 - 0.1) / 4 = 0.1
    _ok(1, 20, 0.2, 0.3, 2, [0.1]),  # TPOT 0.1 / 1 = 0.1
    _ok(2, 30, 0.3, 0.3, 1, []),  # one token: no TPOT
    _failed(3, "http_500"),
    _failed(4, "timeout"),
]


def test_counts_and_throughputs():
    m = compute_metrics(RECORDS, duration_s=2.0)
    assert (m.num_requests, m.num_completed, m.num_failed) == (5, 3, 2)
    assert m.errors == {"http_500": 1, "timeout": 1}
    assert (m.total_input_tokens, m.total_output_tokens) == (60, 8)
    assert m.request_throughput == pytest.approx(1.5)
    assert m.output_throughput == pytest.approx(4.0)
    assert m.total_token_throughput == pytest.approx(34.0)
    assert m.goodput is None


def test_latency_stats_exact():
    m = compute_metrics(RECORDS, duration_s=2.0)
    assert m.ttft_ms.mean == pytest.approx(200.0)
    assert m.ttft_ms.median == pytest.approx(200.0)
    assert m.ttft_ms.p90 == pytest.approx(280.0)  # linear interpolation: 200 + 0.8 * 100
    assert m.ttft_ms.p99 == pytest.approx(298.0)
    assert m.ttft_ms.count == 3
    assert (m.tpot_ms.mean, m.tpot_ms.count) == (pytest.approx(100.0), 2)
    assert (m.itl_ms.median, m.itl_ms.count) == (pytest.approx(100.0), 5)
    assert m.e2e_ms.mean == pytest.approx(1100.0 / 3)
    assert m.e2e_ms.median == pytest.approx(300.0)
    assert m.e2e_ms.p90 == pytest.approx(460.0)
    assert m.e2e_ms.p99 == pytest.approx(496.0)


def test_tpot_definition():
    assert tpot_s(_ok(0, 1, 0.25, 1.25, 11, [])) == pytest.approx(0.1)
    assert tpot_s(_ok(0, 1, 0.25, 0.25, 1, [])) is None
    assert tpot_s(RequestRecord(0, 1, 4, is_success=True, e2e_s=1.0, num_output_tokens=4)) is None  # no stream


def test_goodput():
    m = compute_metrics(RECORDS, 2.0, {"ttft": 250.0, "tpot": 150.0})
    assert m.goodput == pytest.approx(1.0)  # requests 0 and 1; request 2's TTFT is 300 ms
    m = compute_metrics(RECORDS, 2.0, {"ttft": 250.0, "e2e": 400.0})
    assert m.goodput == pytest.approx(0.5)  # request 0's E2E is 500 ms
    assert is_within_slo(RECORDS[2], {"tpot": 0.001})  # one-token output counts TPOT as 0, as vLLM does


def test_no_stream_has_no_token_latencies():
    recs = [RequestRecord(0, 4, 8, is_success=True, e2e_s=0.5, num_output_tokens=8, num_prompt_tokens=4)]
    m = compute_metrics(recs, 1.0)
    assert m.ttft_ms is None and m.tpot_ms is None and m.itl_ms is None
    assert m.e2e_ms.mean == pytest.approx(500.0)


def test_all_failed_and_bad_duration():
    m = compute_metrics([_failed(0, "connection")], 1.0)
    assert m.num_completed == 0 and m.e2e_ms is None and m.output_throughput == 0.0
    with pytest.raises(ValueError):
        compute_metrics(RECORDS, 0.0)
    assert Stats.of_seconds([]) is None
