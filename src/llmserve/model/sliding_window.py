"""Each decoder layer's sliding window, read from an HF config the way transformers reads it.

Mistral (and Phi-3) applies `sliding_window` to every layer. Qwen2 and Qwen3 slide only where `layer_types` says
"sliding_attention" (transformers fills `layer_types` from `use_sliding_window` and `max_window_layers`:
layers i >= max_window_layers slide, and none without use_sliding_window); the same rule is applied here
to a config object that lacks `layer_types`. gpt-oss slides where `layer_types` says (by default every other
layer, from the first); Gemma 3 where `layer_types` says (by default five of every six). Llama's modeling
reads no window, so neither do we.

A window of 0 means full attention; so does a window at least as long as the context (it hides nothing).
Values transformers would not run, or that would run differently here, are refused naming the field.
"""

from __future__ import annotations

from llmserve.model import gemma3, gpt_oss

_LAYER_TYPES = ("full_attention", "sliding_attention")
_READS_LAYER_TYPES = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", gpt_oss.ARCHITECTURE, gemma3.ARCHITECTURE)


def layer_windows(config, architecture: str, max_model_len: int) -> list[int]:
    """[num_hidden_layers] ints: each layer's window (0 = full attention) for a context of max_model_len."""
    num_layers = config.num_hidden_layers
    window = _config_window(config, architecture)
    if window == 0 or window >= max_model_len:
        return [0] * num_layers
    if architecture not in _READS_LAYER_TYPES:
        _check_no_full_layers(config)
        return [window] * num_layers
    return [window if kind == "sliding_attention" else 0 for kind in _layer_types(config, num_layers, architecture)]


def _config_window(config, architecture: str) -> int:
    """The config's window (0: none, or an architecture whose modeling reads none)."""
    window = getattr(config, "sliding_window", None)
    if architecture == "LlamaForCausalLM" or window is None or getattr(config, "use_sliding_window", True) is False:
        return 0
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"sliding_window must be a positive integer or null; got {window!r}")
    return window


def _layer_types(config, num_layers: int, architecture: str) -> list[str]:
    """config.layer_types, checked; when the config has none, gpt-oss's alternation or Qwen2's rule from
    max_window_layers."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None and architecture == gpt_oss.ARCHITECTURE:
        return gpt_oss.default_layer_types(num_layers)
    if layer_types is None and architecture == gemma3.ARCHITECTURE:
        return gemma3.default_layer_types(config)
    if layer_types is None:
        first_sliding = getattr(config, "max_window_layers", 0) or 0
        return ["sliding_attention" if i >= first_sliding else "full_attention" for i in range(num_layers)]
    unknown = sorted(set(layer_types) - set(_LAYER_TYPES))
    if unknown:
        raise ValueError(f"layer_types: unsupported kinds {unknown}; supported: {', '.join(_LAYER_TYPES)}")
    if len(layer_types) != num_layers:
        raise ValueError(f"layer_types has {len(layer_types)} entries for {num_layers} layers (num_hidden_layers)")
    return list(layer_types)


def _check_no_full_layers(config) -> None:
    """Mistral's modeling slides every layer whatever layer_types says: a config mixing kinds is ambiguous."""
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and set(layer_types) != {"sliding_attention"}:
        raise ValueError("layer_types: MistralForCausalLM slides every layer (transformers ignores layer_types "
                         "there); a mix of sliding and full layers is not supported for this architecture")
