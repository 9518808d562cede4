"""Rotary frequencies (default, linear, Llama-3, YaRN) and RMSNorm against transformers."""

from __future__ import annotations

import types

import pytest
import torch

from llmserve.model.layers import RMSNorm, RopeParams, RotaryEmbedding, apply_rotary, rope_inv_freq, rope_params_from_config

LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}


def hf_inv_freq(rope_parameters: dict, head_dim: int = 128) -> torch.Tensor:
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    config = LlamaConfig(hidden_size=head_dim * 4, num_attention_heads=4, max_position_embeddings=131072,
                         rope_parameters=rope_parameters)
    rope_type = rope_parameters["rope_type"]
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)[0]
    return ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")[0]


@pytest.mark.parametrize("rope_parameters", [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    {**LLAMA3, "rope_theta": 500000.0},
])
def test_inv_freq_matches_transformers(rope_parameters):
    config = types.SimpleNamespace(rope_parameters=rope_parameters)
    ours = rope_inv_freq(128, rope_params_from_config(config))
    torch.testing.assert_close(ours, hf_inv_freq(rope_parameters), atol=0, rtol=1e-6)


def test_old_style_rope_theta_and_rope_scaling_are_read():
    old = types.SimpleNamespace(rope_theta=500000.0, rope_scaling={**LLAMA3, "type": "llama3"})
    new = types.SimpleNamespace(rope_parameters={**LLAMA3, "rope_theta": 500000.0})
    assert rope_params_from_config(old) == rope_params_from_config(new)
    assert rope_params_from_config(old).rope_type == "llama3"
    assert rope_params_from_config(types.SimpleNamespace(rope_theta=1e6)) == RopeParams(theta=1e6)


def test_unsupported_rope_type_is_a_value_error():
    with pytest.raises(ValueError, match="dynamic"):
        rope_params_from_config(types.SimpleNamespace(rope_parameters={"rope_type": "dynamic", "rope_theta": 1.0}))


YARN = {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "truncate": False, "original_max_position_embeddings": 4096}  # gpt-oss's


@pytest.mark.parametrize("rope_parameters,head_dim", [
    (YARN, 64),
    ({**YARN, "truncate": True, "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0}, 128),  # truncate defaults to on
    ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 4096,
      "mscale": 0.707, "mscale_all_dim": 0.707}, 64),  # DeepSeek's mscale pair
    ({"rope_type": "yarn", "rope_theta": 10000.0, "factor": None, "original_max_position_embeddings": 1024,
      "attention_factor": 1.25}, 32),  # factor from max_position_embeddings / original, attention factor given
])
def test_yarn_matches_transformers(rope_parameters, head_dim):
    """Frequencies and the cos/sin scale (mscale) equal transformers' `_compute_yarn_parameters`."""
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    config = GptOssConfig(hidden_size=head_dim * 4, num_attention_heads=4, head_dim=head_dim, num_hidden_layers=2,
                          max_position_embeddings=8192, rope_parameters=dict(rope_parameters))
    hf_inv_freq, hf_scaling = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    params = rope_params_from_config(config)
    assert torch.equal(rope_inv_freq(head_dim, params), hf_inv_freq)
    assert params.attention_scaling == pytest.approx(hf_scaling, rel=1e-12)
    positions = torch.tensor([0, 3, 4095, 5000])
    cos, sin = RotaryEmbedding(head_dim, params).cos_sin(positions, torch.float32)  # [T, 1, D/2]
    freqs = positions.float()[:, None] * hf_inv_freq
    torch.testing.assert_close(cos[:, 0], freqs.cos() * hf_scaling, atol=0, rtol=0)
    torch.testing.assert_close(sin[:, 0], freqs.sin() * hf_scaling, atol=0, rtol=0)


def test_yarn_with_partial_rotary_is_refused():
    config = types.SimpleNamespace(rope_parameters={**YARN, "partial_rotary_factor": 0.5}, max_position_embeddings=8)
    with pytest.raises(ValueError, match="partial_rotary_factor=0.5"):
        rope_params_from_config(config)


def test_rotary_matches_transformers_apply():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb
    rope = RotaryEmbedding(32, RopeParams(theta=10000.0))
    positions = torch.tensor([0, 5, 1, 700, 3])
    q, k = torch.randn(5, 4, 32), torch.randn(5, 2, 32)
    cos, sin = rope.cos_sin(positions, torch.float32)
    freqs = positions.float()[:, None] * rope_inv_freq(32, RopeParams(theta=10000.0))[None]
    emb = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    hf_q, hf_k = apply_rotary_pos_emb(q.transpose(0, 1), k.transpose(0, 1), emb.cos(), emb.sin(), unsqueeze_dim=0)
    torch.testing.assert_close(apply_rotary(q, cos, sin), hf_q.transpose(0, 1))
    torch.testing.assert_close(apply_rotary(k, cos, sin), hf_k.transpose(0, 1))


def test_rmsnorm_matches_transformers_and_fuses_the_residual():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    ours, theirs = RMSNorm(48, 1e-5), LlamaRMSNorm(48, 1e-5)
    weight = torch.randn(48)
    ours.weight.data.copy_(weight)
    theirs.weight.data.copy_(weight)
    x, residual = torch.randn(7, 48), torch.randn(7, 48)
    torch.testing.assert_close(ours(x), theirs(x))
    normed, new_residual = ours(x, residual)
    torch.testing.assert_close(new_residual, x + residual)
    torch.testing.assert_close(normed, theirs(x + residual))
