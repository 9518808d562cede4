"""One decoder implementation for Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE, Mixtral, gpt-oss, Phi-3, Gemma 3 and
DeepSeek-V2/V3 checkpoints.

Tokens of all requests of a step are flattened ([T], no batch dim); attention goes through an
AttentionBackend and the paged KV cache. The variants differ only in the parts read from the HF config
(`DecoderParts`): Qwen2 has a q/k/v bias, Qwen3 and Qwen3-MoE RMS-normalise q and k per head, Llama may
carry `attention_bias` and `mlp_bias`, head_dim comes from the config when it has one, a Mixture-of-Experts
architecture puts a SparseMoeBlock (model/moe.py) in place of the dense MLP of its sparse layers, and gpt-oss
adds a learned attention sink per head (its checkpoint's layout: model/gpt_oss.py); Phi-3's fused checkpoint
tensors are the decoder's own (model/phi3.py). Gemma 3 brings its own norms, MLP activation, embedding scale,
logit soft-cap and local/global rope tables (model/gemma3.py). DeepSeek-V2/V3 put Multi-head Latent Attention
(model/mla.py) in place of the attention, whose cache holds one latent per token (`kv_cache_shape`), and an MoE
block with shared experts and grouped routing (model/deepseek.py).

Sliding-window attention (Mistral, Qwen2/Qwen3 with use_sliding_window, gpt-oss, Gemma 3): each layer's window comes
from the config (model/sliding_window.py) and is passed to the backend with the layer's attention call (with
its sinks, if any); a window at least as long as the context (max_model_len, default max_position_embeddings)
is full attention.

With tensor parallelism (`tp`, model/parallel.py) every layer holds this rank's heads, intermediate
features and vocabulary rows (of every expert too, or with expert parallelism its whole experts:
model/moe_parallel.py); the loader hands `load_weights` those slices of the checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.model import deepseek, gemma3, gpt_oss, mla, phi3
from llmserve.model.attention import AttentionBackend
from llmserve.model.layers import (GatedMLP, RMSNorm, RopeParams, RotaryEmbedding, apply_rotary,
                                   rope_params_from_config)
from llmserve.model.linear import Linear, can_pack, linear, packed, packed_linear
from llmserve.model.moe import MoeSpec, SparseMoeBlock, moe_spec_from_config
from llmserve.model.moe_load import ExpertLoadReader
from llmserve.model.moe_names import expert_shard_view, expert_shards
from llmserve.model.moe_parallel import is_stacked_expert, shard_stacked, to_local_experts
from llmserve.model.parallel import (ShardLayout, TensorParallel, VocabParallelEmbedding, column_linear, row_linear,
                                     shard_layout)
from llmserve.model.sliding_window import layer_windows
from llmserve.model.weight_names import SHARDS_OF, map_hf_name


def _head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


@dataclass(frozen=True)
class DecoderParts:
    """What differs between the architectures this decoder reads: attention biases, q/k norm, sinks, MoE layers."""

    qkv_bias: bool
    o_bias: bool
    has_qk_norm: bool
    moe: MoeSpec | None = None  # None: every layer has a dense MLP
    has_sinks: bool = False  # one learned logit per head in the attention softmax's denominator
    norm: type[nn.Module] = RMSNorm  # Gemma 3: (1 + w) in float32
    dense_mlp: type[nn.Module] = GatedMLP  # Gemma 3: GeLU-tanh
    has_sandwich_norms: bool = False  # Gemma 3: norms after attention and around the MLP too
    embed_scale: float | None = None  # Gemma 3: embeddings times sqrt(hidden)
    logit_softcap: float | None = None  # Gemma 3: cap * tanh(logits / cap)
    is_mla: bool = False  # DeepSeek: Multi-head Latent Attention over a latent cache


_QK_NORM_ARCHS = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


def decoder_parts(config) -> DecoderParts:
    """The parts of config.architectures[0] (Llama when the config names none); ValueError on a field the
    MoE layer does not implement."""
    arch = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
    has_attention_bias = bool(getattr(config, "attention_bias", False))
    is_qwen2 = arch == "Qwen2ForCausalLM"
    fields = dict(has_qk_norm=arch in _QK_NORM_ARCHS)
    if arch == gemma3.ARCHITECTURE:
        fields.update(gemma3.parts_fields(config))
    if arch in deepseek.ARCHITECTURES:
        deepseek.check_config(config, arch)
        fields.update(moe=deepseek.moe_spec(config, arch), is_mla=True)
    else:
        fields.update(moe=moe_spec_from_config(config, arch))
    return DecoderParts(qkv_bias=is_qwen2 or has_attention_bias, o_bias=has_attention_bias and not is_qwen2,
                        has_sinks=arch == gpt_oss.ARCHITECTURE, **fields)


class Attention(nn.Module):
    """Fused qkv projection, optional per-head q/k norm, rotary, paged attention, output projection.

    window: the layer's sliding window (0 = full attention), set by CausalLM from the config.
    """

    def __init__(self, config, parts: DecoderParts, tp: TensorParallel | None = None,
                 layout: ShardLayout | None = None):
        super().__init__()
        self.num_heads = config.num_attention_heads if layout is None else layout.q_heads[1]  # this rank's
        self.num_kv_heads = config.num_key_value_heads if layout is None else layout.kv_heads[1]
        self.head_dim = _head_dim(config)
        self.scale = (getattr(config, "query_pre_attn_scalar", None) or self.head_dim) ** -0.5
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.qkv_proj = column_linear(config.hidden_size, self.q_size + 2 * self.kv_size, parts.qkv_bias, tp)
        self.o_proj = row_linear(self.q_size, config.hidden_size, parts.o_bias, tp)
        self.q_norm = parts.norm(self.head_dim, config.rms_norm_eps) if parts.has_qk_norm else None
        self.k_norm = parts.norm(self.head_dim, config.rms_norm_eps) if parts.has_qk_norm else None
        self.sinks = nn.Parameter(torch.empty(self.num_heads)) if parts.has_sinks else None  # [H]
        self.window = 0  # attends the last `window` keys (0: all); CausalLM sets it per layer

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_cache: torch.Tensor,
                attn_metadata: object, attn_backend: AttentionBackend) -> torch.Tensor:
        """x [T, hidden] -> [T, hidden]."""
        num_tokens = x.shape[0]
        num_qk_heads = self.num_heads + self.num_kv_heads
        qkv = self.qkv_proj(x).view(num_tokens, num_qk_heads + self.num_kv_heads, self.head_dim)  # [T, H + 2Hkv, D]
        q, k = self._rotate_qk(qkv[:, :num_qk_heads], cos_sin)  # [T, H, D], [T, Hkv, D]
        v = qkv[:, num_qk_heads:]  # [T, Hkv, D], a strided view like k: the backends copy both into the cache
        sinks = None if self.sinks is None else self.sinks.float()  # [H]
        out = attn_backend.forward(q, k, v, kv_cache, attn_metadata, self.scale, window=self.window,
                                   sinks=sinks)  # [T, H, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))

    def _rotate_qk(self, qk: torch.Tensor, cos_sin) -> tuple[torch.Tensor, torch.Tensor]:
        """qk [T, H + Hkv, D] -> rotated q [T, H, D], k [T, Hkv, D] (views of one tensor without q/k norm:
        one rotary over both halves)."""
        if self.q_norm is None:
            qk = apply_rotary(qk, *cos_sin)
            return qk[:, :self.num_heads], qk[:, self.num_heads:]  # slices: cheaper than Tensor.split's Python
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        return apply_rotary(self.q_norm(q), *cos_sin), apply_rotary(self.k_norm(k), *cos_sin)


def _feed_forward(config, parts: DecoderParts, index: int, tp: TensorParallel | None,
                  layout: ShardLayout | None) -> nn.Module:
    """Layer `index`'s MLP: the MoE block on a sparse layer, else the dense gated MLP."""
    if parts.moe is not None and parts.moe.is_sparse_layer(index):
        if layout is None:
            return SparseMoeBlock(config.hidden_size, parts.moe, tp)
        return SparseMoeBlock(config.hidden_size, parts.moe, tp, layout.expert_intermediate[1], layout.experts,
                              layout.shared_intermediate[1])
    intermediate = config.intermediate_size if layout is None else layout.intermediate[1]
    return parts.dense_mlp(config.hidden_size, intermediate, getattr(config, "mlp_bias", False), tp)


