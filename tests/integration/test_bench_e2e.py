"""`llmserve bench serve` against a real `llmserve serve` on the tiny random model, tiny workloads."""

from __future__ import annotations

import json

import pytest

from llmserve.bench.serve import main

MAX_MODEL_LEN = 2048  # the shared server's (conftest.py)


def _bench(tmp_path, *argv):
    out = tmp_path / "results.json"
    rc = main(["serve", "--no-progress", "--warmup", "1", "--out", str(out), *argv])
    return rc, json.loads(out.read_text())


def test_closed_loop_sweep_streaming(server, tmp_path, capsys):
    rc, data = _bench(tmp_path, "--url", server.url, "--concurrency", "1,4", "--num-requests", "8",
                      "--input-len", "16", "--output-len", "8", "--slo", "e2e=60000", "--plot", str(tmp_path / "plots"))
    assert rc == 0
    assert data["servers"][0]["model"] == "tiny" and data["servers"][0]["is_ignore_eos_sent"]
    assert [run["level"]["name"] for run in data["runs"]] == ["c=1", "c=4"]
    for run in data["runs"]:
        m = run["metrics"]
        assert (m["num_completed"], m["num_failed"], m["total_output_tokens"]) == (8, 0, 64)  # ignore_eos
        assert m["goodput"] == pytest.approx(m["request_throughput"])
        assert 0 < m["ttft_ms"]["median"] <= m["e2e_ms"]["median"] and m["tpot_ms"]["count"] == 8
        for rec in run["records"]:
            assert rec["output_tokens_source"] == "usage" and rec["num_prompt_tokens"] >= 16
            assert len(rec["itl_s"]) == rec["num_chunks"] - 1 >= 0
    out = capsys.readouterr().out
    assert "| c=4 |" in out and "Median TPOT (ms)" in out
    assert (tmp_path / "plots" / "throughput.png").exists() and (tmp_path / "plots" / "itl_cdf.png").exists()


def test_chat_text_prompts_no_stream_compare(server, tmp_path):
    """Text prompts of exact token counts (the model's tokenizer), chat, no streaming, A/B on one server."""
    model_dir = server.args[server.args.index("--model") + 1]
    rc, data = _bench(tmp_path, "--url", server.url, "--compare", server.base_url, "--labels", "a,b",
                      "--tokenizer", model_dir, "--endpoint", "chat", "--no-stream",
                      "--dataset", "shared-prefix", "--num-prefixes", "2",
                      "--prefix-len", "32", "--input-len", "8", "--output-len", "4", "--num-requests", "4",
                      "--concurrency", "2")
    assert rc == 0
    assert [(r["server"], r["metrics"]["num_completed"]) for r in data["runs"]] == [("a", 4), ("b", 4)]
    for run in data["runs"]:
        assert run["metrics"]["ttft_ms"] is None and run["metrics"]["total_output_tokens"] == 16
        for rec in run["records"]:  # 32 + 8 tokens of text; the server adds its chat template
            assert rec["prompt_len"] == 40 and rec["num_prompt_tokens"] > 40


def test_errors_mid_run_are_reported(server, tmp_path, capsys):
    """Prompts too long for the model fail with a 400; the run finishes and counts them."""
    path = tmp_path / "reqs.jsonl"
    short, long = json.dumps({"prompt": [5] * 8, "output_len": 4}), json.dumps({"prompt": [5] * (MAX_MODEL_LEN + 8)})
    path.write_text("\n".join([short, long, short, long]) + "\n")
    rc, data = _bench(tmp_path, "--url", server.url, "--dataset", "jsonl", "--dataset-path", str(path),
                      "--num-requests", "4", "--concurrency", "2", "--timeout", "60")
    assert rc == 1
    m = data["runs"][0]["metrics"]
    assert (m["num_completed"], m["num_failed"]) == (2, 2) and set(m["errors"]) == {"http_400"}
    assert "Errors" in capsys.readouterr().out


def test_unreachable_and_wrong_model(server, capsys):
    assert main(["serve", "--url", server.url, "--model", "nope", "--num-requests", "1", "--no-progress"]) == 2
    assert "not among the served models" in capsys.readouterr().err
    assert main(["serve", "--url", "http://127.0.0.1:9", "--num-requests", "1", "--no-progress"]) == 2
    assert "cannot reach" in capsys.readouterr().err


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_json_schema_reports_grammar_compiles_and_hits(server, tmp_path, endpoint, capsys):
    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps({"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
                                  "additionalProperties": False, "title": endpoint}))  # a new schema per test
    rc, data = _bench(tmp_path, "--url", server.url, "--endpoint", endpoint, "--json-schema", str(schema),
                      "--concurrency", "1,2", "--num-requests", "4", "--input-len", "8", "--output-len", "12")
    assert rc == 0
    for run in data["runs"]:  # the probe compiled the schema: every measured request hits the cache
        assert run["metrics"]["num_completed"] == 4
        assert run["grammar"]["num_queries"] == 4 and run["grammar"]["cache_hit_rate"] == 1.0
        assert run["grammar"]["num_compiles"] == 0
    whole = data["grammar"]["127.0.0.1:" + server.url.rsplit(":", 1)[1]]
    assert whole["num_compiles"] == 1 and whole["mean_compile_s"] > 0 and whole["num_queries"] == 10
    assert "Grammar cache hit rate (%)" in capsys.readouterr().out
