"""`llmserve bench serve --json-schema`: the flag, the schema in each endpoint's request body, and the
grammar figures taken from the server's /metrics (a delta per level; nothing for servers without them)."""

import json
import math

import pytest

from llmserve.bench.client import SCHEMA_NAME, Target, build_payload
from llmserve.bench.config import BenchServeConfig, TargetConfig
from llmserve.bench.datasets import BenchRequest
from llmserve.bench.report import format_result, result_to_dict
from llmserve.bench.runner import base_targets
from llmserve.bench.scrape import GrammarMetrics, grammar_delta, parse_grammar_totals
from llmserve.messages import GrammarStats, SchedulerStats
from llmserve.server.metrics import ServerMetrics
from test_bench_config import _cfg
from test_bench_report import make_result

SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}


@pytest.fixture
def schema_file(tmp_path):
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(SCHEMA))
    return str(path)


def test_json_schema_flag_is_loaded_and_reaches_every_target(schema_file):
    cfg = _cfg("--json-schema", schema_file, "--compare", "http://h:2")
    assert cfg.target.json_schema == schema_file and cfg.json_schema == SCHEMA
    assert [t.json_schema for t in base_targets(cfg)] == [SCHEMA, SCHEMA]
    assert _cfg().json_schema is None and base_targets(_cfg())[0].json_schema is None


@pytest.mark.parametrize("content, message", [
    (None, "cannot read"), ("{not json", "not valid JSON"), ("[1, 2]", "must hold a JSON object"),
    (b"\xff\xfe", "not valid JSON"),
])
def test_json_schema_flag_is_checked_at_start_up(tmp_path, content, message):
    path = tmp_path / "schema.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=f"--json-schema: .*{message}"):
        BenchServeConfig(target=TargetConfig(json_schema=str(path)))


def test_schema_goes_in_each_endpoints_field():
    req = BenchRequest("hi", 2, 8)
    chat = build_payload(Target("A", "http://h", "m", endpoint="chat", json_schema=SCHEMA), req)
    assert chat["response_format"] == {"type": "json_schema", "json_schema": {"name": SCHEMA_NAME, "schema": SCHEMA}}
    assert "structured_outputs" not in chat
    completions = build_payload(Target("A", "http://h", "m", endpoint="completions", json_schema=SCHEMA), req)
    assert completions["structured_outputs"] == {"json": SCHEMA} and "response_format" not in completions
    plain = build_payload(Target("A", "http://h", "m", endpoint="chat"), req)
    assert "response_format" not in plain and "structured_outputs" not in plain
    overridden = Target("A", "http://h", "m", json_schema=SCHEMA, extra_body={"structured_outputs": {}})
    override = build_payload(overridden, req)
    assert override["structured_outputs"] == {}  # --extra-body has the last word, as for every field


def _server_text(*steps: GrammarStats) -> str:
    metrics = ServerMetrics("m")
    for step in steps:
        metrics.on_scheduler_stats(SchedulerStats(grammar=step))
    return metrics.render().decode()


def test_grammar_delta_from_two_scrapes_of_llmserve_metrics():
    first = GrammarStats(2, 1, [0.003])
    before = parse_grammar_totals(_server_text(first))
    after = parse_grammar_totals(_server_text(first, GrammarStats(10, 8, [0.02, 0.2]), GrammarStats(4, 4, [])))
    assert before.num_queries == 2 and before.num_compiles == 1
    g = grammar_delta(before, after)
    assert (g.num_queries, g.num_hits, g.num_compiles) == (14, 12, 2)
    assert g.cache_hit_rate == pytest.approx(12 / 14) and g.mean_compile_s == pytest.approx(0.11)
    assert g.max_compile_s == 0.25  # the bucket that holds the slowest new compile
    idle = grammar_delta(after, after)
    assert idle == GrammarMetrics(0, 0, None, 0, None, None)
    assert grammar_delta(after, before) is None  # counters went back: the server restarted
    slow = parse_grammar_totals(_server_text(first, GrammarStats(1, 0, [30.0])))
    assert grammar_delta(before, slow).max_compile_s == math.inf


@pytest.mark.parametrize("text", [
    "# TYPE vllm:prefix_cache_hits_total counter\nvllm:prefix_cache_hits_total{model_name=\"m\"} 3.0\n",
    "<html>404 not found</html>", "",
])
def test_servers_without_grammar_metrics_give_nothing(text):
    assert parse_grammar_totals(text) is None
    assert grammar_delta(None, parse_grammar_totals(text)) is None


def test_report_shows_grammar_rows_and_json_has_them():
    base = make_result()
    g = GrammarMetrics(20, 19, 0.95, 1, 0.123, 0.25)
    runs = [type(r)(r.server, r.level, r.metrics, r.records, g if r.server == "llmserve" else None) for r in base.runs]
    result = type(base)(base.config, base.servers, base.levels, runs, base.notes, {"llmserve": g})
    text = format_result(result)
    line = next(ln for ln in text.splitlines() if ln.startswith("Grammar cache hit rate (%)"))
    assert line.split()[-3:] == ["95.00", "-", "-"]
    line = next(ln for ln in text.splitlines() if ln.startswith("Mean grammar compile (ms)"))
    assert line.split()[-3:] == ["123.00", "-", "-"]
    assert "Grammar, whole run (llmserve): 1 compiles, mean 123.0 ms, max <= 250 ms" in text
    data = result_to_dict(result)
    assert data["runs"][0]["grammar"]["cache_hit_rate"] == 0.95 and data["runs"][1]["grammar"] is None
    assert data["grammar"]["llmserve"]["num_compiles"] == 1
    assert "Grammar" not in format_result(base)  # no server exported the metrics: no rows


def test_probe_rejected_schema_names_the_field():
    from llmserve.bench.client import RequestRecord
    from llmserve.bench.probe import diagnose

    rec = RequestRecord(-1, 2, 4, error_kind="http_400", error="HTTP 400: unknown field")
    req = BenchRequest("hi", 2, 4)
    chat = diagnose(Target("A", "http://h", "m", endpoint="chat", json_schema=SCHEMA), rec, ["m"], req)
    assert "--json-schema (sent as response_format)" in chat
    completions = diagnose(Target("A", "http://h", "m", json_schema=SCHEMA), rec, ["m"], req)
    assert "sent as structured_outputs" in completions
    assert "--json-schema" not in diagnose(Target("A", "http://h", "m"), rec, ["m"], req)
