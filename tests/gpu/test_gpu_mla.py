"""Multi-head Latent Attention's Triton kernel on CUDA: DeepSeek-V3's own head shape (L 512, R 64, 128 heads) in
bfloat16 (over a bfloat16 and an fp8 latent cache) against the float64 reference, and a tiny DeepSeek served
through captured decode graphs giving the eager engine's tokens (graphs are captured when its MoE runs without
host syncs)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model import mla_triton
from llmserve.model.attn_triton import TritonAttentionBackend

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))  # the architecture tests' checkpoint writers
import test_deepseek_model  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


def _reference(q_latent, q_rope, cache, block_table, seq_lens, scale) -> torch.Tensor:
    """Decode rows: q_* [B, H, *] over each row's entries gathered from cache [1, N, bs, 1, L + R] -> [B, H, L]."""
    latent_dim, outs = q_latent.shape[-1], []
    entries = cache[0, :, :, 0].float().double()  # [N, bs, L + R]
    for row, seq_len in enumerate(seq_lens.tolist()):
        seq = entries[block_table[row].long()].reshape(-1, entries.shape[-1])[:seq_len]  # [S, L + R]
        queries = torch.cat([q_latent[row], q_rope[row]], dim=-1).double()  # [H, L + R]
        probs = (queries @ seq.T * scale).softmax(-1)  # [H, S]
        outs.append(probs @ seq[:, :latent_dim])
    return torch.stack(outs)


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn])
@pytest.mark.parametrize("seq_lens", [[1, 300, 4097, 17], [2048] * 8])
def test_v3_shape_decode_in_bfloat16(seq_lens, cache_dtype):
    heads, latent_dim, rope_dim, block_size = 128, 512, 64, 64
    gen = torch.Generator(device="cuda").manual_seed(0)
    max_blocks = -(-max(seq_lens) // block_size)
    num_blocks = len(seq_lens) * max_blocks + 1
    cache = torch.randn(1, num_blocks, block_size, 1, latent_dim + rope_dim, device="cuda", generator=gen,
                        dtype=torch.bfloat16).to(cache_dtype)  # fp8: --kv-cache-dtype fp8, scale 1
    block_table = (torch.randperm(num_blocks - 1, device="cuda", generator=gen)[:len(seq_lens) * max_blocks] + 1)
    block_table = block_table.view(len(seq_lens), max_blocks).to(torch.int32)
    q_latent = torch.randn(len(seq_lens), heads, latent_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    q_rope = torch.randn(len(seq_lens), heads, rope_dim, device="cuda", generator=gen, dtype=torch.bfloat16)
    num_rows = len(seq_lens)
    int32 = dict(dtype=torch.int32, device="cuda")
    seq_lens_t = torch.tensor(seq_lens, **int32)
    metadata = TritonAttentionBackend().graph_metadata(
        torch.zeros(num_rows, dtype=torch.int64, device="cuda"), block_table, seq_lens_t,
        torch.arange(num_rows + 1, **int32), torch.arange(num_rows, **int32), torch.zeros(num_rows, **int32))
    out = torch.empty_like(q_latent)
    scale = (128 + 64) ** -0.5
    mla_triton.paged_latent_attention(out, q_latent, q_rope, cache, metadata.block_table, metadata.seq_lens,
                                      metadata.query_start_loc, metadata.tile_rows, metadata.tile_starts, 1, scale)
    expected = _reference(q_latent, q_rope, cache, block_table, seq_lens_t, scale)
    torch.testing.assert_close(out.double(), expected, atol=3e-2, rtol=3e-2)


@pytest.mark.parametrize("arch", list(test_deepseek_model.ARCHS))
def test_deepseek_decode_graphs_equal_eager_in_bfloat16(arch, tmp_path):
    path = test_deepseek_model.write_checkpoint(arch, str(tmp_path / arch), seed=1)
    engine = dict(device="cuda", dtype="bfloat16", max_model_len=128, num_kv_blocks=128, block_size=16,
                  max_num_batched_tokens=32)
    graphed, eager = LLM(path, **engine), LLM(path, enforce_eager=True, **engine)
    assert graphed.engine.runner.attn_backend.name == "triton"
    if graphed.engine.runner.graphs is None:
        pytest.skip("this MoE reads its expert counts on the host here: no decode graphs")
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 9, 40)]
    tokens = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, PARAMS)] for llm in (graphed, eager)]
    assert tokens[0] == tokens[1]
    graphed.engine.check_integrity()
