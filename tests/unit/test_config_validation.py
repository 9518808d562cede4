"""Every config value is checked at start-up, and the error names the CLI flag that sets it."""

from __future__ import annotations

import re

import pytest

from llmserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, SpeculativeConfig
from llmserve.router.config import AutoscaleConfig, RouterConfig
from llmserve.server.config import ServerConfig

ENGINE_CASES = [
    (ModelConfig, {"dtype": "float64"}, "dtype"),
    (ModelConfig, {"max_model_len": 0}, "max-model-len"),
    (ModelConfig, {"device": "tpu"}, "device"),
    (ModelConfig, {"attention_backend": "flash"}, "attention-backend"),
    (ModelConfig, {"max_graph_batch": 0}, "max-cudagraph-capture-size"),
    (ModelConfig, {"num_threads": 0}, "num-threads"),
    (CacheConfig, {"block_size": 0}, "block-size"),
    (CacheConfig, {"kv_cache_memory": "lots"}, "kv-cache-memory-bytes"),
    (CacheConfig, {"kv_cache_memory": "0GiB"}, "kv-cache-memory-bytes"),
    (CacheConfig, {"num_kv_blocks": 1}, "num-gpu-blocks-override"),
    (CacheConfig, {"gpu_memory_utilization": 0.0}, "gpu-memory-utilization"),
    (CacheConfig, {"gpu_memory_utilization": 1.5}, "gpu-memory-utilization"),
    (SchedulerConfig, {"max_num_seqs": 0}, "max-num-seqs"),
    (SchedulerConfig, {"max_num_batched_tokens": 0}, "max-num-batched-tokens"),
    (SchedulerConfig, {"max_prefill_tokens_while_decoding": 0}, "max-prefill-tokens-while-decoding"),
    (SchedulerConfig, {"policy": "lifo"}, "scheduling-policy"),
    (SpeculativeConfig, {"speculative": "medusa"}, "speculative"),
    (SpeculativeConfig, {"num_speculative_tokens": 0}, "num-speculative-tokens"),
    (SpeculativeConfig, {"ngram_min": 0}, "ngram-min"),
    (SpeculativeConfig, {"ngram_min": 3, "ngram_max": 2}, "ngram-max"),
    (SpeculativeConfig, {"speculative_max_batch": 0}, "speculative-max-batch"),
    (SpeculativeConfig, {"speculative_dynamic": "yes"}, "speculative-dynamic"),
    (SpeculativeConfig, {"speculative_queue_drafts": 1}, "speculative-queue-drafts"),
    (SpeculativeConfig, {"speculative": "draft"}, "draft-model"),
    (SpeculativeConfig, {"draft_model": "some/dir"}, "draft-model"),
    (SpeculativeConfig, {"speculative": "draft", "draft_model": "d", "draft_vocab_size": 0}, "draft-vocab-size"),
    (SpeculativeConfig, {"speculative": "ngram", "draft_token_map": "map.json"}, "draft-token-map"),
]


def flag_error(flag: str) -> str:
    return "^" + re.escape(f"--{flag}:")


@pytest.mark.parametrize("cls, values, flag", ENGINE_CASES, ids=[f"{c[2]}={c[1]}" for c in ENGINE_CASES])
def test_a_bad_engine_value_names_its_flag(cls, values, flag):
    with pytest.raises(ValueError, match=flag_error(flag)):
        cls(**values).validate()
    section = {ModelConfig: "model", CacheConfig: "cache", SchedulerConfig: "scheduler",
               SpeculativeConfig: "speculative"}[cls]
    with pytest.raises(ValueError, match=flag_error(flag)):
        EngineConfig(**{section: cls(**values)}).validate()


def test_defaults_and_edge_values_are_valid():
    EngineConfig().validate(max_model_len=4096)
    CacheConfig(gpu_memory_utilization=1.0, num_kv_blocks=2, kv_cache_memory="1MiB").validate()
    ModelConfig(device="cuda:1", max_model_len=1).validate()
    SpeculativeConfig(speculative="ngram", ngram_min=2, ngram_max=2).validate()
    SpeculativeConfig(speculative="draft", draft_model="d").validate()


@pytest.mark.parametrize("config, max_model_len, flag", [
    # 4 blocks less the null block hold 3 x 16 = 48 tokens
    (EngineConfig(cache=CacheConfig(num_kv_blocks=4, block_size=16)), 49, "num-gpu-blocks-override"),
    (EngineConfig(model=ModelConfig(max_model_len=49), cache=CacheConfig(num_kv_blocks=4)), None, "num-gpu-blocks-override"),
    (EngineConfig(scheduler=SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=256)), 512,
     "max-num-batched-tokens"),
])
def test_relations_between_values_name_a_flag(config, max_model_len, flag):
    with pytest.raises(ValueError, match=flag_error(flag)):
        config.validate(max_model_len)


