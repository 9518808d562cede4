"""Flash decoding for the Triton attention kernels (model/triton_kernels.py, model/mla_triton.py): a decode step
with few programs splits each row's keys into parts attended apart (a third grid axis), each part's softmax kept
unnormalised in a float32 buffer, and `combine_splits` merges them. The number of parts follows the step's shape
only (rows, heads: model/split_keys.py), so a captured CUDA graph keeps it.

The partial buffer is [T, H, S, D_PAD + 2] float32: per token, head and split the weighted sum of values [D_PAD],
then the running max (log2 units, scaled) and the denominator.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


def partial_buffer(num_tokens: int, num_heads: int, num_splits: int, d_pad: int, device: torch.device) -> torch.Tensor:
    """[T, H, S, D_PAD + 2] float32 for the splits' sums, maxima and denominators."""
    return torch.empty(num_tokens, num_heads, num_splits, d_pad + 2, dtype=torch.float32, device=device)


@triton.jit
def _combine_splits_kernel(out_ptr, partial_ptr, sinks_ptr, v_scale, stride_ot, stride_oh, NUM_HEADS: tl.constexpr,
                           NUM_SPLITS: tl.constexpr, DIM: tl.constexpr, D_PAD: tl.constexpr,
                           HAS_SINKS: tl.constexpr):
    """One (token, head): the splits' partial softmaxes merged (each rescaled to the common max); a sink adds
    exp(sink) to the denominator."""
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, NUM_SPLITS)
    offs_d = tl.arange(0, D_PAD)
    base = ((token * NUM_HEADS + head) * NUM_SPLITS + offs_s) * (D_PAD + 2)  # [S]
    m = tl.load(partial_ptr + base + D_PAD)  # [S] (log2 units, scaled)
    l_s = tl.load(partial_ptr + base + D_PAD + 1)  # [S]
    m_max = tl.max(m, 0)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_safe)  # [S]; an empty split: 0
    acc = tl.load(partial_ptr + base[:, None] + offs_d[None, :])  # [S, D]
    total = tl.sum(l_s * weight, 0)
    if HAS_SINKS:
        total += tl.exp2(tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634 - m_safe)
    out = tl.sum(acc * weight[:, None], 0) * v_scale / tl.where(total == 0.0, 1.0, total)  # [D]
    tl.store(out_ptr + token * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty),
             mask=offs_d < DIM)


def combine_splits(out: torch.Tensor, partial: torch.Tensor, dim: int, sinks: torch.Tensor | None = None,
                   v_scale: float = 1.0) -> None:
    """out [T, H, dim] (dim contiguous) from partial [T, H, S, D_PAD + 2]; sinks [H] float32 or None."""
    num_tokens, num_heads, num_splits, width = partial.shape
    _combine_splits_kernel[(num_tokens, num_heads)](
        out, partial, partial if sinks is None else sinks, v_scale, out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, NUM_SPLITS=num_splits, DIM=dim, D_PAD=width - 2, HAS_SINKS=sinks is not None)
