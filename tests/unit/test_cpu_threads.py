"""The engine's CPU thread count: one thread for a small served model on CPU, a larger served model one per
CPU free at start-up (allowed by affinity and quota, less those seen busy), the process's count elsewhere;
--num-threads and OMP_NUM_THREADS win."""

import dataclasses
import os

import pytest
import torch

from llmserve.config import CacheConfig, EngineConfig, ModelConfig
from llmserve.engine.engine_core import EngineCore
from llmserve.model.loader import load_model
from llmserve.testing.maker import make_model
from llmserve.worker.cpu_threads import (SMALL_MODEL_PARAMS, CpuReading, available_cpus, cgroup_cpu_quota,
                                         choose_num_threads, idle_cpus, measure_cpus, num_matmul_params,
                                         omp_num_threads, read_cpu_times)

SMALL, LARGE = SMALL_MODEL_PARAMS - 1, SMALL_MODEL_PARAMS


def unread() -> CpuReading:
    raise AssertionError("the CPUs are read only for a served larger model on CPU")


def threads(requested, num_params, device_type, is_served, cpus=None, num_current=2, num_env=None):
    read = unread if cpus is None else (lambda: cpus)
    return choose_num_threads(requested, num_params, device_type, is_served, read, num_current, num_env)


def test_a_served_small_cpu_model_gets_one_thread_and_the_rest_keep_theirs():
    assert threads(None, SMALL, "cpu", True) == (1, "a small model beside the HTTP front")
    assert threads(None, SMALL, "cuda", True).num_threads is None
    assert threads(None, LARGE, "cpu", False) == (None, "the process's count (in-process engine)")
    assert threads(3, LARGE, "cpu", False) == (3, "--num-threads")
    assert threads(2, SMALL, "cuda", True).num_threads == 2
    with pytest.raises(ValueError, match="num_threads must be >= 1"):
        threads(0, SMALL, "cpu", True)


@pytest.mark.parametrize("cpus, num_current, expected", [
    (CpuReading(2, 1.95), 2, (2, "2 of 2 CPUs free at start-up")),  # quiet
    (CpuReading(2, 1.02), 2, (1, "1 of 2 CPUs free at start-up")),  # a neighbour spins on one core
    (CpuReading(2, 0.1), 2, (1, "1 of 2 CPUs free at start-up")),  # all busy: still one
    (CpuReading(2, 1.6), 2, (2, "2 of 2 CPUs free at start-up")),  # light load rounds to free
    (CpuReading(4, 3.9), 16, (4, "4 of 4 CPUs free at start-up")),  # affinity or quota below torch's count
    (CpuReading(8, 7.0), 4, (4, "7 of 8 CPUs free at start-up")),  # never above the process's count
    (CpuReading(2), 16, (2, "2 of 2 CPUs free at start-up")),  # /proc/stat unreadable: the allowed CPUs
])
def test_a_served_larger_model_gets_the_cpus_free_at_start_up(cpus, num_current, expected):
    assert threads(None, LARGE, "cpu", True, cpus, num_current) == expected


def test_the_users_count_wins_over_the_reading():
    assert threads(8, LARGE, "cpu", True, num_current=16) == (8, "--num-threads")
    assert threads(None, LARGE, "cpu", True, num_env=3) == (None, "OMP_NUM_THREADS")
    assert threads(None, SMALL, "cpu", True, num_env=3) == (None, "OMP_NUM_THREADS")
    assert threads(2, LARGE, "cpu", True, num_env=3) == (2, "--num-threads")


@pytest.mark.parametrize("value, expected", [("4", 4), ("4,2", 4), (" 2 ", 2), ("0", None), ("x", None), ("", None)])
def test_omp_num_threads_is_read_as_openmp_does(value, expected):
    assert omp_num_threads({"OMP_NUM_THREADS": value}) == expected
    assert omp_num_threads({}) is None


def test_idle_cpus_sums_the_idle_share_of_the_allowed_cpus(tmp_path):
    stat = tmp_path / "stat"
    # user nice system idle iowait irq softirq steal guest guest_nice
    stat.write_text("cpu  10 0 0 10 0 0 0 0 0 0\ncpu0 0 0 0 100 0 0 0 0 0 0\ncpu1 0 0 0 100 0 0 0 0 0 0\n"
                    "cpu2 0 0 0 100 0 0 0 0 0 0\nintr 1 2 3\n")
    before = read_cpu_times(str(stat))
    assert before == {0: (100, 100), 1: (100, 100), 2: (100, 100)}
    stat.write_text("cpu  10 0 0 10 0 0 0 0 0 0\ncpu0 100 0 0 100 0 0 0 0 0 0\n"  # cpu0: all busy
                    "cpu1 10 0 5 180 5 0 0 0 0 0\ncpu2 0 0 0 150 0 0 0 50 0 0\n")  # cpu1 90% idle, cpu2 half stolen
    after = read_cpu_times(str(stat))
    assert idle_cpus(before, after, {0, 1, 2}) == pytest.approx(0 + 0.85 + 0.5)
    assert idle_cpus(before, after, {1}) == pytest.approx(0.85)  # outside the affinity: not counted
    assert idle_cpus(before, before, {0, 1}) == 2.0  # no ticks between the readings
    assert read_cpu_times(str(tmp_path / "missing")) == {}


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


def test_the_engine_sets_the_process_threads(tmp_path, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    path = make_model("llama", "tiny", str(tmp_path), seed=0)
    config = EngineConfig(model=ModelConfig(model=path, dtype="float32", device="cpu", max_model_len=64),
                          cache=CacheConfig(num_kv_blocks=8))
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert EngineCore(config).num_threads == torch.get_num_threads() == 2  # in-process: as it was
        served = EngineCore(config, is_served=True)
        assert served.num_threads == torch.get_num_threads() == 1
        assert served.threads_reason == "a small model beside the HTTP front"
        asked = dataclasses.replace(config, model=dataclasses.replace(config.model, num_threads=2))
        assert EngineCore(asked, is_served=True).num_threads == torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


def test_measure_cpus_reads_this_machine():
    reading = measure_cpus(window_s=0.05)
    assert reading.num_allowed == available_cpus()
    assert reading.num_idle is not None and 0 <= reading.num_idle <= len(os.sched_getaffinity(0))
    assert 1 <= reading.num_free <= reading.num_allowed
