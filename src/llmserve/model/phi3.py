"""Phi-3 / Phi-4 text (`Phi3ForCausalLM`) checkpoints, run by the shared decoder (model/llama.py).

transformers' Phi-3 is Llama's decoder with the projections fused in the checkpoint: `self_attn.qkv_proj`
[(H + 2 Hkv) D, hidden] (q rows, then k, then v) and `mlp.gate_up_proj` [2I, hidden] (gate rows, then up:
`gate, up = chunk(2)`), the decoder's own layouts, so the tensors load under their names unchanged. The rest
is read from the config elsewhere: every layer slides over `sliding_window` when the config has one
(model/sliding_window.py, as Mistral), LongRoPE and partial rotary (`rope_params_from_config`, model/layers.py).
Dropouts (`resid_pdrop`, `embd_pdrop`, `attention_dropout`) are training-only.

What would run wrongly is refused here, naming the field.
"""

from __future__ import annotations

ARCHITECTURE = "Phi3ForCausalLM"


def check_config(config, tensor_parallel_size: int) -> None:
    """ValueError naming the config field (or setting) this decoder does not run for Phi-3."""
    hidden_act = getattr(config, "hidden_act", "silu")
    if hidden_act != "silu":
        raise ValueError(f"hidden_act={hidden_act!r} is not supported for {ARCHITECTURE} (silu)")
    if tensor_parallel_size > 1:
        raise ValueError(f"tensor parallelism is not supported for {ARCHITECTURE} yet: its fused qkv_proj and "
                         "gate_up_proj checkpoint tensors are not cut per rank")
