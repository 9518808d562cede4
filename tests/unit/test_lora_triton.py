"""The LoRA Triton kernels (model/lora_triton.py) against the per-row reference: compiled on CUDA, through
Triton's interpreter on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # without CUDA, conftest.py set TRITON_INTERPRET=1 before anything imported it

from test_lora_layers import OUT_SIZES, _per_row_reference, _pool  # noqa: E402

from llmserve.model.lora_layers import lora_step  # noqa: E402
from llmserve.model.lora_triton import add_lora_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("token_slots", [[1, -1, 0, 2, 1, 1, -1, 2, 0, 1], [2, 0, 1], [-1, 0]],
                         ids=["mixed-prompt", "decode", "one-adapter-token"])
def test_triton_products_equal_the_per_row_reference(token_slots):
    a, bs, _ = _pool(0)
    slots = np.array(token_slots)
    x = torch.randn(len(slots), a.shape[-1], generator=torch.Generator().manual_seed(2))
    expected = 1 + _per_row_reference(x, a, bs, slots)
    out = torch.ones(len(slots), sum(OUT_SIZES), device=DEVICE)
    step = lora_step(slots, torch.device(DEVICE))
    # small tiles: several K and output tiles a token even on these shapes
    add_lora_triton(out, x.to(DEVICE), a.to(DEVICE), [b.to(DEVICE) for b in bs], step, block_k=16, block_n=8)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)
