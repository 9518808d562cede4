"""LoRA's products for the qkv projection of the smollm2-135m shape (576 -> 576 + 192 + 192), rank 16, on CPU:
segmented (model/lora_layers.py: one matmul pair per adapter in the step) vs gathered (each token's A and B
gathered by slot, one torch.bmm each: BGMV's form), beside the base projection's own matmul. Median us per
call over interleaved rounds, so that both see the same load. NEVER RUN IN CI.

usage: python scripts/cpu/lora_bench.py THREADS ROWS:ADAPTERS[,ROWS:ADAPTERS...]
"""
import statistics
import sys
import time

import numpy as np
import torch

from llmserve.model.lora_layers import LoRAContext, LoRALinear, LoRAStep, add_lora_segmented, lora_step

RANK, IN, OUT_SIZES = 16, 576, [576, 192, 192]


def add_lora_gathered(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
                      step: LoRAStep) -> None:
    idx, slots = step.token_indices, step.token_slots  # [N], [N]
    shrunk = torch.bmm(a.index_select(0, slots), x.index_select(0, idx).unsqueeze(2))  # [N, 3R, 1]
    delta = torch.cat([torch.bmm(b.index_select(0, slots), shrunk[:, j * RANK:(j + 1) * RANK])
                       for j, b in enumerate(bs)], dim=1)  # [N, out, 1]
    out.index_add_(0, idx, delta.squeeze(2))


def timed(fn, num_calls: int = 50) -> float:
    start = time.perf_counter()
    for _ in range(num_calls):
        fn()
    return (time.perf_counter() - start) / num_calls * 1e6


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]))
    torch.manual_seed(0)
    for case in sys.argv[2].split(","):
        num_rows, num_adapters = map(int, case.split(":"))
        layer = LoRALinear(torch.nn.Identity(), IN, OUT_SIZES, num_adapters, RANK, LoRAContext(), torch.float32,
                           torch.device("cpu"))
        layer.lora_a.normal_()
        for b in layer.lora_bs:
            b.normal_()
        weight = torch.randn(sum(OUT_SIZES), IN)
        x, out = torch.randn(num_rows, IN), torch.zeros(num_rows, sum(OUT_SIZES))
        step = lora_step(np.arange(num_rows) % num_adapters, torch.device("cpu"))  # one token a row: decode
        calls = {"segmented": lambda: add_lora_segmented(out, x, layer.lora_a, layer.lora_bs, step),
                 "gathered": lambda: add_lora_gathered(out, x, layer.lora_a, layer.lora_bs, step),
                 "base matmul": lambda: x @ weight.T}
        times: dict[str, list[float]] = {name: [] for name in calls}
        for _ in range(7):
            for name, fn in calls.items():
                times[name].append(timed(fn))
        print(f"{num_rows} rows, {num_adapters} adapters: " +
              ", ".join(f"{name} {statistics.median(t):.0f} us" for name, t in times.items()))


if __name__ == "__main__":
    main()
