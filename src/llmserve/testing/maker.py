"""Random-weight HF checkpoints for tests, demos and benchmarks (no download needed).

`make_model(arch, shape, out_dir)` writes config.json (transformers' config classes),
model.safetensors (sharded above 4 GB; seeded, deterministic), a byte-level BPE tokenizer whose vocab
covers every id, a ChatML chat template and generation_config.json. Parameter names and shapes are
those of transformers' *ForCausalLM, built on the meta device, so nothing big is ever initialised twice.
The shapes are in model/shapes.py, the `llmserve make-model` sub-command in testing/maker_cli.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict

import torch

from llmserve.testing import toy_tokenizer
from llmserve.testing.copying import COPYING_ARCHS, copying_plan, copying_tensor
from llmserve.model.shapes import ARCHS, DTYPE_NAMES, MLA_ARCHS, MOE_ARCHS, SHAPES, Shape

_DTYPES = {name: getattr(torch, name) for name in DTYPE_NAMES}
_SHARD_BYTES = 4 * 2**30


def _config_class(arch: str):
    import transformers
    names = {"llama": "LlamaConfig", "mistral": "MistralConfig", "qwen2": "Qwen2Config", "qwen3": "Qwen3Config",
             "qwen3_moe": "Qwen3MoeConfig", "mixtral": "MixtralConfig", "gpt_oss": "GptOssConfig",
             "phi3": "Phi3Config", "gemma3": "Gemma3TextConfig", "deepseek_v2": "DeepseekV2Config",
             "deepseek_v3": "DeepseekV3Config"}
    return getattr(transformers, names[arch])


def _model_class(arch: str):
    import transformers
    names = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
             "qwen3": "Qwen3ForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM", "mixtral": "MixtralForCausalLM",
             "gpt_oss": "GptOssForCausalLM", "phi3": "Phi3ForCausalLM", "gemma3": "Gemma3ForCausalLM",
             "deepseek_v2": "DeepseekV2ForCausalLM", "deepseek_v3": "DeepseekV3ForCausalLM"}
    return getattr(transformers, names[arch])


def _head_dim(arch: str, shape: Shape) -> int:
    if shape.mla is not None:  # DeepSeek's configs: the rotary's width (transformers' rotary reads head_dim)
        return shape.mla.qk_rope_head_dim
    if shape.head_dim is not None:
        return shape.head_dim
    default = shape.hidden_size // shape.num_heads
    return 2 * default if arch == "qwen3" and shape.hidden_size <= 64 else default


def build_config(arch: str, shape: Shape, dtype: str):
    """The transformers config of a shape; sliding window off (gpt_oss, gemma3: the shape's), eos = <|im_end|>.

    rope_theta/rope_scaling are passed the pre-5.0 way, which transformers 5 folds into rope_parameters.
    """
    kwargs = dict(
        vocab_size=shape.vocab_size, hidden_size=shape.hidden_size, intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers, num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads, max_position_embeddings=shape.max_position,
        tie_word_embeddings=shape.is_tied, rope_theta=shape.rope_theta,
        rope_scaling=shape.rope_scaling, rms_norm_eps=shape.rms_norm_eps,
        initializer_range=shape.init_std, head_dim=_head_dim(arch, shape), bos_token_id=None,
        eos_token_id=toy_tokenizer.SPECIAL_TOKENS.index(toy_tokenizer.EOS_TOKEN),
        pad_token_id=toy_tokenizer.SPECIAL_TOKENS.index(toy_tokenizer.PAD_TOKEN),
        architectures=[_model_class(arch).__name__])
    if arch in ("mistral", "mixtral", "phi3"):
        kwargs["sliding_window"] = None
    if arch == "phi3":  # Phi3Config's own field wins over the rope dict's
        kwargs["original_max_position_embeddings"] = (shape.rope_scaling or {}).get(
            "original_max_position_embeddings", shape.max_position)
    if arch == "gemma3":  # the published configs: scores scaled by head_dim ** -0.5, local rope base 10,000
        kwargs.update(sliding_window=shape.sliding_window, query_pre_attn_scalar=kwargs["head_dim"],
                      rope_local_base_freq=10000.0)
    if arch in MOE_ARCHS:
        kwargs.update(num_experts_per_tok=shape.num_experts_per_tok, **_moe_kwargs(arch, shape))
    config = _config_class(arch)(**kwargs)
    config.dtype = dtype
    return config


def _moe_kwargs(arch: str, shape: Shape) -> dict:
    if arch == "mixtral":
        return {"num_local_experts": shape.num_experts}
    if arch == "gpt_oss":
        return {"num_local_experts": shape.num_experts, "sliding_window": shape.sliding_window}
    if arch in MLA_ARCHS:  # the MLA shape's fields are the config's own names; V2 limits to groups when it has some
        fields = {"n_routed_experts": shape.num_experts, "moe_intermediate_size": shape.moe_intermediate_size,
                  **asdict(shape.mla)}
        if arch == "deepseek_v2":
            fields.update(topk_method="group_limited_greedy" if shape.mla.n_group > 1 else "greedy",
                          norm_topk_prob=False)
        return fields
    return {"num_experts": shape.num_experts, "moe_intermediate_size": shape.moe_intermediate_size,
            "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": []}


# transformers holds the experts stacked ([E, 2I, H], [E, H, I]) and save_pretrained writes one tensor per
# expert; Mixtral's under `block_sparse_moe.` as w1 (gate), w3 (up), w2 (down)
_EXPERT_NAMES = {"qwen3_moe": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "mixtral": ("block_sparse_moe", "w1", "w3", "w2"),
                 "deepseek_v2": ("mlp", "gate_proj", "up_proj", "down_proj"),
                 "deepseek_v3": ("mlp", "gate_proj", "up_proj", "down_proj")}


def _per_expert_specs(arch: str, name: str, shape: tuple[int, ...]) -> list[tuple[str, tuple[int, ...]]]:
    """A state-dict tensor as the checkpoint names it: per-expert tensors for the stacked experts."""
    if arch not in _EXPERT_NAMES or ".mlp.gate." not in name and ".mlp.experts." not in name:
        return [(name, shape)]
    block, gate, up, down = _EXPERT_NAMES[arch]
    prefix = name.split(".mlp.")[0] + f".{block}."
    if ".mlp.gate." in name:  # the router's weight (and DeepSeek-V3's e_score_correction_bias)
        return [(prefix + name.split(".mlp.")[1], shape)]
    num_experts, rows, cols = shape
    if name.endswith("experts.gate_up_proj"):
        return [(f"{prefix}experts.{e}.{part}.weight", (rows // 2, cols)) for e in range(num_experts)
                for part in (gate, up)]
    return [(f"{prefix}experts.{e}.{down}.weight", (rows, cols)) for e in range(num_experts)]


def _param_specs(arch: str, config) -> list[tuple[str, tuple[int, ...]]]:
    """(HF name, shape) of every tensor the checkpoint holds, in state-dict order."""
    with torch.device("meta"):
        model = _model_class(arch)(config)
    names = [spec for n, t in model.state_dict().items() for spec in _per_expert_specs(arch, n, tuple(t.shape))]
    if config.tie_word_embeddings:
        names = [(n, s) for n, s in names if n != "lm_head.weight"]
    return names


def _random_tensor(name: str, shape: tuple[int, ...], std: float, gen: torch.Generator) -> torch.Tensor:
    """Norm weights near 1, everything else (weights, biases) normal(0, std); float32."""
    mean, scale = (1.0, 0.1) if name.endswith("norm.weight") else (0.0, std)
    return torch.empty(shape, dtype=torch.float32).normal_(mean, scale, generator=gen)


def _peak(tensor: torch.Tensor) -> torch.Tensor:
    """The lm_head's rows scaled by 3 * lognormal(0, 1) (their own generator, seed 0): the top logit then
    usually leads the second by several logit standard deviations, where plain random weights leave
    near-ties that rounding flips (bf16 against f32, a 5-token verification against a decode step)."""
    row_scale = torch.exp(torch.randn(tensor.shape[0], 1, generator=torch.Generator().manual_seed(0)))
    return tensor * (3 * row_scale)


def _head_name(config) -> str:
    return "model.embed_tokens.weight" if config.tie_word_embeddings else "lm_head.weight"


def _plan_shards(specs: list[tuple[str, tuple[int, ...]]], itemsize: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    shards: list[list] = [[]]
    size = 0
    for name, shape in specs:
        nbytes = itemsize * int(torch.Size(shape).numel())
        if shards[-1] and size + nbytes > _SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def _tensor_maker(config, shape: Shape, seed: int, dtype: torch.dtype, weights: str):
    """(name, shape) -> the checkpoint's tensor: random (`_peak`ed lm_head where weights == "peaked"),
    or the copying circuit's (testing/copying.py) where weights == "copying"; drawn in state-dict order."""
    gen = torch.Generator().manual_seed(seed)
    peaked = _head_name(config) if weights == "peaked" else None
    plan = copying_plan(config, seed) if weights == "copying" else None

    def make(name: str, tensor_shape: tuple[int, ...]) -> torch.Tensor:
        tensor = _random_tensor(name, tensor_shape, shape.init_std, gen)
        if name == peaked:
            tensor = _peak(tensor)
        if plan is not None:
            tensor = copying_tensor(plan, name, tensor)
        return tensor.to(dtype)

    return make


def _write_weights(out_dir: str, arch: str, config, shape: Shape, seed: int, dtype: torch.dtype,
                   weights: str) -> None:
    from safetensors.torch import save_file
    make = _tensor_maker(config, shape, seed, dtype, weights)
    shards = _plan_shards(_param_specs(arch, config), torch.finfo(dtype).bits // 8)
    weight_map, total = {}, 0
    for i, shard in enumerate(shards):
        file = "model.safetensors" if len(shards) == 1 else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        tensors = {n: make(n, s) for n, s in shard}
        save_file(tensors, os.path.join(out_dir, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
    if len(shards) > 1:
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)


def _write_generation_config(out_dir: str) -> None:
    ids = [toy_tokenizer.SPECIAL_TOKENS.index(t) for t in (toy_tokenizer.EOS_TOKEN, toy_tokenizer.PAD_TOKEN)]
    config = {"eos_token_id": ids, "pad_token_id": ids[1], "do_sample": True, "temperature": 0.7,
              "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(config, f, indent=2)


def write_checkpoint(arch: str, shape: Shape, out_dir: str, seed: int = 0, dtype: str = "float32",
                     is_peaked: bool = False, is_copying: bool = False, has_weights: bool = True) -> str:
    """Write a random checkpoint of an explicit Shape into out_dir (created if needed); is_peaked: the
    lm_head's rows rescaled (`_peak`) so that greedy decoding has clear winners; is_copying: layers 0
    and 1 an induction circuit (testing/copying.py), so the model continues spans its context repeats;
    has_weights=False: the config, tokenizer and generation config only (for `--load-format dummy`)."""
    if arch not in ARCHS:
        raise ValueError(f"unknown arch {arch!r}; choose one of {', '.join(ARCHS)}")
    if dtype not in _DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {', '.join(_DTYPES)}")
    if shape.is_moe != (arch in MOE_ARCHS):
        kind = "a Mixture-of-Experts" if arch in MOE_ARCHS else "a dense"
        raise ValueError(f"arch {arch!r} needs {kind} shape; MoE shapes: {', '.join(moe_shapes())}")
    if (shape.mla is not None) != (arch in MLA_ARCHS):
        raise ValueError(f"latent-attention shapes ({', '.join(n for n, s in SHAPES.items() if s.mla)}) are for "
                         f"{', '.join(MLA_ARCHS)}; got arch {arch!r}")
    if is_copying and (is_peaked or arch not in COPYING_ARCHS):
        raise ValueError(f"copying weights are for {', '.join(COPYING_ARCHS)}, without peaked logits "
                         f"(their logits are peaked by construction); got arch {arch!r}")
    os.makedirs(out_dir, exist_ok=True)
    config = build_config(arch, shape, dtype)
    config.save_pretrained(out_dir)
    weights = "copying" if is_copying else "peaked" if is_peaked else "random"
    if has_weights:
        _write_weights(out_dir, arch, config, shape, seed, _DTYPES[dtype], weights)
    toy_tokenizer.save_tokenizer(out_dir, shape.vocab_size, shape.max_position)
    _write_generation_config(out_dir)
    return out_dir


def moe_shapes() -> list[str]:
    return [name for name, shape in SHAPES.items() if shape.is_moe]


def make_model(arch: str, shape: str, out_dir: str, seed: int = 0, dtype: str = "float32",
               quantization: str | None = None, is_peaked: bool = False, is_copying: bool = False,
               has_weights: bool = True) -> str:
    """Write a random-weight HF checkpoint of a named shape (see SHAPES) into out_dir; returns out_dir.

    quantization: None, or an FP8 format of model/quant/checkpoint.py (fp8: transformers' 128x128 block
    scales; fp8-channel: compressed-tensors per-channel scales)."""
    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; choose one of {', '.join(SHAPES)}")
    if not has_weights and (quantization or is_peaked or is_copying):
        raise ValueError("--no-weights writes no weights to quantize, peak or wire: drop --quantization, "
                         "--peaked-logits and --copying")
    write_checkpoint(arch, SHAPES[shape], out_dir, seed, dtype, is_peaked, is_copying, has_weights)
    if quantization is not None:
        from llmserve.model.quant.checkpoint import write_fp8_checkpoint

        write_fp8_checkpoint(out_dir, quantization)
    return out_dir
