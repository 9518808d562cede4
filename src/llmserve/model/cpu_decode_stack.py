"""All decoder layers of a CPU decode step in one C++ call (csrc/decode_stack.cpp).

At a few decode rows a layer's ten ops cost more in Python (module calls, wrappers, the dispatcher) than some of
them compute; the stack runs the same kernels in the same order from C++, so a step's outputs do not change, only
its time (docs/benchmarks.md, "One C++ call for the decoder layers"). It takes Llama-family layers (RMSNorm, fused
qkv with optional bias, Qwen3's per-head q/k norms, rotary over the whole head, paged attention without sinks, a
SiLU gated MLP; of a Mixture-of-Experts model its MoE layers too where model/cpu_stack_moe.py takes them all, else
the attention halves, one call a layer, its MLPs run in Python between them) whose linears are float32 panels or
bfloat16 GEMV weights (model/linear.py; past the GEMV's 4 rows, F.linear's ATen call as in the Python layers), one
tensor-parallel rank, and steps whose rows are all the attention kernel's; anything else keeps the Python layers.
Where every MLP is in the stack it also runs the step's embedding, rotary, final norm and logits if it can
(model/cpu_decode_head.py): the whole forward one call. LLMSERVE_CPU_DECODE_STACK=0 turns it off.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from llmserve.model import cpu_build, cpu_decode_head, cpu_kernels, cpu_stack_moe
from llmserve.model.attn_torch import TorchAttentionMetadata
from llmserve.model.layers import GatedMLP, RMSNorm
from llmserve.model.linear import Linear

logger = logging.getLogger(__name__)

ENV = "LLMSERVE_CPU_DECODE_STACK"
BF16_GEMV, PANELS_AVX2, PANELS_AVX512 = 0, 1, 2  # the stack's linear kinds (csrc/decode_stack.cpp)


def is_enabled() -> bool:
    """LLMSERVE_CPU_DECODE_STACK unset or truthy; 0 (false, no, off) keeps the Python layers."""
    return not cpu_build.is_switched_off(ENV)


class DecodeStack:
    """The C++ stack of a model's layers and the rule for which steps it takes. With `mlps` (a Mixture-of-Experts
    model whose MoE layers the stack does not take) it holds the layers' attention halves only, and each layer's
    MLP runs in Python between two calls."""

    def __init__(self, stack, dtype: torch.dtype, mlps: list[nn.Module] | None = None, has_head: bool = False):
        self.stack = stack  # torch.classes.llmserve_cpu.DecodeStack
        self.dtype = dtype
        self.mlps = mlps
        self.has_head = has_head  # the embedding, rotary, final norm and logits too (`step`)
        self.kept_layers: tuple[int, ...] = ()  # layers whose inputs a forward keeps (`keep_inputs`)
        self.kept: dict[int, torch.Tensor] = {}  # with the MLPs in Python: the last forward's

    def takes(self, attn_metadata: object, kv_cache: torch.Tensor) -> bool:
        """Whether a step runs here: every row is the attention kernel's (no torch groups),
        one metadata for all layers, and a cache the kernels read."""
        return (isinstance(attn_metadata, TorchAttentionMetadata) and attn_metadata.kernel is not None
                and not attn_metadata.groups and _cache_fits(self.dtype, kv_cache))

    def forward(self, x: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor], kv_caches: list[torch.Tensor],
                attn_metadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] (the embeddings) -> (hidden, residual) [T, hidden] before the final norm."""
        kernel = attn_metadata.kernel
        step = (attn_metadata.slot_mapping, kernel.block_table, kernel.seq_lens, kernel.query_start_loc, kernel.rows)
        if self.mlps is None:
            return self.stack.forward(x, cos_sin[0], cos_sin[1], kv_caches, *step)
        residual, self.kept = None, {}
        for index, (mlp, kv_cache) in enumerate(zip(self.mlps, kv_caches, strict=True)):
            if index in self.kept_layers:  # a copy: the next call writes both in place
                self.kept[index] = x.clone() if residual is None else x + residual
            x, residual = self.stack.attention(index, x, residual, cos_sin[0], cos_sin[1], kv_cache, *step)
            x = mlp(x)
        return x, residual

    def keep_inputs(self, layers: tuple[int, ...]) -> None:
        """From now on each forward keeps these layers' inputs (residual streams), for an EAGLE-3 head."""
        self.kept_layers = layers
        if self.mlps is None:
            self.stack.keep_inputs(list(layers))

    def kept_inputs(self) -> dict[int, torch.Tensor]:
        """{layer: [T, hidden]} of the last forward (or step): the inputs `keep_inputs` named."""
        if self.mlps is not None:
            return self.kept
        return dict(zip(self.kept_layers, self.stack.kept_inputs()))


    def step(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], attn_metadata,
             logits_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The whole forward in one call (`has_head`): input_ids, positions [T] int64, logits_indices [N] int64 ->
        (hidden [T, hidden] after the final norm, the rows' logits [N, vocab] float32)."""
        kernel = attn_metadata.kernel
        return self.stack.step(input_ids, positions, kv_caches, attn_metadata.slot_mapping, kernel.block_table,
                               kernel.seq_lens, kernel.query_start_loc, kernel.rows, logits_indices)


def _cache_fits(dtype: torch.dtype, kv_cache: torch.Tensor) -> bool:
    """The caches the fused write_kv and the attention kernel both take: the model's dtype, or float16/int8 under a
    float32 model."""
    allowed = (torch.float32, torch.float16, torch.int8) if dtype == torch.float32 else (dtype,)
    return kv_cache.dtype in allowed and kv_cache.is_contiguous() and kv_cache.device.type == "cpu"


def build(model: nn.Module) -> DecodeStack | None:
    """The stack of a loaded CausalLM's layers, or None where it does not apply (see the module docstring)."""
    dtype = model.model.embed_tokens.weight.dtype
    if not (is_enabled() and _is_plain_decoder(model) and dtype in cpu_kernels.FUSED_DTYPES
            and model.model.embed_tokens.weight.device.type == "cpu" and cpu_kernels.available()):
        return None
    kind = _linear_kind(dtype)
    layers = model.model.layers
    has_mlps = model.parts.moe is None  # an MoE model's MLPs (experts and dense) stay Python modules
    if kind is None or not all(_takes_layer(layer, kind, has_mlps) for layer in layers):
        return None
    attn = layers[0].self_attn
    stack = torch.classes.llmserve_cpu.DecodeStack(attn.num_heads, attn.num_kv_heads, attn.head_dim,
                                                   layers[0].input_layernorm.eps, attn.scale, kind, has_mlps)
    for layer in layers:
        attn = layer.self_attn
        q_norm, k_norm = (None, None) if attn.q_norm is None else (attn.q_norm.weight, attn.k_norm.weight)
        stack.add_layer(layer.input_layernorm.weight, layer.post_attention_layernorm.weight, attn.window, q_norm, k_norm)
        for linear in _linears(layer, has_mlps):
            weight = linear.weight if kind == BF16_GEMV else linear.packed_weight
            stack.add_linear(weight, linear.bias, linear.out_features)
    if not has_mlps and not _adds_moe_layers(stack, layers, kind):
        built = DecodeStack(stack, dtype, [layer.mlp for layer in layers])
    else:
        built = DecodeStack(stack, dtype, has_head=cpu_decode_head.set_head(stack, model, kind == BF16_GEMV))
    built.keep_inputs(model.aux_layers)
    return built


def _adds_moe_layers(stack, layers: nn.ModuleList, kind: int) -> bool:
    """Put an MoE model's MLPs into the stack where model/cpu_stack_moe.py takes every layer's; False (and why,
    logged) where they stay Python modules between the attention halves."""
    reason = cpu_stack_moe.decline_reason(layers, kind != BF16_GEMV)
    if reason is not None:
        logger.info("decoder stack: the MoE layers run in Python between the stack's calls (%s)", reason)
        return False
    cpu_stack_moe.add_moe_layers(stack, layers)
    return True


def _is_plain_decoder(model: nn.Module) -> bool:
    """One rank, Llama-family parts: RMSNorm (and Qwen3's q/k norms), a gated SiLU MLP or MoE; no sinks, MLA,
    sandwich norms, embedding scale or partial rotary."""
    parts = model.parts
    rotary = model.rotary.get("default")
    return (model.tp is None and not parts.is_mla and not parts.has_sinks
            and not parts.has_sandwich_norms and parts.embed_scale is None
            and parts.norm is RMSNorm and parts.dense_mlp is GatedMLP and len(model.rotary) == 1
            and rotary is not None and rotary.params.partial_rotary_factor == 1.0)


def _linear_kind(dtype: torch.dtype) -> int | None:
    """How this model's linears run at decode rows: the bfloat16 GEMV, or float32 panels in AVX2 or AVX-512
    registers (as `cpu_kernels.packed_linear` would pick)."""
    if dtype == torch.bfloat16:
        return BF16_GEMV if cpu_kernels.has_bf16_gemv() else None
    if not cpu_kernels.has_avx2_kernels():
        return None
    return PANELS_AVX512 if cpu_kernels.panel_isa() == "AVX-512" else PANELS_AVX2


def _linears(layer: nn.Module, has_mlp: bool = True) -> tuple[Linear, ...]:
    attn = layer.self_attn
    return (attn.qkv_proj, attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj) if has_mlp else \
        (attn.qkv_proj, attn.o_proj)


def _takes_layer(layer: nn.Module, kind: int, has_mlp: bool) -> bool:
    """Plain modules (not LoRA-wrapped or quantized) whose weights the stack's linear kind reads."""
    linears = _linears(layer, has_mlp) if not has_mlp or type(layer.mlp) is GatedMLP else None
    if linears is None or not all(type(linear) is Linear for linear in linears):
        return False
    if kind == BF16_GEMV:
        return all(linear.is_gemv_weight for linear in linears)
    return all(linear.packed_weight is not None and linear.packed_weight.dim() == 3 for linear in linears)
