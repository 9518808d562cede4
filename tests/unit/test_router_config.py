"""Router configuration: YAML + flags, the difficulty classifier, request parsing."""

import argparse

import pytest

from llmserve.router.classifier import AutoRouteConfig, DifficultyRule, classify
from llmserve.router.cli import add_route_parser
from llmserve.router.loading import setup_from_args
from llmserve.router.policies import RouteRequest
from llmserve.router.replicas import replica_command
from llmserve.router.requests import PrefixConfig, decode_body, route_request

YAML = """
router:
  policy: prefix-aware
  port: 9000
pools:
  small:
    backends: [http://127.0.0.1:8001, {url: "http://127.0.0.1:8002/", api_key: k2}]
    policy: round-robin
  large:
    upstream_model: big-model
    backends: [http://127.0.0.1:8003]
auto:
  small_pool: small
  large_pool: large
  max_small_prompt_chars: 100
  rules:
    - {name: code, contains: ["def ", "```"], pool: large}
rate_limits:
  default: {rate: 5, burst: 10}
  keys: {vip: {rate: 100, burst: 100}}
"""


def parse(argv):
    parser = argparse.ArgumentParser()
    add_route_parser(parser.add_subparsers(dest="command"))
    return parser.parse_args(["route", *argv])


def test_yaml_and_flags(tmp_path):
    path = tmp_path / "router.yaml"
    path.write_text(YAML)
    setup = setup_from_args(parse(["--config", str(path), "--port", "9100", "--backend", "small=http://127.0.0.1:8004"]))
    assert setup.router.port == 9100  # the flag wins
    assert setup.router.policy == "prefix-aware"  # from the file
    small, large = setup.pools
    assert [b.url for b in small.backends] == ["http://127.0.0.1:8001", "http://127.0.0.1:8002",
                                               "http://127.0.0.1:8004"]
    assert small.backends[1].api_key == "k2" and small.policy == "round-robin"
    assert large.upstream_model == "big-model"
    assert setup.auto.is_enabled and setup.auto.rules[0].contains == ("def ", "```")
    assert setup.router.default_rate_limit.rate == 5 and setup.key_rate_limits["vip"].burst == 100


@pytest.mark.parametrize("yaml_text, message", [
    ("pools: {a: {backends: [ftp://x]}}", "http://"),
    ("pools: {a: {backends: [http://x], polcy: x}}", "unknown key"),
    ("routr: {}", "unknown section"),
    ("pools: {a: {backends: [http://x]}}\nauto: {small_pool: a, large_pool: b}", "not configured"),
    ("router: {policy: random}\npools: {a: {backends: [http://x]}}", "unknown routing policy"),
])
def test_bad_config_is_a_value_error(tmp_path, yaml_text, message):
    path = tmp_path / "r.yaml"
    path.write_text(yaml_text)
    with pytest.raises(ValueError, match=message):
        setup_from_args(parse(["--config", str(path)]))


def test_flags_only_and_no_backends():
    setup = setup_from_args(parse(["--backend", "m=http://127.0.0.1:1", "--backend", "m=http://127.0.0.1:2"]))
    assert len(setup.pools) == 1 and len(setup.pools[0].backends) == 2
    with pytest.raises(ValueError, match="no backends"):
        setup_from_args(parse([]))
    with pytest.raises(ValueError, match="MODEL=URL"):
        setup_from_args(parse(["--backend", "http://x"]))


def test_autoscale_without_replica_model_serves_the_demo_model():
    setup = setup_from_args(parse(["--autoscale"]))
    command = replica_command(setup.autoscale, 9000)
    assert "--model" not in command  # `llmserve serve` with no --model: the embedded demo model
    assert command[command.index("--served-model-name") + 1] == "default"
    given = replica_command(setup_from_args(parse(["--autoscale", "--replica-model", "/m"])).autoscale, 9000)
    assert given[given.index("--model") + 1] == "/m"


AUTO = AutoRouteConfig(small_pool="small", large_pool="large", max_small_prompt_chars=100, max_small_max_tokens=64,
                       rules=(DifficultyRule("large", "code", contains=("def ",)),
                              DifficultyRule("small", "short-chat", max_prompt_chars=20, max_max_tokens=8),
                              DifficultyRule("large", "math", regex=r"\\int|\\sum")))


@pytest.mark.parametrize("prompt, max_tokens, pool, reason", [
    ("hello", 16, "small", "default"),
    ("x" * 101, 16, "large", "prompt_chars"),
    ("hello", 65, "large", "max_tokens"),
    ("please write def f(): pass", 16, "large", "code"),
    ("hi", 4, "small", "short-chat"),
    ("compute \\sum_i i", 16, "large", "math"),
    ("x" * 101 + "def ", None, "large", "code"),  # rules come first
])
def test_difficulty_classifier(prompt, max_tokens, pool, reason):
    request = RouteRequest("auto", num_prompt_chars=len(prompt), max_tokens=max_tokens, prompt_text=prompt)
    decision = classify(AUTO, request)
    assert (decision.pool, decision.reason) == (pool, reason)


def test_bad_rule_regex():
    with pytest.raises(ValueError, match="bad regex"):
        DifficultyRule("large", regex="(")


def test_route_request_from_bodies():
    cfg = PrefixConfig(prefix_chars=8, prefix_tokens=3)
    r = route_request(decode_body(b'{"model":"m","prompt":"abcdefghijkl","max_tokens":5,"user":"u","stream":true}'),
                      cfg)
    assert (r.model, r.prefix, r.user, r.num_prompt_chars, r.max_tokens, r.is_stream) == \
        ("m", b"abcdefgh", "u", 12, 5, True)
    r = route_request(decode_body(b'{"model":"m","prompt":[1,2,3,4,5]}'), cfg)
    assert r.prefix == b"ids:1,2,3" and r.num_prompt_chars == 20 and r.prompt_text == ""
    r = route_request(decode_body(b'{"model":"m","prompt":["first","second"]}'), cfg)
    assert r.prefix == b"first"
    r = route_request(decode_body(b'{"model":"m","input":["embed me","and me"]}'), cfg)  # embeddings
    assert r.prefix == b"embed me"
    chat = b'{"model":"m","messages":[{"role":"system","content":"sys"},' \
           b'{"role":"user","content":[{"type":"text","text":"hi"}]}],"max_completion_tokens":7}'
    r = route_request(decode_body(chat), PrefixConfig())
    assert r.prompt_text == "system: sys\nuser: hi\n" and r.max_tokens == 7
    with pytest.raises(ValueError, match="malformed JSON"):
        decode_body(b"{nope")
    with pytest.raises(ValueError, match="JSON object"):
        decode_body(b"[1]")
