"""The attention backend interface: how a model layer reads and writes the paged KV cache.

The model runner builds one AttentionInputs per step; the backend turns it into its own metadata once
(`build_metadata`), and every layer calls `forward` with that metadata. A GPU backend (Triton,
FlexAttention, CUDA graphs) slots in behind the same two calls.

Layout of one layer's KV cache: kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]
(index 0 = keys, 1 = values). Block 0 is the null block: never allocated, used to pad block tables.
An int8 cache (--kv-cache-dtype int8, CPU) is [2, num_blocks, block_size, num_kv_heads, head_dim + 4]: each
token's kv head row quantized symmetrically (`quantize_int8_rows`), its float32 scale in the last 4 bytes.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from llmserve.model import cpu_kernels


@dataclass
class AttentionInputs:
    """One step's batch, requests in row order; T = total scheduled tokens, B = requests."""

    query_start_loc: torch.Tensor  # [B + 1] int32: row i's new tokens are q[start[i]:start[i+1]]
    seq_lens: torch.Tensor  # [B] int32: tokens in the KV after this step (cached + new)
    block_table: torch.Tensor  # [B, max_blocks] int32: block ids, padded with 0
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset of each new token
    query_lens_cpu: list[int]  # [B] host copy
    seq_lens_cpu: list[int]  # [B] host copy
    block_size: int


FP8_KV_DTYPE = torch.float8_e4m3fn
# Per-tensor scales of an fp8 cache (stored = k / K_SCALE): 1.0, vLLM's default without calibration
# (K and V of the tested models stay well inside e4m3's +-448). Kernels take them as arguments, so
# calibrated per-layer scales only change where the values come from.
K_SCALE = V_SCALE = 1.0


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k/v [T, Hkv, D] at slot_mapping [T] int64 of kv_cache [2, N, bs, Hkv, D]; an fp8 cache gets
    them divided by the per-tensor scale and saturated to e4m3's range, a float16 cache (of a float32
    model) gets them rounded to float16, an int8 one gets them quantized per row (`quantize_int8_rows`)."""
    num_kv_heads, row_width = kv_cache.shape[3], kv_cache.shape[4]  # head_dim (+ 4 for int8: the scale)
    is_fusable = cpu_kernels.can_fuse(k) and kv_cache.is_contiguous()
    cache_dtypes = (torch.bfloat16,) if k.dtype == torch.bfloat16 else (torch.float32, torch.float16, torch.int8)
    if kv_cache.dtype in cache_dtypes and is_fusable:
        return cpu_kernels.write_kv(kv_cache, slot_mapping, k, v)  # one pass, no index_copy_ dispatch
    if kv_cache.dtype == torch.int8:  # rows of D + 4 (the scale)
        k, v = quantize_int8_rows(k.float()), quantize_int8_rows(v.float())
    elif kv_cache.dtype == FP8_KV_DTYPE:  # CPU's index_copy_ has no float8 kernel: copy the bytes
        kv_cache = kv_cache.view(torch.uint8)
        k, v = to_fp8(k, K_SCALE).view(torch.uint8), to_fp8(v, V_SCALE).view(torch.uint8)
    elif kv_cache.dtype != k.dtype:
        k, v = k.to(kv_cache.dtype), v.to(kv_cache.dtype)
    kv_cache[0].view(-1, num_kv_heads, row_width).index_copy_(0, slot_mapping, k)
    kv_cache[1].view(-1, num_kv_heads, row_width).index_copy_(0, slot_mapping, v)


def quantize_int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x [..., D] float32 -> [..., D + 4] int8 as an int8 cache holds it (what the CPU kernels' write_kv stores):
    round(x / scale) with scale = max|x| / 127 per row (1 for an all-zero row), then the scale's 4 bytes."""
    absmax = x.abs().amax(-1, keepdim=True)  # [..., 1]
    scale = torch.where(absmax > 0, absmax / 127.0, torch.ones_like(absmax))
    q = torch.round(x / scale).clamp(-127, 127).to(torch.int8)
    return torch.cat([q, scale.contiguous().view(torch.int8)], dim=-1)


def to_fp8(x: torch.Tensor, scale: float) -> torch.Tensor:
    """x / scale saturated to e4m3's range, as an fp8 cache stores it."""
    fp8_max = torch.finfo(FP8_KV_DTYPE).max
    return (x.float() / scale).clamp(-fp8_max, fp8_max).to(FP8_KV_DTYPE)


def as_int32(t: torch.Tensor) -> torch.Tensor:
    """The step's index tensors as the kernels read them (no copy when already int32)."""
    return t if t.dtype == torch.int32 else t.to(torch.int32)


class AttentionBackend(ABC):
    """Writes new K/V into the paged cache and attends causally over each request's KV.

    Per layer (arguments of `forward`, not of the metadata): `window` > 0 limits a query at position p to the
    keys at positions p - window + 1 .. p (sliding-window attention; 0 = every earlier key), and `sinks` [H]
    float32 adds one learned logit per query head to the softmax's denominator (attention sinks: the head may
    attend to "nothing"; no value).
    """

    name: str = "abstract"

    @abstractmethod
    def build_metadata(self, inputs: AttentionInputs) -> object:
        """Once per step, before the forward: precompute what every layer shares."""

    @abstractmethod
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: object, scale: float, window: int = 0, sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], kv_cache [2, N, bs, Hkv, D], sinks [H] float32 or None -> out [T, H, D].

        Stores k/v at the step's slot mapping, then computes causal attention of each new token
        over its request's previous tokens (from the cache) and the new ones, within `window` when > 0.
        """


def select_attention_backend(device: torch.device, name: str = "auto",
                             dtype: torch.dtype | None = None) -> AttentionBackend:
    """The backend for a device (and the model's dtype): 'auto' = Triton on CUDA (torch when Triton is
    missing), torch on CPU.

    'triton' off CUDA runs the kernel through Triton's interpreter (TRITON_INTERPRET=1): for tests only.
    On CPU the torch backend builds (or loads) its C++ kernel now, so that the first step does not wait.
    """
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown attention backend {name!r}; choose auto, torch or triton")
    is_cuda = torch.device(device).type == "cuda"
    if name == "triton" or (name == "auto" and is_cuda and _has_triton()):
        from llmserve.model.attn_triton import TritonAttentionBackend

        return TritonAttentionBackend()
    from llmserve.model.attn_torch import TorchAttentionBackend

    if is_cuda:
        return TorchAttentionBackend()
    cpu_kernels.available()
    return TorchAttentionBackend(kernel_takes_prompts=dtype is not None and cpu_kernels.attends_prompts(dtype),
                                 max_kernel_prompt_seq_len=cpu_kernels.prompt_seq_len_limit(dtype))


def _has_triton() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
