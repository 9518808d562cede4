"""Architecture registry: HF `architectures[0]` name -> model class.

`SUPPORTED_ARCHITECTURES` feeds CLI `choices=` and error messages.
"""

from __future__ import annotations

from torch import nn

from llmserve.model.llama import CausalLM

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": CausalLM,
    "MistralForCausalLM": CausalLM,
    "Qwen2ForCausalLM": CausalLM,
    "Qwen3ForCausalLM": CausalLM,
    "Qwen3MoeForCausalLM": CausalLM,
    "MixtralForCausalLM": CausalLM,
    "GptOssForCausalLM": CausalLM,
    "Phi3ForCausalLM": CausalLM,
    "Gemma3ForCausalLM": CausalLM,
    "DeepseekV2ForCausalLM": CausalLM,
    "DeepseekV3ForCausalLM": CausalLM,
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(_MODELS)

# A bare decoder's name (a checkpoint saved from transformers' AutoModel, as embedding models are: weights
# without the `model.` prefix, no lm_head) -> the causal LM whose decoder it is.
BARE_DECODERS: dict[str, str] = {"LlamaModel": "LlamaForCausalLM", "MistralModel": "MistralForCausalLM",
                                 "Qwen2Model": "Qwen2ForCausalLM", "Qwen3Model": "Qwen3ForCausalLM"}


def get_model_class(architecture: str) -> type[nn.Module]:
    """The class implementing an HF architecture name; ValueError naming the supported ones."""
    cls = _MODELS.get(architecture)
    if cls is None:
        raise ValueError(f"unsupported model architecture {architecture!r}; "
                         f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return cls


def architecture_of(config) -> str:
    """config.architectures[0], or a ValueError when the config names none."""
    archs = getattr(config, "architectures", None)
    if not archs:
        raise ValueError(f"config.json names no architecture; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return archs[0]
