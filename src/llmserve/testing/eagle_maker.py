"""Random EAGLE and EAGLE-3 draft heads for a target checkpoint, in the layout published heads have (tests and
benchmarks: a head's cost and the proposer's bookkeeping; random weights accept few drafts).

EAGLE: `fc` (2H -> H, with a bias) and decoder layers `layers.{i}.*` whose first has no input_layernorm. EAGLE-3:
`fc` (3H -> H), one layer `midlayer.*` whose attention reads 2H (with `hidden_norm`), `norm`, `lm_head` over
`draft_vocab_size` ids and `d2t` (target id = draft id + d2t[draft id]). Neither holds an embedding (the target's
is shared); the config is the target's Llama config with the head's fields.
"""

from __future__ import annotations

import json
import os

import torch

_STD = 0.02  # transformers' initializer_range


def make_eagle_head(target_dir: str, out_dir: str, method: str, seed: int = 0, num_layers: int = 1,
                    draft_vocab_size: int | None = None, aux_layer_ids: list[int] | None = None) -> str:
    """Write a random `method` ("eagle" | "eagle3") head for the target in `target_dir` into out_dir."""
    from safetensors.torch import save_file

    with open(os.path.join(target_dir, "config.json")) as f:
        config = json.load(f)
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_size, kv_size = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    inter = config["intermediate_size"]

    def rand(*shape: int) -> torch.Tensor:
        return (torch.randn(shape, generator=gen) * _STD).contiguous()

    def norm() -> torch.Tensor:
        return 1.0 + 0.1 * torch.randn(hidden, generator=gen)

    def layer(prefix: str, attn_in: int, has_input_norm: bool = True) -> dict[str, torch.Tensor]:
        tensors = {f"{prefix}.self_attn.q_proj.weight": rand(q_size, attn_in),
                   f"{prefix}.self_attn.k_proj.weight": rand(kv_size, attn_in),
                   f"{prefix}.self_attn.v_proj.weight": rand(kv_size, attn_in),
                   f"{prefix}.self_attn.o_proj.weight": rand(hidden, q_size),
                   f"{prefix}.mlp.gate_proj.weight": rand(inter, hidden),
                   f"{prefix}.mlp.up_proj.weight": rand(inter, hidden),
                   f"{prefix}.mlp.down_proj.weight": rand(hidden, inter),
                   f"{prefix}.post_attention_layernorm.weight": norm()}
        if has_input_norm:
            tensors[f"{prefix}.input_layernorm.weight"] = norm()
        return tensors

    if method == "eagle":
        tensors = {"fc.weight": rand(hidden, 2 * hidden), "fc.bias": rand(hidden)}
        for i in range(num_layers):
            tensors.update(layer(f"layers.{i}", hidden, has_input_norm=i > 0))
        config.update(num_hidden_layers=num_layers, architectures=["LlamaForCausalLMEagle"])
    elif method == "eagle3":
        draft_vocab = draft_vocab_size or vocab
        tensors = {"fc.weight": rand(hidden, 3 * hidden), "norm.weight": norm(),
                   "lm_head.weight": rand(draft_vocab, hidden), **layer("midlayer", 2 * hidden),
                   "midlayer.hidden_norm.weight": norm()}
        if draft_vocab < vocab:
            ids = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values  # [Vd] target ids, ascending
            tensors["d2t"] = ids - torch.arange(draft_vocab)
            tensors["t2d"] = torch.zeros(vocab, dtype=torch.bool).index_fill_(0, ids, True)
        config.update(num_hidden_layers=1, architectures=["LlamaForCausalLMEagle3"], draft_vocab_size=draft_vocab)
        if aux_layer_ids is not None:
            config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layer_ids}
    else:
        raise ValueError(f"method must be eagle or eagle3, got {method!r}")
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    dtype = getattr(torch, config.get("torch_dtype") or config.get("dtype") or "float32")
    tensors = {name: t.to(dtype) if t.is_floating_point() else t for name, t in tensors.items()}
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    return out_dir
