"""KV-cache sizing arithmetic of the GPU path and the roofline benchmark's byte counts (no GPU needed)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from llmserve.bench.roofline import (bytes_per_decode_step, copy_bandwidth, inactive_expert_bytes,
                                    weight_bytes_read)
from llmserve.config import CacheConfig
from llmserve.model.loader import load_model
from llmserve.testing.maker import make_model
from llmserve.worker.cpu_threads import num_matmul_params
from llmserve.worker.gpu_profile import MemoryProfile, kv_budget_from_profile
from llmserve.worker.kv_cache import needs_gpu_profile, num_kv_blocks

GIB = 2**30


def test_kv_budget_is_the_rest_of_the_allowed_share():
    profile = MemoryProfile(total_bytes=80 * GIB, peak_torch_bytes=17 * GIB, non_torch_bytes=1 * GIB)
    assert kv_budget_from_profile(profile, 0.9) == int(80 * GIB * 0.9) - 18 * GIB
    with pytest.raises(ValueError, match="no GPU memory left"):
        kv_budget_from_profile(profile, 0.2)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_budget_from_profile(profile, 1.5)


def test_num_kv_blocks_from_a_measured_budget():
    cache = CacheConfig(block_size=16)
    assert num_kv_blocks(cache, block_bytes=1000, max_model_len=64, max_num_seqs=4, budget=10_500) == 10
    with pytest.raises(ValueError, match="fewer than one sequence"):
        num_kv_blocks(cache, block_bytes=1000, max_model_len=256, max_num_seqs=4, budget=10_500)
    assert num_kv_blocks(CacheConfig(num_kv_blocks=7), block_bytes=1000, max_model_len=64, max_num_seqs=4,
                         budget=10**9) == 7


def test_cpu_default_holds_twice_what_the_seats_fill_and_an_explicit_budget_is_kept():
    cache = CacheConfig(block_size=16)  # the default budget is gigabytes: far over 4 seats of 64 tokens
    assert num_kv_blocks(cache, block_bytes=1000, max_model_len=64, max_num_seqs=4) == 2 * 4 * 4 + 1
    assert num_kv_blocks(cache, block_bytes=1000, max_model_len=65, max_num_seqs=4) == 2 * 4 * 5 + 1
    sized = CacheConfig(block_size=16, kv_cache_memory="100000")
    assert num_kv_blocks(sized, block_bytes=1000, max_model_len=64, max_num_seqs=4) == 100
    measured = num_kv_blocks(cache, block_bytes=1000, max_model_len=64, budget=100_000, max_num_seqs=4)
    assert measured == 100  # a GPU's measured budget is not capped: spare blocks keep prefixes


def test_only_an_unsized_cuda_cache_is_profiled():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert needs_gpu_profile(CacheConfig(), cuda)
    assert not needs_gpu_profile(CacheConfig(), cpu)
    assert not needs_gpu_profile(CacheConfig(kv_cache_memory="1GiB"), cuda)
    assert not needs_gpu_profile(CacheConfig(num_kv_blocks=100), cuda)


def test_weight_bytes_read_per_decode_step(tmp_path):
    model = load_model(make_model("llama", "tiny", str(tmp_path), seed=0), torch.float32, "cpu")
    assert weight_bytes_read(model) == num_matmul_params(model) * 4
    assert bytes_per_decode_step(1000, 10, 50.5) == 1505.0
    assert inactive_expert_bytes(model) == 0  # dense: every weight counts


def active_qwen3_moe_params(c: dict) -> int:
    """Parameters one decode token reads in a Qwen3-MoE config with every layer sparse (no biases): attention,
    its q/k norms, the two layer norms, the router and top_k experts per layer; the final norm, the lm_head."""
    h, d, vocab = c["hidden_size"], c["head_dim"], c["vocab_size"]
    attention = h * d * (2 * c["num_attention_heads"] + 2 * c["num_key_value_heads"]) + 2 * d + 2 * h
    num_experts = c.get("num_experts") or c["num_local_experts"]
    experts = c["num_experts_per_tok"] * 3 * c["moe_intermediate_size"] * h  # gate, up and down of each
    return c["num_hidden_layers"] * (attention + num_experts * h + experts) + h + vocab * h


def test_weight_bytes_read_of_moe_counts_only_the_active_experts(tmp_path):
    path = make_model("qwen3_moe", "tiny-moe", str(tmp_path), seed=0)
    config = json.loads((Path(path) / "config.json").read_text())
    assert config["decoder_sparse_step"] == 1 and not config["mlp_only_layers"] and not config["attention_bias"]
    model = load_model(path, torch.float32, "cpu")
    assert weight_bytes_read(model) == active_qwen3_moe_params(config) * 4
    assert weight_bytes_read(model) < num_matmul_params(model) * 4  # not all 8 experts


def test_copy_bandwidth_is_positive_and_finite():
    assert 0 < copy_bandwidth(torch.device("cpu"), 2**20, repeats=3) < float("inf")
