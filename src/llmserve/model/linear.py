"""The linear layer every model layer uses: F.linear, except float32 on CPU, which goes through oneDNN.

torch's CPU F.linear calls MKL's sgemm. On the AMD EPYC development machines oneDNN's matmul
(`torch.ops.mkldnn._linear_pointwise`, the op inductor's CPU fusions call) is faster on the shapes
that matter for small models, e.g. smollm2-135m's gate/up projection (576 -> 3072): 1.49x at 16 rows and
1.27x at 64 on 2 threads (docs/benchmarks.md, issue 19). oneDNN builds one primitive per new row count
(~1.4 ms, then cached), so the first steps of each batch size pay that once.

Only plain inference on float32 2-D inputs takes the oneDNN path: other dtypes (bf16 on a CPU without
AMX could fall to a slow reference kernel), other devices, and anything autograd should see keep F.linear.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


@functools.cache
def _has_onednn() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")


def uses_onednn(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether `linear(x, weight)` goes through oneDNN."""
    return (x.device.type == "cpu" and x.dtype == torch.float32 and weight.dtype == torch.float32 and x.dim() == 2
            and weight.device.type == "cpu" and not (torch.is_grad_enabled() and weight.requires_grad)
            and _has_onednn())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, in], weight [out, in], bias [out] or None -> [T, out], like F.linear."""
    if uses_onednn(x, weight):
        return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear through `linear` (quantization still finds it as an nn.Linear and swaps it)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
