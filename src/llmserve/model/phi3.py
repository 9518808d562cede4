"""Phi-3 / Phi-4 text (`Phi3ForCausalLM`) checkpoints, run by the shared decoder (model/llama.py).

transformers' Phi-3 is Llama's decoder with the projections fused in the checkpoint: `self_attn.qkv_proj`
[(H + 2 Hkv) D, hidden] (q rows, then k, then v) and `mlp.gate_up_proj` [2I, hidden] (gate rows, then up:
`gate, up = chunk(2)`), the decoder's own layouts. `to_decoder_layout` cuts them into q/k/v and gate/up parts,
which load as any Llama checkpoint's (a tensor-parallel rank keeps its heads' and features' slices). The rest
is read from the config elsewhere: every layer slides over `sliding_window` when the config has one
(model/sliding_window.py, as Mistral), LongRoPE and partial rotary (`rope_params_from_config`, model/layers.py).
Dropouts (`resid_pdrop`, `embd_pdrop`, `attention_dropout`) are training-only.

What would run wrongly is refused here, naming the field.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from llmserve.model.parallel import ShardLayout, shard_of

ARCHITECTURE = "Phi3ForCausalLM"


def check_config(config) -> None:
    """ValueError naming the config field this decoder does not run for Phi-3."""
    hidden_act = getattr(config, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act={hidden_act!r} is not supported for {ARCHITECTURE} (silu)")


def to_decoder_layout(weights: Iterable[tuple[str, torch.Tensor]], config,
                      layout: ShardLayout | None) -> Iterator[tuple[str, torch.Tensor]]:
    """HF tensors with `qkv_proj` cut into q_proj, k_proj, v_proj and `gate_up_proj` into gate_proj, up_proj
    (each narrowed to the rank's slice under `layout`, as `shard_of` names it); the rest unchanged."""
    for name, tensor in weights:
        prefix, _, kind = name.rpartition(".")
        module_prefix, _, module = prefix.rpartition(".")
        parts = _fused_parts(module, config)
        if parts is None:
            yield name, tensor
            continue
        for part_name, part in zip(parts, tensor.split([size for _, size in parts.items()], dim=0)):
            full_name = f"{module_prefix}.{part_name}.{kind}"
            spec = None if layout is None else shard_of(full_name, layout)
            yield full_name, part if spec is None else part.narrow(*spec)


def _fused_parts(module: str, config) -> dict[str, int] | None:
    """{part: rows} of a fused projection, in the checkpoint's order; None for another module."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if module == "qkv_proj":
        kv_size = config.num_key_value_heads * head_dim
        return {"q_proj": config.num_attention_heads * head_dim, "k_proj": kv_size, "v_proj": kv_size}
    if module == "gate_up_proj":
        return {"gate_proj": config.intermediate_size, "up_proj": config.intermediate_size}
    return None
