"""Where FP8 decode time goes on a GPU (issue 20): per Llama-3.1-8B linear shape and batch rows, the bf16
GEMM, the FP8 GEMM alone (torch._scaled_mm, row-wise scales, operands already quantized), the per-token
quantization alone (torch's ops; the Triton kernel), and Fp8Linear's whole forward through torch's ops and
through the Triton kernels it uses on CUDA (fp8_triton: a GEMV up to 4 rows); each timed as a CUDA-graph
replay (median, us), the last column the weight bytes over the Triton path's time.

    python scripts/gpu/fp8_probe.py [rows,...]
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph

from llmserve.model.quant import fp8_triton
from llmserve.model.quant.linear import FP8_DTYPE, FP8_MAX, Fp8Linear, _per_token

SHAPES = {"qkv 4096->6144": (6144, 4096), "o 4096->4096": (4096, 4096), "gate_up 4096->28672": (28672, 4096),
          "down 14336->4096": (4096, 14336)}


def _time(fn) -> float:
    return do_bench_cudagraph(fn, rep=50, return_mode="median") * 1e3  # us


def main() -> None:
    rows_list = [int(r) for r in (sys.argv[1] if len(sys.argv) > 1 else "1,8,64,256").split(",")]
    print(f"{'shape':22} {'rows':>5} {'bf16':>8} {'fp8 mm':>8} {'quant x':>8} {'quant tr':>8} {'torch path':>10} "
          f"{'triton path':>11} {'GB/s bf16':>9} {'GB/s fp8':>9}")
    for name, (n, k) in SHAPES.items():
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        layer = Fp8Linear.from_float(w, None)
        for rows in rows_list:
            x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
            xs, x_scale = _per_token(x, FP8_MAX)
            xq = xs.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
            t_bf16 = _time(lambda: F.linear(x, w))
            t_mm = _time(lambda: torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.scale,
                                                  out_dtype=torch.bfloat16))
            t_quant = _time(lambda: _per_token(x, FP8_MAX)[0].clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE))
            t_quant_triton = _time(lambda: fp8_triton.quantize_rows(x))
            t_torch = _time(lambda: layer.matmul_torch(x))
            t_layer = _time(lambda: layer(x))
            print(f"{name:22} {rows:5d} {t_bf16:8.1f} {t_mm:8.1f} {t_quant:8.1f} {t_quant_triton:8.1f} {t_torch:10.1f} "
                  f"{t_layer:11.1f} {2 * n * k / t_bf16 / 1e3:9.0f} {n * k / t_layer / 1e3:9.0f}")


if __name__ == "__main__":
    main()
