"""gpt-oss (`GptOssForCausalLM`) checkpoints, read into the shared decoder's layout.

The decoder (model/llama.py) runs gpt-oss with its parts: q/k/v/o biases, one learned attention sink per
head (`self_attn.sinks`), sliding and full layers alternating as `layer_types` says (model/sliding_window.py),
YaRN rope (model/layers.py) and an MoE block in every layer whose router and experts carry biases and whose
experts use a clamped SwiGLU (model/moe.py).

What differs is the checkpoint's layout of the experts, as transformers writes it: `mlp.router.{weight,bias}`,
and the experts stacked and transposed, `mlp.experts.gate_up_proj` [E, H, 2I] with gate and up interleaved
(gate in the even columns, up in the odd ones), `gate_up_proj_bias` [E, 2I] interleaved alike, `down_proj`
[E, I, H]. `to_decoder_layout` turns those into the MoE block's `mlp.gate`, [E, 2I, H] (gate rows, then
up rows), [E, 2I] and [E, H, I] as they stream in.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

ARCHITECTURE = "GptOssForCausalLM"


def default_layer_types(num_layers: int) -> list[str]:
    """transformers' layer_types when the config has none: sliding first, then alternating with full."""
    return ["sliding_attention" if i % 2 == 0 else "full_attention" for i in range(num_layers)]


def _deinterleave(tensor: torch.Tensor, dim: int) -> torch.Tensor:
    """[..., 2I, ...] with gate/up alternating along dim -> the I gate entries, then the I up entries."""
    size = tensor.shape[dim]
    order = torch.cat([torch.arange(0, size, 2), torch.arange(1, size, 2)])  # [2I]: even, then odd
    return tensor.index_select(dim, order)


def _to_decoder_tensor(name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor]:
    """One checkpoint tensor -> (the decoder's name, its tensor in the decoder's layout)."""
    name = name.replace(".mlp.router.", ".mlp.gate.")
    if name.endswith("mlp.experts.gate_up_proj"):  # [E, H, 2I] interleaved -> [E, 2I, H] gate, then up
        return name, _deinterleave(tensor.transpose(1, 2), dim=1)
    if name.endswith("mlp.experts.gate_up_proj_bias"):  # [E, 2I] interleaved -> gate, then up
        return name, _deinterleave(tensor, dim=1)
    if name.endswith("mlp.experts.down_proj"):  # [E, I, H] -> [E, H, I]
        return name, tensor.transpose(1, 2).contiguous()
    return name, tensor


def to_decoder_layout(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's (name, tensor) pairs renamed and laid out as the decoder's MoE block holds them."""
    for name, tensor in weights:
        yield _to_decoder_tensor(name, tensor)
