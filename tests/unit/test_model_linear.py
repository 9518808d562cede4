"""model/linear.py: float32 CPU inference goes through oneDNN and matches F.linear; the rest keeps F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from llmserve.model import linear as linear_mod
from llmserve.model.linear import Linear, linear, uses_onednn
from llmserve.model.parallel import column_linear, row_linear

needs_onednn = pytest.mark.skipif(not linear_mod._has_onednn(), reason="torch built without oneDNN")


@needs_onednn
@pytest.mark.parametrize("rows", [1, 16, 300])
@pytest.mark.parametrize("has_bias", [False, True])
def test_onednn_matches_f_linear(rows, has_bias):
    gen = torch.Generator().manual_seed(rows)
    x, w = torch.randn(rows, 96, generator=gen), torch.randn(160, 96, generator=gen)
    b = torch.randn(160, generator=gen) if has_bias else None
    with torch.inference_mode():
        assert uses_onednn(x, w)
        torch.testing.assert_close(linear(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)


def test_other_dtypes_ranks_and_autograd_keep_f_linear(monkeypatch):
    calls = []
    monkeypatch.setattr(linear_mod.F, "linear", lambda *a: calls.append(a) or torch.zeros(()))
    w = torch.randn(8, 4)
    for x, weight in [(torch.randn(2, 4, dtype=torch.bfloat16), w.bfloat16()), (torch.randn(3, 2, 4), w),
                      (torch.randn(2, 4), w.requires_grad_())]:
        assert not uses_onednn(x, weight)
        linear(x, weight)
    assert len(calls) == 3


def test_model_layers_are_linear_subclasses():
    """Quantization swaps every nn.Linear: the layers stay nn.Linear subclasses through `linear`."""
    assert isinstance(column_linear(4, 8, False, None), Linear)
    assert isinstance(row_linear(4, 8, True, None), torch.nn.Linear)
