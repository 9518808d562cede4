"""LoRA's products for the qkv projection of the smollm2-135m shape (576 -> 576 + 192 + 192), rank 16, on CPU,
one token a row (a decode step): segmented (model/lora_layers.py: one matmul pair per adapter in the step)
vs all slots (every token against every slot's A in one matmul, its own slot's features kept, then one
matmul against every slot's B^T) vs gathered (each token's A and B gathered by slot, one torch.bmm each:
BGMV's form) vs kernel (model/lora_cpu.py: one C++ call for every token), beside the base projection's own matmul. Median us per call over
interleaved rounds, so that all see the same load. NEVER RUN IN CI.

usage: python scripts/cpu/lora_bench.py THREADS ROWS:ADAPTERS[,ROWS:ADAPTERS...]   (slots: ADAPTERS)
"""
import statistics
import sys
import time

import numpy as np
import torch

from llmserve.model import lora_cpu
from llmserve.model.lora_layers import LoRAContext, LoRALinear, LoRAStep, add_lora_segmented, lora_step

RANK, IN, OUT_SIZES = 16, 576, [576, 192, 192]


def add_lora_gathered(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
                      step: LoRAStep) -> None:
    idx, slots = step.token_indices, step.token_slots  # [N], [N]
    shrunk = torch.bmm(a.index_select(0, slots), x.index_select(0, idx).unsqueeze(2))  # [N, 3R, 1]
    delta = torch.cat([torch.bmm(b.index_select(0, slots).transpose(1, 2), shrunk[:, j * RANK:(j + 1) * RANK])
                       for j, b in enumerate(bs)], dim=1)  # [N, out, 1]
    out.index_add_(0, idx, delta.squeeze(2))


def add_lora_all_slots(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
                       step: LoRAStep) -> None:
    num_slots, n_rank, in_features = a.shape
    idx, slots = step.token_indices, step.token_slots  # [N], [N]
    num_tokens = len(idx)
    xs = x.index_select(0, idx)  # [N, in]
    shrunk_all = (xs @ a.view(num_slots * n_rank, in_features).T).view(num_tokens, num_slots, n_rank)
    shrunk = shrunk_all[torch.arange(num_tokens), slots]  # [N, 3R]
    own_slot = torch.nn.functional.one_hot(slots, num_slots).to(xs.dtype)[:, :, None]  # [N, S, 1]
    deltas = [(own_slot * shrunk[:, None, j * RANK:(j + 1) * RANK]).view(num_tokens, num_slots * RANK)
              @ b.view(num_slots * RANK, -1) for j, b in enumerate(bs)]  # [N, out_j] each
    out.index_add_(0, idx, torch.cat(deltas, dim=1))


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
        layer.lora_ranks.fill_(RANK)
        weight = torch.randn(sum(OUT_SIZES), IN)
        x, out = torch.randn(num_rows, IN), torch.zeros(num_rows, sum(OUT_SIZES))
        step = lora_step(np.arange(num_rows) % num_adapters, torch.device("cpu"))  # one token a row: decode
        calls = {"segmented": lambda: add_lora_segmented(out, x, layer.lora_a, layer.lora_bs, step),
                 "kernel": lambda: lora_cpu.add_lora(out, x, layer.lora_a, layer.lora_bs, layer.lora_ranks,
                                                     step.token_indices, step.token_slots),
                 "all slots": lambda: add_lora_all_slots(out, x, layer.lora_a, layer.lora_bs, step),
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
