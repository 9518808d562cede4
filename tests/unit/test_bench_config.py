"""`llmserve bench serve` flags: parsing into the config records, and clear errors for bad values."""

import argparse

import pytest

from llmserve.bench.config import Level, normalize_url, parse_levels, parse_slo
from llmserve.bench.serve import add_bench_serve_parser


def _parse(*argv):
    parser = argparse.ArgumentParser(prog="llmserve bench")
    add_bench_serve_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["serve", *argv])


def _cfg(*argv):
    from llmserve.bench.config import config_from_args

    return config_from_args(_parse(*argv))


def test_defaults_and_flags():
    cfg = _cfg()
    assert cfg.target.url == "http://127.0.0.1:8000" and cfg.target.stream and cfg.target.ignore_eos
    assert cfg.levels == [Level(1, None)] and cfg.slo_ms == {}
    cfg = _cfg("--url", "http://h:1/v1/", "--concurrency", "1,4,16,64", "--no-stream", "--endpoint", "chat",
               "--slo", "e2e=900", "--compare", "http://h:2", "--extra-body", '{"temperature": 0}')
    assert cfg.urls == ["http://h:1", "http://h:2"] and cfg.server_labels == ["h:1", "h:2"]
    assert [lv.name for lv in cfg.levels] == ["c=1", "c=4", "c=16", "c=64"]
    assert not cfg.target.stream and cfg.target.endpoint == "chat" and cfg.slo_ms == {"e2e": 900.0}
    assert cfg.extra_body == {"temperature": 0}
    assert _cfg("--url", "http://h:1", "--compare", "http://h:1").server_labels == ["A:h:1", "B:h:1"]


def test_open_loop_levels():
    assert parse_levels(None, "2,4") == [Level(None, 2.0), Level(None, 4.0)]
    assert [lv.name for lv in parse_levels("8", "0.5")] == ["rate=0.5,cap=8"]
    assert parse_levels("8", "0.5")[0].is_open_loop and not parse_levels("8", None)[0].is_open_loop


def test_slo_and_url_parsing():
    assert parse_slo("ttft=500, tpot=50,e2e=5000") == {"ttft": 500.0, "tpot": 50.0, "e2e": 5000.0}
    for bad in ("ttft", "itl=5", "ttft=x", "ttft=-1"):
        with pytest.raises(ValueError, match="--slo"):
            parse_slo(bad)
    with pytest.raises(ValueError, match="http://"):
        normalize_url("localhost:8000")


@pytest.mark.parametrize("argv, message", [
    (["--concurrency", "0"], "--concurrency"),
    (["--concurrency", "a,b"], "--concurrency"),
    (["--request-rate", "-1"], "--request-rate"),
    (["--dataset", "sharegpt"], "--dataset-path"),
    (["--endpoint", "chat", "--prompt-format", "ids"], "chat"),
    (["--num-requests", "0"], "--num-requests"),
    (["--range-ratio", "1.5"], "--range-ratio"),
    (["--no-stream", "--slo", "ttft=100"], "need streaming"),
    (["--extra-body", "[1]"], "--extra-body"),
    (["--labels", "a,b"], "--labels"),
    (["--burstiness", "0"], "--burstiness"),
    (["--timeout", "0"], "--timeout"),
])
def test_errors(argv, message):
    with pytest.raises(ValueError, match=message):
        _cfg(*argv)


def test_handler_reports_errors(capsys):
    args = _parse("--concurrency", "0")
    assert args.func(args) == 2
    assert "error: --concurrency" in capsys.readouterr().err
