"""The front <-> engine-core wire: msgpack frames only (never pickle), typed on both ends."""

from __future__ import annotations

import msgspec

from llmserve.config import CacheConfig, EngineConfig, ModelConfig
from llmserve.engine.core_proc import InKind, OutKind, UtilityCall, UtilityResult, decode_input, frames
from llmserve.messages import EngineCoreOutput, EngineCoreOutputs, EngineCoreRequest, FinishReason
from llmserve.model.loader import ModelInfo
from llmserve.sampling_params import SamplingParams


def test_add_abort_utility_round_trip():
    request = EngineCoreRequest("r1", [1, 2, 3], SamplingParams(max_tokens=5, stop=["x"], seed=7), [2], 1.5,
                                priority=3, parent_id="p")
    for kind, payload in ((InKind.ADD, request), (InKind.ABORT, ["a", "b"]),
                          (InKind.UTILITY, UtilityCall(4, "get_stats", [])), (InKind.SHUTDOWN, None)):
        kind_frame, body = frames(kind, payload)
        assert decode_input(kind_frame, body) == (kind, payload)


def test_outputs_and_results_decode_typed():
    outputs = EngineCoreOutputs([EngineCoreOutput("r1", [5], finish_reason=FinishReason.ABORT)])
    kind_frame, body = frames(OutKind.OUTPUTS, outputs)
    assert kind_frame == bytes((OutKind.OUTPUTS,))
    assert msgspec.msgpack.decode(body, type=EngineCoreOutputs) == outputs
    result = UtilityResult(3, {"x": 1})
    assert msgspec.msgpack.decode(frames(OutKind.UTILITY, result)[1], type=UtilityResult) == result


def test_engine_config_and_model_info_cross_as_msgpack():
    config = EngineConfig(model=ModelConfig(model="/m", max_model_len=512), cache=CacheConfig(num_kv_blocks=64))
    assert msgspec.msgpack.decode(msgspec.msgpack.encode(config), type=EngineConfig) == config
    info = ModelInfo("m", "/m", "LlamaForCausalLM", 512, 256, [2], 2, 2, 16, 64, "float32")
    assert msgspec.convert(msgspec.to_builtins(info), ModelInfo) == info
