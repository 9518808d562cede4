"""One MoE block (16 experts, top-2, hidden 1024, expert intermediate 512) on CPU: float32 experts against int8
experts (model/quant/experts.py), one thread, the two interleaved (docs/benchmarks.md "int8 experts on CPU")."""
import copy, time, statistics, torch
from llmserve.model.moe import MoeSpec, SparseMoeBlock
from llmserve.model.quant.experts import quantize_experts
from llmserve.model.quant.linear import Int8Linear
torch.manual_seed(0); torch.set_num_threads(1)
block = SparseMoeBlock(1024, MoeSpec(16, 2, 512, is_renormalized=True))
with torch.no_grad():
    for p in block.parameters(): p.normal_(0, 0.05)
q = copy.deepcopy(block); q.experts = quantize_experts(q.experts, Int8Linear)
def timed(b, x, n=30):
    with torch.inference_mode():
        for _ in range(3): b(x)
        ts = []
        for _ in range(n):
            t = time.perf_counter(); b(x); ts.append(time.perf_counter() - t)
    return statistics.median(ts)
for rows in (1, 16, 64):
    x = torch.randn(rows, 1024)
    fs, is_ = [], []
    for _ in range(5):  # interleaved: the machine is shared
        fs.append(timed(block, x, 10)); is_.append(timed(q, x, 10))
    f, i = min(fs), min(is_)
    print(f"rows {rows}: float32 {f*1e3:.2f} ms, int8 {i*1e3:.2f} ms, int8/float32 speed {f/i:.2f}x")
