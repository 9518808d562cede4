"""One MLA layer's decode step at DeepSeek-V2-Lite's attention dims (16 heads, kv_lora_rank 512, rope 64, nope 128,
v 128; float32): 16 rows at 2,048 cached tokens. The layer over the latent cache through the C++ kernel and through
torch groups, the layer over an int8 latent cache (--kv-cache-dtype int8) through the kernel, and the attention
call alone over the latent cache beside one over a cache of K and V per head (K 192 wide, V padded to 192) through
the same kernel. Alternating, 15 rounds, median and min. NEVER RUN IN CI.

usage: PYTHONPATH=src python scripts/cpu/mla_decode_bench.py
"""
import statistics
import time

import torch
from transformers import DeepseekV2Config
from llmserve.model import mla
from llmserve.model.attn_torch import TorchAttentionBackend
from llmserve.model.layers import RotaryEmbedding, RopeParams
from llmserve.testing.paged_batch import PagedBatchBuilder
from llmserve.model import cpu_kernels
from llmserve.model.attention import quantize_int8_rows
torch.manual_seed(0)
ROWS, CTX, BS = 16, 2048, 16
cfg = DeepseekV2Config(hidden_size=2048, num_attention_heads=16, kv_lora_rank=512, q_lora_rank=None,
                       qk_rope_head_dim=64, qk_nope_head_dim=128, v_head_dim=128)
att = mla.MlaAttention(cfg).float()
with torch.no_grad():
    for p in att.parameters(): p.normal_(0, 0.02)
nb = ROWS * CTX // BS + 2
builder = PagedBatchBuilder(nb, BS, seed=1)
for r in range(ROWS): builder.add_cached(r, CTX - 1)
_, pos, inputs = builder.step([(r, [0]) for r in range(ROWS)])
latent = torch.randn(mla.cache_shape(nb, BS, 512, 64))
per_head = torch.randn(2, nb, BS, 16, 192)
rot = RotaryEmbedding(64, RopeParams(theta=10000.0))
x = torch.randn(ROWS, 2048)
cs = rot.cos_sin(pos, torch.float32)
kernel_backend, torch_backend = TorchAttentionBackend(), TorchAttentionBackend(use_cpu_kernel=False)
mk, mt = kernel_backend.build_metadata(inputs), torch_backend.build_metadata(inputs)
q = torch.randn(ROWS, 16, 192)
def layer_kernel(): att(x, cs, latent, mk, kernel_backend)
def layer_torch(): att(x, cs, latent, mt, torch_backend)
latent_int8 = quantize_int8_rows(latent)  # [.., 576 + 4]: each entry with its float32 scale
def layer_kernel_int8(): att(x, cs, latent_int8, mk, kernel_backend)
def per_head_attn():  # the attention call alone of a per-head cache (no projections)
    out = torch.empty_like(q)
    k = mk.kernel
    cpu_kernels.paged_attention(out, q, per_head, k.block_table, k.seq_lens, k.query_start_loc, k.rows, 0.1)
def latent_attn():  # the attention call alone of the latent cache (no projections)
    qq = torch.randn(ROWS, 16, 576)
    from llmserve.model import attn_latent
    attn_latent.attend_kernel_rows(qq, latent, mk, 0.1)
fns = {"MLA layer, latent cache, C++ kernel": layer_kernel, "MLA layer, latent cache, torch groups": layer_torch,
       "MLA layer, int8 latent cache, C++ kernel": layer_kernel_int8,
       "attention call, latent cache [16 x 576 q, 1 kv head of 576]": latent_attn,
       "attention call, per-head K/V cache [16 heads x 192]": per_head_attn}
times = {k: [] for k in fns}
with torch.no_grad():
    for f in fns.values(): f()
    for _ in range(15):
        for k, f in fns.items():
            t = time.perf_counter(); f(); times[k].append(time.perf_counter() - t)
for k, v in times.items(): print(f"{k}: median {1e3*statistics.median(v):.2f} ms, min {1e3*min(v):.2f} ms")
print("threads", torch.get_num_threads())