class DecoderLayer(nn.Module):
    def __init__(self, config, parts: DecoderParts, index: int, tp: TensorParallel | None = None,
                 layout: ShardLayout | None = None):
        super().__init__()
        self.self_attn = mla.MlaAttention(config, tp, layout) if parts.is_mla else Attention(config, parts, tp, layout)
        self.mlp = _feed_forward(config, parts, index, tp, layout)
        self.input_layernorm = parts.norm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = parts.norm(config.hidden_size, config.rms_norm_eps)
        sandwich = parts.has_sandwich_norms  # post_attention_layernorm then norms the attention's output alone
        self.pre_feedforward_layernorm = parts.norm(config.hidden_size, config.rms_norm_eps) if sandwich else None
        self.post_feedforward_layernorm = parts.norm(config.hidden_size, config.rms_norm_eps) if sandwich else None

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, cos_sin, kv_cache: torch.Tensor,
                attn_metadata: object, attn_backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """(x, residual) [T, hidden] -> (mlp output, residual before it); residual None on layer 0."""
        if residual is None:
            residual, x = x, self.input_layernorm(x)
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, cos_sin, kv_cache, attn_metadata, attn_backend)
        if self.pre_feedforward_layernorm is None:
            x, residual = self.post_attention_layernorm(x, residual)
            return self.mlp(x), residual
        x, residual = self.pre_feedforward_layernorm(self.post_attention_layernorm(x), residual)
        return self.post_feedforward_layernorm(self.mlp(x)), residual


