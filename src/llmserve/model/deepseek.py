"""DeepSeek-V2 and V3 (`DeepseekV2ForCausalLM`, `DeepseekV3ForCausalLM`): their parts of the shared decoder.

Read as transformers' modeling_deepseek_v2 / _v3 compute them:
- attention is Multi-head Latent Attention (model/mla.py): the cache holds one compressed latent per token;
- the first `first_k_dense_replace` layers have a dense MLP, the others an MoE block (model/moe.py) with
  `n_shared_experts` shared experts (one gated MLP of n_shared_experts * moe_intermediate_size) beside
  the routed ones;
- routing (`route_grouped`): V3 scores experts with a sigmoid, chooses by score + `e_score_correction_bias`
  within the `topk_group` best of `n_group` groups (a group's score: its best two experts' sum), renormalises
  the chosen scores (`norm_topk_prob`) and scales them by `routed_scaling_factor`; V2 takes a softmax, then
  a greedy top-k (`topk_method` greedy) or one limited to the best groups by their best expert
  (group_limited_greedy), scaled alike;
- the rope part of q and k turns in interleaved pairs (V2 always, V3 with `rope_interleave`): the checkpoint's
  rope rows are reordered at load (evens, then odds), after which the decoder's rotate-half rotary computes
  exactly what transformers' interleaved one does (`to_decoder_layout`);
- YaRN (`rope_scaling` type yarn) scales cos/sin by its attention factor (mscale / mscale_all_dim), and the
  softmax scale by mscale(factor, mscale_all_dim) squared (`softmax_scale`).
Multi-token-prediction layers in the checkpoint (`num_nextn_predict_layers`: model.layers.{num_hidden_layers}.*)
are skipped, as transformers skips them; what this decoder does not run is refused at load (`check_config`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import torch

from llmserve.model.moe import MoeSpec

V2 = "DeepseekV2ForCausalLM"
V3 = "DeepseekV3ForCausalLM"
ARCHITECTURES = (V2, V3)

# field -> the values this decoder runs, per architecture (absent fields take the first)
_SUPPORTED = {
    V3: {"hidden_act": ("silu",), "scoring_func": ("sigmoid",), "topk_method": ("noaux_tc",), "moe_layer_freq": (1,)},
    V2: {"hidden_act": ("silu",), "scoring_func": ("softmax",), "topk_method": ("greedy", "group_limited_greedy"),
         "moe_layer_freq": (1,), "mlp_bias": (False,),
         # transformers' DeepseekV2 never renormalises (the original code did, when set): refused, not guessed
         "norm_topk_prob": (False, None)},
}


def check_config(config, architecture: str) -> None:
    """ValueError naming the first config field (or setting) this decoder does not run for DeepSeek."""
    for field, supported in _SUPPORTED[architecture].items():
        value = getattr(config, field, supported[0])
        if value is not None and value not in supported:
            raise ValueError(f"{field}={value!r} is not supported for {architecture} "
                             f"(supported: {', '.join(map(repr, supported))})")
    num_experts, num_groups = config.n_routed_experts, _num_groups(config)
    if num_experts % num_groups:
        raise ValueError(f"n_group={num_groups} must divide n_routed_experts={num_experts}")
    if architecture == V3 and num_experts // num_groups < 2:
        raise ValueError(f"n_group={num_groups} leaves fewer than 2 experts per group (a V3 group scores its best two)")
    if not 0 < (config.topk_group or 1) <= num_groups:
        raise ValueError(f"topk_group={config.topk_group} must be in 1..n_group={num_groups}")
    if not 0 < config.num_experts_per_tok <= num_experts:
        raise ValueError(f"num_experts_per_tok={config.num_experts_per_tok} must be in 1..{num_experts} "
                         "(n_routed_experts)")


def shared_intermediate_size(config) -> int:
    """The shared experts' MLP width (0: none)."""
    return config.moe_intermediate_size * (config.n_shared_experts or 0)


def mla_head_dims(config) -> tuple[int, int, int]:
    """Per head: q_proj's (q_b_proj's) rows, kv_b_proj's rows, o_proj's inputs (tensor-parallel cuts)."""
    return (config.qk_nope_head_dim + config.qk_rope_head_dim, config.qk_nope_head_dim + config.v_head_dim,
            config.v_head_dim)


