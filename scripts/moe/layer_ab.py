"""One MoE layer of the smollm2-135m-moe shape on CPU (hidden 576, 8 experts, top-2, expert width 768, float32,
random weights), the experts through each expert's packed layers (the Python loop) against the one op a layer
(csrc/moe_experts.cpp), alternated in one process. NEVER RUN IN CI.

usage: python scripts/moe/layer_ab.py THREADS
Prints, at 16 and 64 rows, each path's median thread-CPU and wall time a layer (6 layers a round, 15 rounds).
"""
import statistics
import sys
import time

import torch

from llmserve.model.moe import MoeSpec, SparseMoeBlock, fused_moe, route
from llmserve.model.moe_cpu import pack_experts

HIDDEN, INTER, EXPERTS, LAYERS, ROUNDS = 576, 768, 8, 6, 15


def main() -> None:
    torch.set_num_threads(int(sys.argv[1]))
    layers = []
    for _ in range(LAYERS):
        block = SparseMoeBlock(HIDDEN, MoeSpec(EXPERTS, 2, INTER, is_renormalized=True))
        for param in block.parameters():
            param.data = torch.randn(param.shape) * 0.05
        layers.append(pack_experts(block.eval().requires_grad_(False)))
    for num_rows in (16, 64):
        x = torch.randn(num_rows, HIDDEN)
        weights, ids = route(torch.randn(num_rows, EXPERTS), 2, True)
        times = {False: [], True: []}
        with torch.inference_mode():
            for r in range(ROUNDS):
                for is_one_op in ((False, True) if r % 2 == 0 else (True, False)):
                    t0, c0 = time.perf_counter(), time.thread_time()
                    for experts in layers:
                        if is_one_op:
                            experts.run_in_one_op(x, weights, ids)
                        else:
                            fused_moe(x, experts.gate_up_proj, experts.down_proj, weights, ids)
                    times[is_one_op].append(((time.thread_time() - c0) / LAYERS, (time.perf_counter() - t0) / LAYERS))
        loop, one = ([statistics.median(t[i] for t in times[k]) * 1e3 for i in (0, 1)] for k in (False, True))
        print(f"rows {num_rows}: per-expert loop cpu {loop[0]:.2f} ms wall {loop[1]:.2f} ms | one op cpu {one[0]:.2f} "
              f"ms wall {one[1]:.2f} ms | loop / one op (wall) {loop[1] / one[1]:.2f}x")


if __name__ == "__main__":
    main()
