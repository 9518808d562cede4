"""The inverse of an int8 KV cache's rows (model/attention.py's `quantize_int8_rows`), for the tests that read
such a cache back."""

from __future__ import annotations

import torch


def dequantize_int8_rows(rows: torch.Tensor) -> torch.Tensor:
    """[..., D + 4] int8 rows of an int8 cache -> [..., D] float32 (q * scale)."""
    scale = rows[..., -4:].contiguous().view(torch.float32)  # [..., 1]
    return rows[..., :-4].float() * scale
