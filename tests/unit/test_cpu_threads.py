"""The engine's CPU thread count: one thread for a small served model on CPU, else torch's default within the
CPUs the process may use."""

import dataclasses

import pytest
import torch

from llmserve.config import CacheConfig, EngineConfig, ModelConfig
from llmserve.engine.engine_core import EngineCore
from llmserve.model.loader import load_model
from llmserve.testing.maker import make_model
from llmserve.worker.cpu_threads import SMALL_MODEL_PARAMS, cgroup_cpu_quota, choose_num_threads, num_matmul_params


def test_a_served_small_cpu_model_gets_one_thread_and_the_rest_keep_theirs():
    small, large = SMALL_MODEL_PARAMS - 1, SMALL_MODEL_PARAMS
    assert choose_num_threads(None, small, "cpu", has_front_beside=True) == 1
    assert choose_num_threads(None, large, "cpu", has_front_beside=True) is None
    assert choose_num_threads(None, small, "cuda", has_front_beside=True) is None
    assert choose_num_threads(None, small, "cpu", has_front_beside=False) is None
    assert choose_num_threads(3, large, "cpu", has_front_beside=False) == 3
    assert choose_num_threads(2, small, "cuda", has_front_beside=True) == 2
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        choose_num_threads(0, small, "cpu", has_front_beside=True)


def test_a_served_larger_model_stays_within_the_available_cpus():
    large = SMALL_MODEL_PARAMS
    assert choose_num_threads(None, large, "cpu", True, num_cpus=2, num_current=16) == 2
    assert choose_num_threads(None, large, "cpu", True, num_cpus=4, num_current=4) is None
    assert choose_num_threads(None, large, "cpu", False, num_cpus=2, num_current=16) is None  # in-process
    assert choose_num_threads(8, large, "cpu", True, num_cpus=2, num_current=16) == 8  # asked for


@pytest.mark.parametrize("files, quota", [
    ({"cpu.max": "150000 100000\n"}, 1.5), ({"cpu.max": "max 100000\n"}, None),
    ({"cpu/cpu.cfs_quota_us": "200000\n", "cpu/cpu.cfs_period_us": "100000\n"}, 2.0),
    ({"cpu/cpu.cfs_quota_us": "-1\n", "cpu/cpu.cfs_period_us": "100000\n"}, None), ({}, None),
])
def test_cgroup_cpu_quota_v2_and_v1(tmp_path, files, quota):
    for name, text in files.items():
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    assert cgroup_cpu_quota(str(tmp_path)) == quota


@pytest.mark.parametrize("shape, is_tied", [("tiny", False), ("tiny-llama3", True)])
def test_matmul_params_leave_out_an_untied_embedding_table(tmp_path, shape, is_tied):
    model = load_model(make_model("llama", shape, str(tmp_path), seed=0), torch.float32, "cpu")
    total = sum(p.numel() for p in model.parameters())
    embed = model.model.embed_tokens.weight.numel()
    assert num_matmul_params(model) == (total if is_tied else total - embed)


def test_the_engine_sets_the_process_threads(tmp_path):
    path = make_model("llama", "tiny", str(tmp_path), seed=0)
    config = EngineConfig(model=ModelConfig(model=path, dtype="float32", device="cpu", max_model_len=64),
                          cache=CacheConfig(num_kv_blocks=8))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert EngineCore(config).num_threads == torch.get_num_threads() == 2  # in-process: as it was
        assert EngineCore(config, has_front_beside=True).num_threads == torch.get_num_threads() == 1
        asked = dataclasses.replace(config, model=dataclasses.replace(config.model, num_threads=2))
        assert EngineCore(asked, has_front_beside=True).num_threads == torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
