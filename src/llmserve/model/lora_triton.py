"""LoRA's products as two Triton kernels (CUDA; on CPU through Triton's interpreter, for the tests).

Per adapter token t with slot s (`LoRAStep`): shrink h[t] = x[t] @ A[s]^T over every sub-projection's R rows,
then expand out[t, off_j:off_j + out_j] += h[t, jR:(j+1)R] @ B^T_j[s] (B^T stored [S, R, out_j]). One program a token (and a tile of
the shrunk or output features), its slot read from memory: BGMV's form, for decode and prompt tokens alike
(a token's row of `out` is written by its own programs only, so no atomics). Accumulates in float32.
A token of slot -1 (the base model's, in a decode graph's padded step: `LoRAStep.is_padded`) is skipped: its
programs' loads and stores are masked off, so they touch no memory.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from llmserve.model.lora_layers import LoRAStep


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, token_ptr, slot_ptr, h_ptr, K, R_ALL, stride_x, stride_as, stride_ar, stride_h,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0)
    token = tl.load(token_ptr + t)
    slot = tl.load(slot_ptr + t)
    # the base model's token (slot -1): bounds of 0, so every load and store is masked off
    k_end, r_end = tl.where(slot >= 0, K, 0), tl.where(slot >= 0, R_ALL, 0)
    slot = tl.maximum(slot, 0)
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)  # [BLOCK_R] rows of A
    acc = tl.zeros([BLOCK_R], dtype=tl.float32)
    for k0 in range(0, k_end, BLOCK_K):  # no iteration for the base model's token
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + token * stride_x + k, mask=k < k_end, other=0.0).to(tl.float32)  # [BLOCK_K]
        a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                    mask=(r[:, None] < r_end) & (k[None, :] < k_end), other=0.0).to(tl.float32)  # [BLOCK_R, BLOCK_K]
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(h_ptr + t * stride_h + r, acc, mask=r < r_end)


@triton.jit
def _expand_kernel(h_ptr, b_ptr, token_ptr, slot_ptr, out_ptr, N, R, h_offset, out_offset, stride_h, stride_bs,
                   stride_br, stride_o, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0)
    token = tl.load(token_ptr + t)
    slot = tl.load(slot_ptr + t)
    # the base model's token (slot -1): bounds of 0, so every load and store is masked off
    n_end, r_end = tl.where(slot >= 0, N, 0), tl.where(slot >= 0, R, 0)
    slot = tl.maximum(slot, 0)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)  # [BLOCK_N] output features of this sub-projection
    r = tl.arange(0, BLOCK_R)
    h = tl.load(h_ptr + t * stride_h + h_offset + r, mask=r < r_end, other=0.0)  # [BLOCK_R] float32
    b = tl.load(b_ptr + slot * stride_bs + n[:, None] + r[None, :] * stride_br,
                mask=(n[:, None] < n_end) & (r[None, :] < r_end), other=0.0).to(tl.float32)  # [BLOCK_N, BLOCK_R]
    delta = tl.sum(b * h[None, :], axis=1)  # [BLOCK_N]
    dest = out_ptr + token * stride_o + out_offset + n
    old = tl.load(dest, mask=n < n_end, other=0.0)
    tl.store(dest, (old.to(tl.float32) + delta).to(old.dtype), mask=n < n_end)


def add_lora_triton(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor], step: LoRAStep,
                    block_k: int = 64, block_n: int = 64) -> None:
    """out [T, out] += each adapter token's LoRA (x [T, in], A [S, n_sub * R, in], B^T_j [S, R, out_j])."""
    num_tokens, rank = len(step.token_indices), bs[0].shape[1]
    if num_tokens == 0:
        return
    assert x.stride(1) == 1 and out.stride(1) == 1 and a.is_contiguous(), "rows must be contiguous"
    r_all = a.shape[1]
    block_r = triton.next_power_of_2(min(r_all, 64))
    shrunk = torch.empty(num_tokens, r_all, dtype=torch.float32, device=x.device)  # [N, n_sub * R]
    _shrink_kernel[(num_tokens, triton.cdiv(r_all, block_r))](
        x, a, step.token_indices, step.token_slots, shrunk, x.shape[1], r_all, x.stride(0), a.stride(0),
        a.stride(1), shrunk.stride(0), BLOCK_R=block_r, BLOCK_K=block_k)
    offset = 0
    for j, b in enumerate(bs):
        assert b.is_contiguous()
        size = b.shape[2]
        _expand_kernel[(num_tokens, triton.cdiv(size, block_n))](
            shrunk, b, step.token_indices, step.token_slots, out, size, rank, j * rank, offset, shrunk.stride(0),
            b.stride(0), b.stride(1), out.stride(0), BLOCK_N=block_n, BLOCK_R=triton.next_power_of_2(rank))
        offset += size
