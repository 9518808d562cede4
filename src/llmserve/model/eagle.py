"""EAGLE draft heads (Li et al., EAGLE 2024 and EAGLE-3 2025): decoder layers that read the target's hidden states.

At position p the head takes the token at p + 1 and a feature of the target at p, and predicts the token at
p + 2; its later drafts take its own output in place of the target's feature.
- EAGLE (`eagle`): the feature is the target's last hidden state (after its final norm), concatenated with the
  token's embedding and projected by `fc` (2H -> H) into decoder layers whose first has no input norm; their
  output (no final norm) goes through the target's lm_head and is also the next draft's feature.
- EAGLE-3 (`eagle3`): the feature is three of the target's residual streams (by default the inputs of layers 2,
  L/2 and L-3; a checkpoint's `eagle_aux_hidden_state_layer_ids` name layer outputs), projected by `fc` (3H -> H).
  The single layer (`midlayer`) norms the embedding and the feature apart and attends over both concatenated (2H
  wide); its output, normed, feeds its own lm_head over a reduced vocabulary (`d2t`: target id = draft id +
  d2t[draft id]), and un-normed it is the next draft's feature.
The embedding (and EAGLE's lm_head) are the target's, shared, unless the checkpoint brings its own.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.model.attention import AttentionBackend
from llmserve.model.layers import RMSNorm, RotaryEmbedding, rope_params_from_config
from llmserve.model.linear import Linear, pack_linears
from llmserve.model.llama import DecoderLayer, DecoderParts
from llmserve.model.loader import iter_safetensors, load_hf_config
from llmserve.model.weight_names import map_hf_name

_SKIPPED = ("t2d",)  # EAGLE-3's target -> draft mask: the proposer needs only d2t
# what a head's hub id downloads: many published heads ship pytorch_model.bin (head_weights)
HUB_PATTERNS = ["config.json", "*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                "pytorch_model.bin.index.json"]


@dataclass(frozen=True)
class EagleShape:
    """What the runner and the proposer need to know of a head before it runs."""

    method: str  # "eagle" | "eagle3"
    feature_size: int  # F: the width of the target's feature a token (H, or 3 H for EAGLE-3)
    aux_layers: tuple[int, ...]  # EAGLE-3: the target layers whose input residual stream is a feature; EAGLE: ()


def eagle_shape(method: str, config, target_config) -> EagleShape:
    """The head's shape from its HF config and the target's; ValueError naming a field it cannot serve."""
    def refuse(name: str, why: str) -> None:
        raise ValueError(f"--speculative {method}: the head's config field {name} {why}")

    if config.vocab_size != target_config.vocab_size:
        refuse("vocab_size", f"({config.vocab_size}) differs from the target's ({target_config.vocab_size})")
    target_hidden = getattr(config, "target_hidden_size", None) or config.hidden_size
    if target_hidden != target_config.hidden_size:
        refuse("target_hidden_size" if hasattr(config, "target_hidden_size") else "hidden_size",
               f"({target_hidden}) differs from the target's hidden_size ({target_config.hidden_size})")
    if getattr(config, "add_para_norm", False):
        refuse("add_para_norm", "(HASS's extra norms) is not supported")
    if getattr(config, "norm_before_residual", False):
        refuse("norm_before_residual", "is not supported")
    if method == "eagle":
        if config.hidden_size != target_config.hidden_size:
            refuse("hidden_size", "must equal the target's")
        return EagleShape(method, config.hidden_size, ())
    eagle_config = getattr(config, "eagle_config", None) or {}
    if eagle_config.get("use_aux_hidden_state", True) is not True:
        refuse("eagle_config.use_aux_hidden_state", "false is not supported")
    if config.num_hidden_layers != 1:
        refuse("num_hidden_layers", f"must be 1 for EAGLE-3, got {config.num_hidden_layers}")
    num_target_layers = target_config.num_hidden_layers
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids") or getattr(config, "eagle_aux_hidden_state_layer_ids",
                                                                          None)
    layers = (2, num_target_layers // 2, num_target_layers - 3) if ids is None else tuple(i + 1 for i in ids)
    if len(layers) != 3 or not all(0 <= i < num_target_layers for i in layers):
        refuse("eagle_aux_hidden_state_layer_ids", f"must name 3 of the target's {num_target_layers} layers but "
               f"its last, got {ids}")
    return EagleShape(method, 3 * target_hidden, layers)


class EagleDraft(nn.Module):
    """The head over flattened tokens and its own paged KV cache (one [2, N, bs, Hkv, D] a layer)."""

    def __init__(self, config, shape: EagleShape, max_model_len: int, has_fc_bias: bool = False) -> None:
        super().__init__()
        self.config, self.shape = config, shape
        self.is_eagle3 = shape.method == "eagle3"
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))
        parts = DecoderParts(qkv_bias=bias, o_bias=bias, has_qk_norm=False)
        self.layers = nn.ModuleList(DecoderLayer(config, parts, i) for i in range(config.num_hidden_layers))
        in_fc = shape.feature_size if self.is_eagle3 else 2 * hidden
        self.fc = Linear(in_fc, hidden, bias=has_fc_bias)
        self.rotary = RotaryEmbedding(self.layers[0].self_attn.head_dim, rope_params_from_config(config, max_model_len))
        self.embed_tokens: nn.Embedding | None = None  # the checkpoint's own, if it has one
        # the target's embedding and (EAGLE) logits, as bound methods: the target's modules stay out of this one's
        self.embed: Callable[[torch.Tensor], torch.Tensor] | None = None
        self.target_logits: Callable[[torch.Tensor], torch.Tensor] | None = None
        if self.is_eagle3:
            attn = self.layers[0].self_attn
            attn.qkv_proj = Linear(2 * hidden, attn.q_size + 2 * attn.kv_size, bias=bias)  # [embedding, feature]
            self.layers[0].hidden_norm = RMSNorm(hidden, config.rms_norm_eps)
            self.norm = RMSNorm(hidden, config.rms_norm_eps)
            self.draft_vocab_size = getattr(config, "draft_vocab_size", None) or config.vocab_size
            self.lm_head = Linear(hidden, self.draft_vocab_size, bias=False)
            self.register_buffer("d2t", None)  # [Vd] int64 offsets, when the checkpoint reduces the vocabulary
        else:
            self.layers[0].input_layernorm = nn.Identity()  # EAGLE's first layer reads fc's output unnormed

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        attn = self.layers[0].self_attn
        return (2, num_blocks, block_size, attn.num_kv_heads, attn.head_dim)

    def share(self, target: nn.Module) -> None:
        """Take the target's embedding where the checkpoint had none, and EAGLE's lm_head (the target's logits)."""
        self.embed = (target.model.embed_tokens if self.embed_tokens is None else self.embed_tokens).forward
        if not self.is_eagle3:
            self.target_logits = target.compute_logits

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, features: torch.Tensor, is_target: bool,
                kv_caches: list[torch.Tensor], attn_metadata: object,
                attn_backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """input_ids, positions [T]; features [T, F] (the target's, is_target) or [T, H] (the head's own output)
        -> (hidden [T, H] for the logits, feature [T, H] for the next draft)."""
        embeds = self.embed(input_ids)  # [T, H]
        cos_sin = self.rotary.cos_sin(positions, embeds.dtype)
        if self.is_eagle3:
            return self._eagle3(embeds, self.fc(features) if is_target else features, cos_sin, kv_caches[0],
                                attn_metadata, attn_backend)
        x, residual = self.fc(torch.cat([embeds, features], dim=-1)), None  # [T, H]
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            x, residual = layer(x, residual, cos_sin, kv_cache, attn_metadata, attn_backend)
        out = x + residual
        return out, out

    def _eagle3(self, embeds: torch.Tensor, feature: torch.Tensor, cos_sin, kv_cache: torch.Tensor,
                attn_metadata: object, attn_backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        layer = self.layers[0]
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(feature)], dim=-1)  # [T, 2H]
        x = layer.self_attn(x, cos_sin, kv_cache, attn_metadata, attn_backend)
        x, residual = layer.post_attention_layernorm(x, feature.clone())  # the sum may be written in place
        return self.norm(layer.mlp(x), residual)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [A, H] -> float32 logits [A, V] over the target's vocabulary (-inf where EAGLE-3's head has none)."""
        if not self.is_eagle3:
            return self.target_logits(hidden)
        kept = self.lm_head(hidden).float()  # [A, Vd]
        if self.d2t is None:
            return kept
        full = kept.new_full((hidden.shape[0], self.config.vocab_size), float("-inf"))  # [A, V]
        full[:, self.target_ids()] = kept
        return full

    def argmax(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [A, H] -> [A] int64: the greedy draft, a target id."""
        if not self.is_eagle3:
            return self.target_logits(hidden).argmax(dim=-1)
        best = self.lm_head(hidden).float().argmax(dim=-1)  # [A] draft ids
        return best if self.d2t is None else best + self.d2t[best]

    def target_ids(self) -> torch.Tensor:
        """[Vd] int64: the target id of each of EAGLE-3's draft ids."""
        return torch.arange(len(self.d2t), device=self.d2t.device) + self.d2t

    def load_weights(self, weights) -> None:
        """The checkpoint's tensors (`midlayer.` is layer 0, an optional `model.` prefix is dropped); ValueError on a
        tensor with no place or a parameter left without one."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for hf_name, tensor in weights:
            name = hf_name.removeprefix("model.").replace("midlayer.", "layers.0.")
            if name in _SKIPPED:
                continue
            if name == "d2t" and self.is_eagle3:
                self.d2t = tensor.to(device=self.fc.weight.device, dtype=torch.int64)
                continue
            if name == "embed_tokens.weight":
                weight = self.fc.weight
                self.embed_tokens = nn.Embedding(*tensor.shape, device=weight.device, dtype=weight.dtype)
                params[name] = self.embed_tokens.weight
            name, shard = map_hf_name(name, skips_head=not self.is_eagle3)
            if name not in params:
                raise ValueError(f"EAGLE checkpoint tensor {hf_name!r} has no place in the {self.shape.method} head")
            dest = params[name].data if shard is None else self._shard_view(params[name].data, shard)
            if dest.shape != tensor.shape:
                raise ValueError(f"EAGLE checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, expected "
                                 f"{tuple(dest.shape)}")
            dest.copy_(tensor)
            loaded.add(name if shard is None else f"{name}#{shard}")
        shards = {"qkv_proj": ("q", "k", "v"), "gate_up_proj": ("gate", "up")}
        needed = [f"{n}#{s}" for n in params for s in shards.get(n.rsplit(".", 2)[-2], ())]
        needed += [n for n in params if n.rsplit(".", 2)[-2] not in shards]
        missing = [n for n in needed if n not in loaded]
        if missing:
            raise ValueError(f"EAGLE checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")

    def _shard_view(self, param: torch.Tensor, shard: str) -> torch.Tensor:
        attn = self.layers[0].self_attn
        half = param.shape[0] // 2
        ranges = {"q": (0, attn.q_size), "k": (attn.q_size, attn.kv_size),
                  "v": (attn.q_size + attn.kv_size, attn.kv_size), "gate": (0, half), "up": (half, half)}
        return param.narrow(0, *ranges[shard])


def load_eagle(path: str, method: str, target: nn.Module, dtype: torch.dtype, device: torch.device,
               max_model_len: int) -> EagleDraft:
    """The head of an HF directory of safetensors, sharing the target's embedding (and EAGLE's logits); EAGLE-3's
    target keeps its feature layers' inputs from now on (`aux_layers`)."""
    config = load_hf_config(path)
    shape = eagle_shape(method, config, target.config)
    weights = head_weights(path)
    with torch.device(device):
        draft = EagleDraft(config, shape, max_model_len, has_fc_bias="fc.bias" in weights).to(dtype)
    with torch.no_grad():
        draft.load_weights(weights.items())
    draft.share(target)
    target.aux_layers = shape.aux_layers
    pack_linears(draft.requires_grad_(False))  # weights, not parameters to train: the CPU path packs them
    return draft.eval()


def head_weights(path: str) -> dict[str, torch.Tensor]:
    """A head's tensors by name (`model.` dropped): its safetensors, else the `pytorch_model*.bin` files many
    published heads ship (read with torch.load's weights_only: tensors only, no pickled code). A head is small
    (one layer), so it is read whole."""
    if glob.glob(os.path.join(path, "*.safetensors")):
        return {name.removeprefix("model."): tensor for name, tensor in iter_safetensors(path)}
    files = sorted(glob.glob(os.path.join(path, "pytorch_model*.bin")))
    if not files:
        raise ValueError(f"no *.safetensors or pytorch_model*.bin weights in the EAGLE head's directory {path!r}")
    weights = {}
    for file in files:
        weights.update({name.removeprefix("model."): tensor
                        for name, tensor in torch.load(file, map_location="cpu", weights_only=True).items()})
    return weights