class DecoderModel(nn.Module):
    """Embedding, decoder layers, final norm (HF's `model.` prefix)."""

    def __init__(self, config, parts: DecoderParts, tp: TensorParallel | None = None,
                 layout: ShardLayout | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size) if tp is None else \
            VocabParallelEmbedding(layout, config.hidden_size, tp)
        self.layers = nn.ModuleList(DecoderLayer(config, parts, i, tp, layout)
                                    for i in range(config.num_hidden_layers))
        self.norm = parts.norm(config.hidden_size, config.rms_norm_eps)


class CausalLM(nn.Module):
    """Llama-family causal LM over flattened tokens and a paged KV cache.

    Build it from an HF config (the architecture's parts come from config.architectures[0]),
    then `load_weights`. Tied embeddings reuse model.embed_tokens.weight for the logits.
    """

    def __init__(self, config, max_model_len: int | None = None, tp: TensorParallel | None = None,
                 has_lm_head: bool = True):
        """has_lm_head=False: an embedding model (--runner pooling), which reads hidden states only: no
        head is built, and a checkpoint's head (if any) is skipped."""
        super().__init__()
        self.config = config
        self.has_lm_head = has_lm_head
        self.parts = decoder_parts(config)
        self.tp = tp if tp is not None and tp.size > 1 else None
        self.layout = None if self.tp is None else \
            shard_layout(config, self.tp.size, self.tp.rank, self.tp.is_expert_parallel)
        self.max_model_len = max_model_len or config.max_position_embeddings
        self.architecture = (getattr(config, "architectures", None) or ["LlamaForCausalLM"])[0]
        if self.architecture == phi3.ARCHITECTURE:
            phi3.check_config(config)
        if self.architecture in deepseek.ARCHITECTURES:
            deepseek.check_config(config, self.architecture)
        windows = layer_windows(config, self.architecture, self.max_model_len)  # before building: fails fast
        self.model = DecoderModel(config, self.parts, self.tp, self.layout)
        for layer, window in zip(self.model.layers, windows, strict=True):
            layer.self_attn.window = window
        # one rotary table per rope kind (Gemma 3: local and global); each layer reads its kind's
        self.rotary = {kind: RotaryEmbedding(_rotary_head_dim(config, self.parts), params) for kind, params
                       in _rope_params_by_kind(config, self.architecture, self.max_model_len).items()}
        self.rope_kinds = gemma3.layer_kinds(config) if len(self.rotary) > 1 else ["default"] * len(windows)
        self.is_tied = bool(getattr(config, "tie_word_embeddings", False))
        vocab_rows = config.vocab_size if self.layout is None else self.layout.vocab[1]
        self.lm_head = None if self.is_tied or not has_lm_head else Linear(config.hidden_size, vocab_rows, bias=False)
        # A tied head's table packed for the CPU GEMM (pack_tied_lm_head); a plain attribute, not a buffer:
        # weight counts (cpu_threads, roofline) count the table once
        self.tied_head_packed: torch.Tensor | None = None
        self.decode_stack = None  # CPU decode steps' layers in one C++ call, set once the model is final (worker)
        self.aux_layers: tuple[int, ...] = ()  # EAGLE-3 (model/eagle.py): layers whose input a forward keeps
        self.aux_hidden: dict[int, torch.Tensor] = {}  # layer -> [T, hidden]: its input (residual stream), last forward
        self.expert_load_reader = ExpertLoadReader()
        self.num_layers = config.num_hidden_layers
        self.num_kv_heads = config.num_key_value_heads if self.layout is None else self.layout.kv_heads[1]
        self.head_dim = _head_dim(config)

    @property
    def is_moe(self) -> bool:
        """Whether some layers are Mixture-of-Experts."""
        return self.parts.moe is not None

    def has_host_syncs(self) -> bool:
        """Whether a forward waits for the device on the host (no CUDA graphs then): MoE layers do, unless their
        experts run as grouped GEMMs on this device and dtype (model/moe_grouped.py) without all-to-all dispatch
        (whose split sizes the host reads: model/moe_dispatch.py)."""
        probe = self.model.embed_tokens.weight[:1]  # [1, hidden] in the model's device and dtype
        return not all(block.runs_grouped_gemm(probe) and not block.is_all_to_all for block in self.moe_blocks())

    def moe_blocks(self) -> list[SparseMoeBlock]:
        """The MoE layers' blocks, in layer order (none for a dense model)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def take_expert_balance(self) -> float | None:
        """MoE layers' tokens per expert over the steps since the last call, max over mean, averaged over the
        layers (model/moe_load.py); None for a dense model or when nothing ran."""
        return self.expert_load_reader.take([block.load for block in self.moe_blocks()])

    def pack_tied_lm_head(self) -> bool:
        """Keep a packed copy of a tied table for the logits (float32 CPU, one rank: model/linear.py)."""
        table = self.model.embed_tokens.weight
        if not (self.is_tied and self.has_lm_head and self.lm_head is None and self.tp is None and can_pack(table)):
            return False
        self.tied_head_packed = packed(table)
        return True

    def kv_cache_shape(self, num_blocks: int, block_size: int) -> tuple[int, ...]:
        """Shape of one layer's cache: [2, num_blocks, block_size, num_kv_heads, head_dim]; with MLA
        [1, num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim] (mla.cache_shape)."""
        if self.parts.is_mla:
            return mla.cache_shape(num_blocks, block_size, self.config.kv_lora_rank, self.config.qk_rope_head_dim)
        return (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                attn_metadata: object, attn_backend: AttentionBackend) -> torch.Tensor:
        """input_ids, positions [T] int64 -> hidden [T, hidden] (after the final norm).

        attn_metadata is what attn_backend.build_metadata returned for this step, or a list of one a layer (KV
        cache groups give each group's layers their own block table: core/kv_cache_groups.py).
        """
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.parts.embed_scale is not None:
            x = gemma3.scale_embeddings(x, self.parts.embed_scale)
        cos_sin = {kind: rotary.cos_sin(positions, x.dtype) for kind, rotary in self.rotary.items()}  # 2 x [T, 1, D/2]
        stack = self.decode_stack
        if stack is not None and stack.takes(attn_metadata, kv_caches[0]):
            x, residual = stack.forward(x, cos_sin["default"], kv_caches, attn_metadata)
            self.aux_hidden = stack.kept_inputs() if self.aux_layers else {}
        else:
            x, residual = self._run_layers(x, cos_sin, kv_caches, attn_metadata, attn_backend)
        x, _ = self.model.norm(x, residual)
        return x

    def forward_logits(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                       attn_metadata: object, attn_backend: AttentionBackend,
                       logits_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """`forward`, then `compute_logits` of the rows logits_indices [N] picks -> (hidden [T, hidden], logits
        [N, vocab]); a CPU decode step the stack takes with its head is one C++ call (model/cpu_decode_head.py)."""
        stack = self.decode_stack
        if stack is not None and stack.has_head and stack.takes(attn_metadata, kv_caches[0]):
            hidden, logits = stack.step(input_ids, positions, kv_caches, attn_metadata, logits_indices)
            self.aux_hidden = stack.kept_inputs() if self.aux_layers else {}
            return hidden, logits
        hidden = self(input_ids, positions, kv_caches, attn_metadata, attn_backend)
        return hidden, self.compute_logits(hidden[logits_indices])

    def _run_layers(self, x: torch.Tensor, cos_sin: dict, kv_caches: list[torch.Tensor], attn_metadata: object,
                    attn_backend: AttentionBackend) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] through every layer -> (hidden, residual) before the final norm."""
        residual, self.aux_hidden = None, {}
        layer_metadata = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata] * len(kv_caches)
        for index, (layer, kind, kv_cache, metadata) in enumerate(zip(self.model.layers, self.rope_kinds, kv_caches,
                                                                      layer_metadata, strict=True)):
            if index in self.aux_layers:  # a copy: the layers' norms may write in place
                self.aux_hidden[index] = x.clone() if residual is None else x + residual
            x, residual = layer(x, residual, cos_sin[kind], kv_cache, metadata, attn_backend)
        return x, residual

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [N, hidden] -> logits [N, vocab] float32 (soft-capped where the config says)."""
        assert self.has_lm_head, "an embedding model (no lm_head) computes no logits"
        logits = self._head_logits(hidden)
        return logits if self.parts.logit_softcap is None else gemma3.soft_cap(logits, self.parts.logit_softcap)

    def _head_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            if self.lm_head is None:  # tied (a quantized model has its own lm_head: model/quant)
                if self.tied_head_packed is not None:
                    return packed_linear(hidden, self.tied_head_packed, self.config.vocab_size)
                return linear(hidden, self.model.embed_tokens.weight).float()
            return self.lm_head(hidden).float()
        rows = linear(hidden, self.model.embed_tokens.weight) if self.is_tied else self.lm_head.matmul(hidden, None)
        logits = self.tp.all_gather_last(rows)  # each rank's vocabulary rows, in order
        return logits[:, :self.config.vocab_size].float()

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors in (q/k/v and gate/up go into the fused projections, per-expert tensors into
        the stacked ones).

        Raises ValueError on an unknown name or when a parameter got no value.
        """
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        if self.architecture == gpt_oss.ARCHITECTURE:
            weights = gpt_oss.to_decoder_layout(weights)
        if self.architecture in deepseek.ARCHITECTURES:
            weights = deepseek.to_decoder_layout(weights, self.config, self.architecture)
        if self.layout is not None and self.layout.experts is not None:
            weights = to_local_experts(weights, self.layout.experts)  # expert parallelism: this rank's experts
        if self.architecture == phi3.ARCHITECTURE:
            weights = phi3.to_decoder_layout(weights, self.config, self.layout)
        for hf_name, tensor in weights:
            target = map_hf_name(hf_name, self.is_tied or not self.has_lm_head, fuses_qkv=not self.parts.is_mla)
            if target is None:
                continue
            name, shard = target
            if name not in params:
                raise ValueError(f"checkpoint tensor {hf_name!r} has no place in {type(self).__name__}")
            self._copy_shard(params[name], shard, tensor, hf_name)
            loaded.update(self._shard_keys(name) if shard is None else [f"{name}#{shard}"])
        self._check_all_loaded(params, loaded)

    def _copy_shard(self, param: nn.Parameter, shard: str | None, tensor: torch.Tensor, hf_name: str) -> None:
        dest = param.data if shard is None else self._shard_view(param.data, shard)
        if self.layout is not None and shard is None and is_stacked_expert(hf_name):
            tensor = shard_stacked(hf_name, tensor, *self.layout.expert_intermediate)  # read whole
        if self.layout is not None and hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            dest.zero_()  # the last rank's rows past the vocabulary stay zero (padding)
            dest = dest[:tensor.shape[0]]
        if dest.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {hf_name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)

    def _shard_view(self, param: torch.Tensor, shard: str) -> torch.Tensor:
        """The part of a fused parameter that shard fills: q/k/v, gate/up, or an expert's "e{i}:{part}"."""
        if shard.startswith("e"):
            return expert_shard_view(param, shard)
        num_heads = self.config.num_attention_heads if self.layout is None else self.layout.q_heads[1]
        q_size = num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        inter = param.shape[0] // 2  # gate_up_proj: this rank's gate rows, then its up rows
        ranges = {"q": (0, q_size), "k": (q_size, kv_size), "v": (q_size + kv_size, kv_size),
                  "gate": (0, inter), "up": (inter, inter)}
        return param.narrow(0, *ranges[shard])

    def _shard_keys(self, name: str) -> list[str]:
        """The keys that mark parameter `name` filled: its own name, or one per shard of a fused one."""
        num_experts = 0 if self.parts.moe is None else self.parts.moe.num_experts
        if self.layout is not None and self.layout.experts is not None:
            num_experts = self.layout.experts[1]  # the experts this rank holds
        shards = expert_shards(name, num_experts) or SHARDS_OF.get(name.rsplit(".", 2)[-2])
        return [name] if shards is None else [f"{name}#{s}" for s in shards]

    def _check_all_loaded(self, params: dict[str, nn.Parameter], loaded: set[str]) -> None:
        missing = [key for name in params for key in self._shard_keys(name) if key not in loaded]
        if missing == ["lm_head.weight"]:
            raise ValueError("checkpoint has no lm_head: an embedding model? serve it with --runner pooling")
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def _rotary_head_dim(config, parts: DecoderParts) -> int:
    """The features of a head that rotary turns: MLA's rope part (qk_rope_head_dim), else the head."""
    return config.qk_rope_head_dim if parts.is_mla else _head_dim(config)


def _rope_params_by_kind(config, architecture: str, max_model_len: int) -> dict[str, RopeParams]:
    """{rope kind: RopeParams}: Gemma 3's local and global tables, else one ("default"; max_model_len picks
    LongRoPE's factors)."""
    if architecture == gemma3.ARCHITECTURE:
        return gemma3.rope_params_by_kind(config)
    return {"default": rope_params_from_config(config, max_model_len)}