def test_relations_that_hold_pass():
    EngineConfig(cache=CacheConfig(num_kv_blocks=4, block_size=16)).validate(48)
    EngineConfig(scheduler=SchedulerConfig(enable_chunked_prefill=False, max_num_batched_tokens=512)).validate(512)
    EngineConfig(scheduler=SchedulerConfig(max_num_batched_tokens=16)).validate(512)  # chunked: any budget


SERVER_CASES = [
    ({"host": ""}, "host"),
    ({"port": 70000}, "port"),
    ({"served_model_name": ""}, "served-model-name"),
    ({"max_queued_requests": -1}, "max-queued-requests"),
    ({"max_body_size": "big"}, "max-body-size"),
    ({"max_body_size": "0"}, "max-body-size"),
    ({"shutdown_timeout": -1.0}, "shutdown-timeout"),
    ({"engine_startup_timeout": 0.0}, "engine-startup-timeout"),
    ({"health_stall_timeout": 0.0}, "health-stall-timeout"),
    ({"timeout_keep_alive": -1}, "timeout-keep-alive"),
    ({"stream_interval": 0}, "stream-interval"),
    ({"request_timeout": 0.0}, "request-timeout"),
]


@pytest.mark.parametrize("values, flag", SERVER_CASES, ids=[c[1] for c in SERVER_CASES])
def test_a_bad_server_value_names_its_flag(values, flag):
    with pytest.raises(ValueError, match=flag_error(flag)):
        ServerConfig(**values)


ROUTER_CASES = [
    (RouterConfig, {"port": -1}, "port"),
    (RouterConfig, {"policy": "random"}, "policy"),
    (RouterConfig, {"load_factor": -0.5}, "load-factor"),
    (RouterConfig, {"prefix_chars": 0}, "prefix-chars"),
    (RouterConfig, {"prefix_tokens": 0}, "prefix-tokens"),
    (RouterConfig, {"health_interval_s": 0.0}, "health-interval-s"),
    (RouterConfig, {"connect_timeout_s": 0.0}, "connect-timeout-s"),
    (RouterConfig, {"upstream_timeout_s": -1.0}, "upstream-timeout-s"),
    (RouterConfig, {"failure_threshold": 0}, "failure-threshold"),
    (RouterConfig, {"max_in_flight_per_backend": 0}, "max-in-flight-per-backend"),
    (AutoscaleConfig, {"min_replicas": -1}, "min-replicas"),
    (AutoscaleConfig, {"min_replicas": 3, "max_replicas": 2}, "max-replicas"),
    (AutoscaleConfig, {"min_replicas": 0, "max_replicas": 0}, "max-replicas"),
    (AutoscaleConfig, {"target_waiting_per_replica": -1.0}, "target-waiting-per-replica"),
    (AutoscaleConfig, {"scale_cooldown_s": -1.0}, "scale-cooldown-s"),
    (AutoscaleConfig, {"replica_startup_timeout_s": 0.0}, "replica-startup-timeout-s"),
    (AutoscaleConfig, {"replica_pool": ""}, "replica-pool"),
]


@pytest.mark.parametrize("cls, values, flag", ROUTER_CASES, ids=[f"{c[2]}={c[1]}" for c in ROUTER_CASES])
def test_a_bad_router_value_names_its_flag(cls, values, flag):
    with pytest.raises(ValueError, match=flag_error(flag)):
        cls(**values).validate()


def test_the_engine_checks_its_config_before_loading_a_model():
    from llmserve.engine.engine_core import EngineCore

    config = EngineConfig(model=ModelConfig(model="/nonexistent/model"), scheduler=SchedulerConfig(max_num_seqs=0))
    with pytest.raises(ValueError, match=flag_error("max-num-seqs")):
        EngineCore(config)


def test_the_server_launcher_checks_the_engine_config_before_starting_the_engine(monkeypatch):
    import asyncio

    from llmserve.engine.async_llm import AsyncLLM
    from llmserve.server.launcher import serve

    async def must_not_start(*args, **kwargs):
        raise AssertionError("the engine started with a bad config")

    monkeypatch.setattr(AsyncLLM, "from_config", must_not_start)
    with pytest.raises(ValueError, match=flag_error("block-size")):
        asyncio.run(serve(EngineConfig(cache=CacheConfig(block_size=0)), ServerConfig(port=0)))


def test_the_speculation_cap_defaults_by_device_and_dtype():
    """8 on CUDA; on CPU the requests whose verification (k + 1 rows each) stays within 10 rows in float32 and 8
    in 16-bit types, at least one; a cap given is kept."""
    def cap(device: str, is_float32: bool, **kwargs) -> int:
        return SpeculativeConfig(speculative="ngram", **kwargs).for_device(device, is_float32).speculative_max_batch

    assert cap("cuda", False) == cap("cuda", True) == 8
    assert (cap("cpu", True), cap("cpu", False)) == (2, 1)  # k = 4
    assert (cap("cpu", True, num_speculative_tokens=1), cap("cpu", False, num_speculative_tokens=1)) == (5, 4)
    assert cap("cpu", False, num_speculative_tokens=9) == 1
    assert cap("cpu", True, speculative_max_batch=6) == 6