def _num_groups(config) -> int:
    return config.n_group or 1


def _uses_groups(config, architecture: str) -> bool:
    """V3 always limits to its groups; V2 only with topk_method group_limited_greedy."""
    return architecture == V3 or getattr(config, "topk_method", "greedy") == "group_limited_greedy"


def moe_spec(config, architecture: str) -> MoeSpec:
    """The MoE settings of a DeepSeek config (check_config first)."""
    is_v3 = architecture == V3
    grouped = _uses_groups(config, architecture)
    return MoeSpec(num_experts=config.n_routed_experts, top_k=config.num_experts_per_tok,
                   intermediate_size=config.moe_intermediate_size,
                   is_renormalized=bool(config.norm_topk_prob) and is_v3,
                   dense_layers=tuple(range(config.first_k_dense_replace or 0)),
                   scoring="sigmoid" if is_v3 else "softmax", has_correction_bias=is_v3,
                   num_groups=_num_groups(config) if grouped else 1,
                   num_topk_groups=(config.topk_group or 1) if grouped else 1,
                   group_score="top2_sum" if is_v3 else "max",
                   routed_scaling_factor=float(config.routed_scaling_factor or 1.0),
                   shared_intermediate_size=shared_intermediate_size(config),
                   is_router_float32=True)  # as transformers keeps it: a bf16 correction bias moves the choice


def _rope_settings(config) -> dict:
    return {**(getattr(config, "rope_scaling", None) or {}), **(getattr(config, "rope_parameters", None) or {})}


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def softmax_scale(config) -> float:
    """qk_head_dim ** -0.5, times mscale(factor, mscale_all_dim) ** 2 under a scaled rope that sets
    mscale_all_dim (transformers' `yarn_apply_mscale`)."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    rope = _rope_settings(config)
    rope_type = rope.get("rope_type", rope.get("type", "default")) or "default"
    if rope_type != "default" and rope.get("mscale_all_dim"):
        scale *= _yarn_mscale(rope["factor"], rope["mscale_all_dim"]) ** 2
    return scale


def is_rope_interleaved(config, architecture: str) -> bool:
    return architecture == V2 or bool(getattr(config, "rope_interleave", True))


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers" and parts[2].isdigit():
        return int(parts[2])
    return None


def _evens_then_odds(tensor: torch.Tensor, start: int, dim: int) -> torch.Tensor:
    """tensor with its entries [start:] along dim reordered: the even ones, then the odd ones."""
    size = tensor.shape[dim] - start
    order = torch.cat([torch.arange(start), start + torch.arange(0, size, 2), start + torch.arange(1, size, 2)])
    return tensor.index_select(dim, order)


def _deinterleave_rope_rows(name: str, tensor: torch.Tensor, config) -> torch.Tensor:
    """The rows producing q's and k's rope features, evens first: [x0, x2, .., x1, x3, ..]."""
    if name.endswith(("self_attn.q_b_proj.weight", "self_attn.q_proj.weight")):
        head_rows = config.qk_nope_head_dim + config.qk_rope_head_dim
        per_head = tensor.view(-1, head_rows, tensor.shape[-1])  # [H (a rank's), nope + rope, in]
        return _evens_then_odds(per_head, config.qk_nope_head_dim, dim=1).reshape(tensor.shape)
    if name.endswith(("self_attn.kv_a_proj_with_mqa.weight", "self_attn.kv_a_proj_with_mqa.bias")):
        return _evens_then_odds(tensor, config.kv_lora_rank, dim=0)
    return tensor


def to_decoder_layout(weights: Iterable[tuple[str, torch.Tensor]], config,
                      architecture: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as the decoder holds them: multi-token-prediction layers dropped, interleaved
    rope rows reordered (both q's and k's alike: their dot products, and so the attention, are unchanged)."""
    is_interleaved = is_rope_interleaved(config, architecture)
    for name, tensor in weights:
        index = _layer_index(name)
        if index is not None and index >= config.num_hidden_layers:
            continue
        yield name, _deinterleave_rope_rows(name, tensor, config) if is_interleaved else tensor
