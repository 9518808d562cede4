"""The CPU LoRA kernel: one call a projection for all of a step's adapter tokens (csrc/lora_sgmv.cpp).

The segmented torch form (model/lora_layers.py's `add_lora_segmented`) costs about six small ops per adapter
in the step, projection and layer: with 8 adapters that is ~5,800 ops a step on a 30-layer model, more time
than the base model's matmuls on small shapes. This kernel reads each token's slot and does the shrink and
the expand for every token in one call (docs/benchmarks.md, "LoRA products on CPU: one call a projection").

float32 and bfloat16 (csrc/lora_sgmv_bf16.cpp: AVX512-BF16 dot products where the CPU has them, else AVX2 on
bfloat16 widened to float32; float32 sums and one rounding into the output, as PEFT on a bfloat16 model).
Built like model/cpu_kernels.py's kernels (same flags, a sub-directory of their build directory, the same
LLMSERVE_CPU_KERNELS=0 switch) but as its own small library, so that it builds in seconds.
When the build or its self-test fails, `available()` is False and the layers keep the torch form.
"""

from __future__ import annotations

import functools
import os

import numpy as np
import torch

from llmserve.model import cpu_build


_NAME = "llmserve_lora_cpu"
_CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
_SOURCES = [os.path.join(_CSRC, name) for name in ("lora_sgmv.cpp", "lora_sgmv_bf16.cpp", "lora_sgmv_mixed.cpp")]
_HEADERS = [os.path.join(_CSRC, name) for name in ("lora_sgmv.h", "bf16_avx2.h")]
SLOT_DTYPES = {torch.float32: (torch.float32, torch.bfloat16), torch.bfloat16: (torch.bfloat16,)}  # rows -> slots


def can_run(x: torch.Tensor, out: torch.Tensor, slot_dtype: torch.dtype) -> bool:
    """Whether this kernel takes a projection's input x [T, in] and output out [T, out] with slots of
    `slot_dtype` (float32 or bfloat16 rows on CPU with slots alike, or float32 rows with bfloat16 slots;
    once built)."""
    return slot_dtype in SLOT_DTYPES.get(x.dtype, ()) and all(
        t.dtype == x.dtype and t.device.type == "cpu" and t.dim() == 2 and t.stride(1) == 1
        for t in (x, out)) and available()


def add_lora(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor], ranks: torch.Tensor,
             token_indices: torch.Tensor, token_slots: torch.Tensor) -> None:
    """out [T, O] += each adapter token's x @ A[slot]^T @ B[slot]^T; ranks [S, n_sub] int32 (rows past are zero)."""
    _ops().lora_sgmv(out, x, a, bs, token_indices, token_slots, ranks)


def _self_test(ops) -> None:
    """Mixed slots and ranks, a base-model token, against float64 matmuls in float32, bfloat16 and float32
    rows on bfloat16 slots: a miscompiled kernel must not serve."""
    for dtype, slot_dtype, tolerance in ((torch.float32, torch.float32, 1e-4), (torch.bfloat16, torch.bfloat16, 1e-2),
                                         (torch.float32, torch.bfloat16, 1e-4)):
        out, expected = _self_test_case(ops, dtype, slot_dtype)
        if not torch.allclose(out.double(), expected, atol=tolerance, rtol=tolerance):
            raise RuntimeError(f"self-test mismatch (LoRA kernel, {dtype} rows, {slot_dtype} slots)")


def _self_test_case(ops, dtype: torch.dtype,
                    slot_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    slot_dtype = slot_dtype or dtype
    gen = torch.Generator().manual_seed(0)
    num_slots, rank, in_features, out_sizes = 2, 4, 37, [21, 9]
    a = torch.randn(num_slots, 2 * rank, in_features, generator=gen).to(slot_dtype)
    bs = [torch.randn(num_slots, rank, size, generator=gen).to(slot_dtype) for size in out_sizes]
    ranks = torch.tensor([[4, 0], [3, 4]], dtype=torch.int32)
    a[1, 3:4].zero_()  # slot 1's q rank 3: rows past it are zero, as set_slot writes them
    bs[0][1, 3:].zero_()
    x, out = torch.randn(6, in_features, generator=gen).to(dtype), torch.ones(6, sum(out_sizes), dtype=dtype)
    token_slots = np.array([1, -1, 0, 1, 1, 1])
    ops.lora_sgmv(out, x, a, bs, *_grouped(token_slots), ranks)
    expected = torch.ones(6, sum(out_sizes), dtype=torch.float64)
    for t, slot in enumerate(token_slots.tolist()):
        if slot >= 0:
            shrunk = x[t].double() @ a[slot].double().T  # [2R]
            parts = [shrunk[j * rank:(j + 1) * rank] @ b[slot].double() for j, b in enumerate(bs)]
            expected[t, :21] += parts[0] if ranks[slot, 0] else 0
            expected[t, 21:] += parts[1] if ranks[slot, 1] else 0
    return out, expected


def _grouped(token_slots: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    indices = np.flatnonzero(token_slots >= 0)
    indices = indices[np.argsort(token_slots[indices], kind="stable")]
    return torch.from_numpy(indices), torch.from_numpy(token_slots[indices].astype(np.int64))


def _load():
    if cpu_build.kernels_disabled():
        return None
    return cpu_build.build_and_load(_NAME, _SOURCES, "llmserve_lora", _self_test, "CPU LoRA kernel",
                                    "using torch's segmented products", subdir="lora",
                                    extra_cflags=(cpu_build.header_digest(_HEADERS),))


@functools.cache
def _ops():
    """The loaded ops' namespace, or None: built (or found failing) once per process."""
    return _load()


def available() -> bool:
    """Whether the kernel is built and loaded (builds it on the first call; False on any failure)."""
    return _ops() is not None
