"""The Ray Serve package's parts that need no Ray: config checks, `serve run` arguments, the in-process ASGI
call (head with the first chunk, joined chunks, disconnect when the consumer leaves), and that the rest of
llmserve never imports ray (tests/integration/test_rayserve.py runs the whole on a real Ray)."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys

import pytest

from llmserve.config import CacheConfig, EngineConfig, KVTransferConfig, ModelConfig, SpeculativeConfig
from llmserve.rayserve.app import SAME_LOOP_ENV, _argv, ray_env, replica_options
from llmserve.rayserve.asgi import call_asgi
from llmserve.rayserve.config import Deployment, RayServeConfig
from llmserve.rayserve.ingress import _app_path
from llmserve.rayserve.messages import ForwardedRequest, ResponseHead
from llmserve.rayserve.pd_ingress import generation_body, prefill_request
from llmserve.router.pd_policy import PDPolicy
from llmserve.server.config import ServerConfig


@pytest.mark.parametrize("changes, flag", [
    ({"min_replicas": 3, "max_replicas": 2}, "max-replicas"),
    ({"initial_replicas": 9}, "initial-replicas"),
    ({"target_ongoing_requests": 0}, "target-ongoing-requests"),
    ({"num_replicas": 0}, "num-replicas"),
    ({"request_router": "random"}, "request-router"),
    ({"route_prefix": "v1"}, "route-prefix"),
    ({"max_attempts": 0}, "max-attempts"),
    ({"direct_ingress_port": 70000}, "direct-ingress-port"),
    ({"direct_ingress_port": 9000, "address": "auto"}, "direct-ingress-port"),
])
def test_bad_values_are_refused_naming_the_flag(changes, flag):
    with pytest.raises(ValueError, match=flag):
        RayServeConfig(**changes)


def test_deployment_checks_across_sections():
    with pytest.raises(ValueError, match="replica-num-gpus"):
        Deployment(EngineConfig(model=ModelConfig(device="cuda")), ServerConfig(), RayServeConfig()).validate()
    with pytest.raises(ValueError, match="port"):
        Deployment(EngineConfig(), ServerConfig(port=0), RayServeConfig()).validate()
    with pytest.raises(ValueError, match="direct-ingress-port"):  # its ports: 8999 and 9000
        Deployment(EngineConfig(), ServerConfig(port=9000), RayServeConfig(direct_ingress_port=8999,
                                                                           ingress_replicas=2)).validate()


def test_direct_ingress_sets_its_ports_and_the_throughput_preset():
    assert ray_env(RayServeConfig()) == SAME_LOOP_ENV
    env = ray_env(RayServeConfig(direct_ingress_port=9100, ingress_replicas=2))
    assert env["RAY_SERVE_ENABLE_DIRECT_INGRESS"] == "1" and env["RAY_SERVE_THROUGHPUT_OPTIMIZED"] == "1"
    assert (env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"], env["RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT"]) == (
        "9100", "9102")  # Ray's range excludes its end


def test_autoscaling_config_off_with_a_fixed_count():
    assert RayServeConfig(num_replicas=2).autoscaling_config() is None
    config = RayServeConfig(min_replicas=2, max_replicas=5, upscale_delay_s=1)
    assert config.autoscaling_config() == {
        "min_replicas": 2, "max_replicas": 5, "initial_replicas": None, "target_ongoing_requests": 64.0,
        "upscale_delay_s": 1, "downscale_delay_s": 60.0, "look_back_period_s": 15.0}


@pytest.mark.parametrize("changes, free, flag, words", [
    ({"num_replicas": 2}, {"CPU": 2.0}, "num-replicas", "= 2.5 CPUs, but the Ray cluster has 2 free: lower "
     "--num-replicas or those, or give Ray more with --num-cpus"),
    ({}, {"CPU": 1.0}, "min-replicas", "1 engine replica(s) x 1 CPU"),
    ({"initial_replicas": 3}, {"CPU": 3.0}, "initial-replicas", "= 3.5 CPUs"),
    ({"num_replicas": 2, "replica_num_gpus": 1.0}, {"CPU": 8.0, "GPU": 1.0}, "num-replicas", "= 2 GPUs"),
])
def test_what_the_deployments_reserve_must_fit_the_cluster(changes, free, flag, words):
    config = RayServeConfig(**changes)
    with pytest.raises(ValueError, match=f"^--{flag}: ") as error:
        config.check_fits(free)
    assert words in str(error.value)
    RayServeConfig(**changes).check_fits({"CPU": 16.0, "GPU": 4.0})
    RayServeConfig(num_replicas=1, replica_num_cpus=1.5, ingress_num_cpus=0.5).check_fits({"CPU": 2.0})


def test_serve_run_arguments_become_flags():
    assert _argv({"model": "/m", "min_replicas": 2, "enforce-eager": "true", "access_log": "False"}) == [
        "--model", "/m", "--min-replicas", "2", "--enforce-eager", "--no-access-log"]


def test_app_path_below_the_route_prefix():
    assert _app_path({"path": "/llm/v1/models", "root_path": "/llm"}) == "/v1/models"
    assert _app_path({"path": "/llm", "root_path": "/llm"}) == "/"
    assert _app_path({"path": "/v1/models", "root_path": ""}) == "/v1/models"


def request(path: str = "/", body: bytes = b"") -> ForwardedRequest:
    return ForwardedRequest("POST", path, b"", ((b"content-type", b"application/json"),), body)


async def collect(app, req: ForwardedRequest, limit: int | None = None) -> list:
    items = []
    async for item in call_asgi(app, req, ((b"x-extra", b"1"),)):
        items.append(item)
        if limit is not None and len(items) == limit:
            break
    return items


def test_a_whole_response_is_one_item():
    async def app(scope, receive, send):
        assert (await receive())["body"] == b"ping"
        await send({"type": "http.response.start", "status": 201, "headers": [(b"a", b"b")]})
        await send({"type": "http.response.body", "body": b"pong"})

    items = asyncio.run(collect(app, request(body=b"ping")))
    assert items == [ResponseHead(201, ((b"a", b"b"), (b"x-extra", b"1")), b"pong", True)]


def test_a_stream_keeps_its_chunks_and_joins_those_waiting():
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        for chunk in (b"1", b"2", b"3"):  # sent without yielding to the consumer: arrive joined
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"4", "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    items = asyncio.run(collect(app, request()))
    assert items[0] == ResponseHead(200, ((b"x-extra", b"1"),), b"123", False)
    assert b"".join(items[1:]) == b"4"


def test_the_app_sees_a_disconnect_when_the_consumer_leaves():
    seen = []

    async def app(scope, receive, send):
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"first", "more_body": True})
        seen.append((await receive())["type"])  # blocks until the consumer is gone

    async def run():
        stream = call_asgi(app, request())
        assert (await stream.__anext__()).body == b"first"
        await stream.aclose()

    asyncio.run(run())
    assert seen == ["http.disconnect"]


def test_an_app_error_reaches_the_consumer():
    async def app(scope, receive, send):
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        asyncio.run(collect(app, request()))


def test_the_cli_does_not_import_ray():
    code = ("import sys; from llmserve.cli import build_parser; "
            "build_parser().parse_args(['serve-ray', '--num-replicas', '2']); "
            "import llmserve.rayserve.config, llmserve.server.api_server; print('ray' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def test_missing_ray_is_a_clear_install_hint(monkeypatch):
    from llmserve import rayserve

    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install \"llmserve\[ray\]\""):
        rayserve.require_ray()


def test_config_is_frozen():
    with pytest.raises(dataclasses.FrozenInstanceError):
        RayServeConfig().min_replicas = 3


@pytest.mark.parametrize("changes, flag", [
    ({"num_prefill_replicas": 2}, "num-prefill-replicas"),  # without --pd-disaggregation
    ({"num_decode_replicas": 2}, "num-decode-replicas"),
    ({"pd_disaggregation": True, "num_decode_replicas": 0}, "num-decode-replicas"),
    ({"pd_disaggregation": True, "request_router": "pow-2"}, "request-router"),
    ({"pd_disaggregation": True, "num_replicas": 2}, "num-replicas"),
    ({"pd_disaggregation": True, "max_replicas": 8}, "max-replicas"),
    ({"pd_disaggregation": True, "prefill_min_replicas": 0}, "prefill-min-replicas"),
    ({"pd_disaggregation": True, "decode_min_replicas": 3, "decode_max_replicas": 2}, "decode-max-replicas"),
    ({"pd_disaggregation": True, "prefill_target_ongoing_requests": 0}, "prefill-target-ongoing-requests"),
    ({"pd_disaggregation": True, "max_local_prefill_length_if_busy": -1}, "max-local-prefill-length-if-busy"),
    ({"decode_max_replicas": 8}, "decode-max-replicas"),  # without --pd-disaggregation
    ({"prefill_on_idle_decode": True}, "prefill-on-idle-decode"),
    ({"max_local_prefill_length": 64}, "max-local-prefill-length"),
])
def test_pd_replica_counts_are_checked_naming_the_flag(changes, flag):
    with pytest.raises(ValueError, match=f"^--{flag}: "):
        RayServeConfig(**changes)


@pytest.mark.parametrize("engine, flag", [
    (EngineConfig(kv_transfer=KVTransferConfig(disaggregation_mode="decode")), "disaggregation-mode"),
    (EngineConfig(kv_transfer=KVTransferConfig(disaggregation_mode="decode", disaggregation_kv_port=9000)),
     "disaggregation-mode"),
    (EngineConfig(cache=CacheConfig(enable_prefix_caching=False)), "pd-disaggregation"),
    (EngineConfig(speculative=SpeculativeConfig(speculative="draft", draft_model="/m")), "pd-disaggregation"),
])
def test_pd_engine_settings_are_checked_before_anything_starts(engine, flag):
    with pytest.raises(ValueError, match=f"^--{flag}: "):
        Deployment(engine, ServerConfig(), RayServeConfig(pd_disaggregation=True)).validate()


def test_pd_roles_run_the_engine_as_prefill_and_decode_servers():
    deployment = Deployment(EngineConfig(), ServerConfig(), RayServeConfig(pd_disaggregation=True,
                                                                           num_decode_replicas=2))
    deployment.validate()
    prefill, decode = (deployment.for_role(role).engine.kv_transfer for role in ("prefill", "decode"))
    assert (prefill.disaggregation_mode, decode.disaggregation_mode) == ("prefill", "decode")
    assert decode.disaggregation_kv_port == 0  # each decode replica binds a free port and reports it
    assert deployment.ray.autoscaling_config() is None and deployment.ray.num_starting_replicas == 3
    with pytest.raises(ValueError, match="^--prefill-min-replicas / --num-decode-replicas: 3 engine replica"):
        deployment.ray.check_fits({"CPU": 3.0})


def test_pd_roles_autoscale_each_by_its_own_flags():
    config = RayServeConfig(pd_disaggregation=True, prefill_min_replicas=2, prefill_max_replicas=3,
                            prefill_target_ongoing_requests=1, decode_max_replicas=6, upscale_delay_s=2)
    shared = {"initial_replicas": None, "upscale_delay_s": 2, "downscale_delay_s": 60.0, "look_back_period_s": 15.0}
    assert config.autoscaling_config("prefill") == {"min_replicas": 2, "max_replicas": 3,
                                                    "target_ongoing_requests": 1, **shared}
    assert config.autoscaling_config("decode") == {"min_replicas": 1, "max_replicas": 6,
                                                   "target_ongoing_requests": 64.0, **shared}
    assert config.num_starting_replicas == 3 and config.autoscaling_config() is None
    fixed = dataclasses.replace(config, num_prefill_replicas=1)
    assert fixed.autoscaling_config("prefill") is None and fixed.role_num_replicas("prefill") == 1
    assert RayServeConfig().autoscaling_config("decode") is None  # roles only with --pd-disaggregation
    assert dataclasses.replace(config, max_local_prefill_length=8, prefill_on_idle_decode=True).pd_policy == \
        PDPolicy(max_local_prefill_length=8, prefill_on_idle_decode=True)


def test_pd_replica_options_carry_each_roles_autoscaling():
    deployment = Deployment(EngineConfig(), ServerConfig(), RayServeConfig(pd_disaggregation=True,
                                                                           num_prefill_replicas=2))
    prefill = replica_options(deployment.for_role("prefill"), "P", "prefill")
    decode = replica_options(deployment.for_role("decode"), "D", "decode")
    assert prefill["num_replicas"] == 2 and "autoscaling_config" not in prefill
    assert "num_replicas" not in decode and decode["autoscaling_config"]["max_replicas"] == 4


def test_pd_ingress_sends_the_prefill_replica_a_one_token_copy():
    original = request("/v1/chat/completions", b'{"messages": [], "stream": true, "max_tokens": 50}')
    original = dataclasses.replace(original, headers=((b"content-length", b"51"),), pinned_replica="r1")
    assert generation_body(original) == {"messages": [], "stream": True, "max_tokens": 50}
    assert generation_body(request("/v1/embeddings", b"{}")) is None
    assert generation_body(request("/v1/completions", b"not json")) is None
    copy = prefill_request(original, generation_body(original), "tcp://10.0.0.2:5555")
    assert json.loads(copy.body) == {"messages": [], "stream": False, "max_tokens": 1, "n": 1,
                                     "kv_transfer_params": {"decode_kv_address": "tcp://10.0.0.2:5555"}}
    assert copy.headers == ((b"content-length", str(len(copy.body)).encode()),) and copy.pinned_replica is None
