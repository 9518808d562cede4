"""What a decode step's host work costs after a weight stream: each piece timed hot (in a loop) and cold (right after
torch.sum over 280 MB, what a one-row bf16 step of the smollm2-135m shape streams), median of 150. The sampler with
the checkpoint's defaults (temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05; 300 prompt and 100 output
ids), its pieces, and single ops for scale. NEVER RUN IN CI.

usage: python scripts/cpu/cold_ops_bench.py
"""
import time

import torch

from llmserve.model import cpu_kernels
from llmserve.sample import ops
from llmserve.sample.metadata import PositionRow, build_sampling_metadata
from llmserve.sample.sampler import Sampler
from llmserve.sampling_params import SamplingParams

torch.set_num_threads(2)
VOCAB = 49152
params = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=200)
row = PositionRow(params=params, prompt_token_ids=list(range(100, 400)), output_token_ids=list(range(500, 600)))
sampler = Sampler()
logits = torch.randn(1, VOCAB)
meta = build_sampling_metadata([row], VOCAB, "cpu")
stream = torch.ones(70_000_000)  # 280 MB of float32
cpu_kernels.available()


def cold(fn) -> float:
    walls = []
    for _ in range(150):
        stream.sum()
        x = logits.clone()
        start = time.perf_counter()
        fn(x)
        walls.append(time.perf_counter() - start)
    return sorted(walls)[75] * 1e6


def hot(fn) -> float:
    x = logits.clone()
    fn(x)
    start = time.perf_counter()
    for _ in range(200):
        fn(x)
    return (time.perf_counter() - start) / 200 * 1e6


cases = [("sampler (as served)", lambda x: sampler(x, meta)),
         ("sampling metadata build", lambda x: build_sampling_metadata([row], VOCAB, "cpu")),
         ("penalties (torch ops)", lambda x: ops.apply_penalties_torch(x, meta.penalties)),
         ("penalties (as served)", lambda x: ops.apply_penalties(x, meta.penalties)),
         ("top-20 (torch.topk)", lambda x: x.topk(20, dim=-1)),
         ("top-20 (as served)", lambda x: ops.top_k(x, 20)),
         ("one op: neg", lambda x: x.neg()),
         ("one op: torch.empty(3)", lambda x: torch.empty(3))]
for name, fn in cases:
    print(f"{name:26s} cold {cold(fn):6.0f} us   hot {hot(fn):6.0f} us")
