"""A CPU decode step's prologue and epilogue in the decoder stack's call (csrc/decode_head.h): the embedding lookup
and rotary cos/sin before the layers, the final norm and the sampled rows' logits after them, so a decode step's
forward is one C++ call (`DecodeStack.step`). The same values as CausalLM.forward and compute_logits (the same
bits; cos/sin read from a table of the rotary's own values at load). A head it cannot run as they do (an untied
lm_head not a plain `Linear`, a tied float32 table not packed in panels, soft-capped logits, a bfloat16 table the
GEMV does not take) keeps them in Python around the layers' call.
"""

from __future__ import annotations

import torch
from torch import nn

from llmserve.model.linear import Linear, gemv_takes

MAX_TABLE_POSITIONS = 32768  # rotary cos/sin rows kept for the stack (4 MB a table at head_dim 64 in float32);
                             # later positions are computed each step


def set_head(stack, model: nn.Module, is_bf16: bool) -> bool:
    """Give the C++ stack the model's embedding, rotary, final norm and head; False (nothing given) where the head
    is not one it runs as the Python model does."""
    head = _head_weight(model, is_bf16)
    embed = model.model.embed_tokens
    norm = model.model.norm
    if head is None or type(embed) is not nn.Embedding or not embed.weight.is_contiguous():
        return False
    rotary = model.rotary["default"]
    cos, sin = rotary.cos_sin(torch.arange(min(model.max_model_len, MAX_TABLE_POSITIONS)), embed.weight.dtype)
    stack.set_head(embed.weight, rotary._inv_freq_cpu, float(rotary.params.attention_scaling), cos.squeeze(1),
                   sin.squeeze(1), norm.weight, norm.eps, head, model.config.vocab_size)
    return True


def _head_weight(model: nn.Module, is_bf16: bool) -> torch.Tensor | None:
    """The logits' weight as compute_logits reads it at decode rows: bfloat16 [vocab, hidden] for the GEMV, float32
    panels [P, hidden, 16] for the panel kernels; None where compute_logits runs another path."""
    if not model.has_lm_head or model.parts.logit_softcap is not None or model.tp is not None:
        return None
    if model.lm_head is None:  # tied
        table = model.model.embed_tokens.weight
        if is_bf16:
            return table if gemv_takes(table) else None
        packed = model.tied_head_packed
        return packed if packed is not None and packed.dim() == 3 else None
    head = model.lm_head
    if type(head) is not Linear or head.bias is not None:
        return None
    if is_bf16:
        return head.weight if head.is_gemv_weight else None
    return head.packed_weight if head.packed_weight is not None and head.packed_weight.dim() == 3 else None
