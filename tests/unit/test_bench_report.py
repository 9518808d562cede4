"""Tables, results JSON and plots of a run, on a synthetic two-server result."""

import dataclasses
import json

import pytest

from llmserve.bench.client import RequestRecord, Target
from llmserve.bench.config import Level
from llmserve.bench.metrics import compute_metrics
from llmserve.bench.report import format_result, write_results
from llmserve.bench.runner import BenchResult, LevelRun
from llmserve.bench.scrape import GrammarMetrics


def _records(scale, failed=0):
    recs = [RequestRecord(i, 8, 4, is_success=True, start_s=0.01 * i, ttft_s=0.1 * scale, e2e_s=0.4 * scale,
                          itl_s=[0.1 * scale] * 3, num_prompt_tokens=8, num_output_tokens=4, output_tokens_source="usage")
            for i in range(6)]
    for rec in recs[:failed]:
        rec.is_success, rec.error_kind, rec.error = False, "http_503", "HTTP 503: overloaded"
    return recs


def make_result():
    levels = [Level(1, None), Level(4, None)]
    servers = [Target("llmserve", "http://a", "m"), Target("other", "http://b", "m")]
    runs = [LevelRun(s.label, lv, compute_metrics(recs, 2.0 * scale, {"ttft": 150.0}), recs)
            for lv in levels for s, scale in zip(servers, (1.0, 2.0))
            for recs in [_records(scale, failed=1 if s.label == "other" and lv.concurrency == 4 else 0)]]
    return BenchResult({"load": {"seed": 0}}, servers, levels, runs, ["a note"])


@pytest.fixture
def result():
    return make_result()


def test_tables_show_ratios_and_errors(result):
    text = format_result(result)
    assert " c=1 =" in text and " c=4 =" in text
    line = next(ln for ln in text.splitlines() if ln.startswith("Median TTFT (ms)"))
    assert line.split()[-3:] == ["100.00", "200.00", "2.00x"]
    line = next(ln for ln in text.splitlines() if ln.startswith("Output throughput (tok/s)"))
    assert line.split()[-3:] == ["12.00", "6.00", "0.50x"]
    assert "Errors other: http_503=1" in text and "HTTP 503: overloaded" in text
    assert "| c=4 | other | 5 | 1 |" in text  # the markdown summary


def test_results_json_has_every_record(result, tmp_path):
    path = tmp_path / "sub" / "results.json"
    write_results(result, str(path))
    data = json.loads(path.read_text())
    assert [s["label"] for s in data["servers"]] == ["llmserve", "other"] and data["notes"] == ["a note"]
    run = data["runs"][3]
    assert run["server"] == "other" and run["level"] == {"name": "c=4", "concurrency": 4, "request_rate": None}
    assert len(run["records"]) == 6 and run["records"][0]["error_kind"] == "http_503"
    assert run["metrics"]["ttft_ms"]["median"] == pytest.approx(200.0)
    assert run["metrics"]["errors"] == {"http_503": 1}


def test_plots(result, tmp_path):
    from llmserve.bench.plots import write_plots

    paths = write_plots(result, str(tmp_path / "plots"))
    names = sorted(p.rsplit("/", 1)[1] for p in paths)
    assert names == ["e2e_cdf.png", "itl_cdf.png", "throughput.png", "ttft_cdf.png", "ttft_vs_load.png"]
    for p in paths:
        with open(p, "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"


def test_the_header_keeps_a_long_label_whole():
    result = make_result()
    label = "127.0.0.1:8000"
    result = dataclasses.replace(result, servers=[Target(label, "http://" + label, "m"), result.servers[1]],
                                 runs=[dataclasses.replace(r, server=label) if r.server == "llmserve" else r
                                       for r in result.runs])
    lines = format_result(result).splitlines()
    head = lines[lines.index(next(ln for ln in lines if " c=1 =" in ln)) + 1]
    assert head.split() == ["127.0.0.1:8000", "other", "ratio", "B/A"]


def test_grammar_rows_only_when_a_grammar_was_used():
    unused = GrammarMetrics(num_queries=0, num_hits=0, cache_hit_rate=None, num_compiles=0, mean_compile_s=None,
                            max_compile_s=None)
    used = dataclasses.replace(unused, num_queries=4, num_hits=3, cache_hit_rate=0.75, num_compiles=1,
                               mean_compile_s=0.02, max_compile_s=0.025)
    for grammar, is_shown in ((unused, False), (used, True)):
        result = make_result()
        result = dataclasses.replace(result, runs=[dataclasses.replace(r, grammar=grammar) for r in result.runs],
                                     grammar={"llmserve": grammar})
        text = format_result(result)
        assert ("Grammar compiles" in text) == is_shown and ("Grammar, whole run" in text) == is_shown
