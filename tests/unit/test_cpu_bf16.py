"""A bfloat16 model on CPU: the fused elementwise ops give the bits of transformers' bf16 torch chains, the
AVX512-BF16 GEMV (decode rows) the float64 product within bf16's rounding, the AVX-512 panel kernel the AVX2
one's bits, and a bf16 checkpoint's greedy tokens follow transformers' in bf16."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import hf_parity

from llmserve import LLM
from llmserve.model import cpu_kernels, layers
from llmserve.model import linear as linear_mod
from llmserve.model.attention import write_kv
from llmserve.testing import toy_tokenizer

BF16 = torch.bfloat16
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels not built")
needs_gemv = pytest.mark.skipif(not cpu_kernels.has_bf16_gemv(), reason="no AVX512-BF16 build")
needs_avx512 = pytest.mark.skipif(not cpu_kernels.has_avx512_linear(), reason="no AVX-512 build")


def _hf_rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return w * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


@needs_kernels
@pytest.mark.parametrize("rows,width", [(1, 576), (5, 64), (70, 200)])
def test_fused_bf16_norms_equal_transformers_chain_bit_for_bit(rows, width):
    gen = torch.Generator().manual_seed(rows)
    x, residual = torch.randn(rows, width, generator=gen).to(BF16), torch.randn(rows, width, generator=gen).to(BF16)
    w = (torch.rand(width, generator=gen) + 0.5).to(BF16)
    with torch.inference_mode():
        assert torch.equal(cpu_kernels.rms_norm(x, w, 1e-5), _hf_rms_norm(x, w, 1e-5))
        summed = x + residual
        xx, rr = x.clone(), residual.clone()
        cpu_kernels.add_rms_norm_(xx, rr, w, 1e-5)
        assert torch.equal(rr, summed) and torch.equal(xx, _hf_rms_norm(summed, w, 1e-5))


@needs_kernels
def test_fused_bf16_silu_mul_rotary_and_kv_write_equal_torch_bit_for_bit():
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        gate_up = (3 * torch.randn(7, 2 * 96, generator=gen)).to(BF16)
        assert torch.equal(cpu_kernels.silu_mul(gate_up), F.silu(gate_up[:, :96]) * gate_up[:, 96:])
        qkv = torch.randn(7, 9, 64, generator=gen).to(BF16)  # rotary on a strided view of q and k
        qk = qkv[:, :6]
        cos, sin = layers.RotaryEmbedding(64, layers.RopeParams(theta=10000.0)).cos_sin(torch.arange(7) + 300, BF16)
        x1, x2 = qk.chunk(2, dim=-1)
        expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        assert cpu_kernels.can_fuse(qk)
        cpu_kernels.rotary_(qk, cos, sin)
        assert torch.equal(qkv[:, :6], expected)
        cache, slots = torch.zeros(2, 4, 16, 3, 64, dtype=BF16), torch.tensor([0, 17, 33, 5, 63, 2, 9])
        k, v = qkv[:, 6:], qkv[:, 6:] * 2
        expected_cache = cache.clone()
        expected_cache[0].view(-1, 3, 64).index_copy_(0, slots, k)
        expected_cache[1].view(-1, 3, 64).index_copy_(0, slots, v)
        write_kv(cache, slots, k, v)
        assert torch.equal(cache, expected_cache)
        assert not cpu_kernels.can_fuse(gate_up.half())


@needs_kernels
def test_bf16_silu_mul_gives_torchs_bits_at_every_gate_value_and_rotary_at_odd_widths():
    """silu comes from a table of every bfloat16's value, products eight lanes at a time: F.silu's bits for each
    of the 65,536 gate values (NaNs aside), and the lanes past the last eight (widths 99, half 10) alike."""
    gate = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(BF16)  # every bfloat16
    gate = gate[~gate.float().isnan()]
    up = torch.randn(gate.numel(), generator=torch.Generator().manual_seed(3)).to(BF16)
    with torch.inference_mode():
        got = cpu_kernels.silu_mul(torch.cat([gate, up]).reshape(1, -1))
        assert torch.equal(got[0].view(torch.int16), (F.silu(gate) * up).view(torch.int16))
        gate_up = (3 * torch.randn(5, 2 * 99)).to(BF16)
        assert torch.equal(cpu_kernels.silu_mul(gate_up), F.silu(gate_up[:, :99]) * gate_up[:, 99:])
        qk = torch.randn(5, 4, 20).to(BF16)
        cos, sin = layers.RotaryEmbedding(20, layers.RopeParams(theta=10000.0)).cos_sin(torch.arange(5) + 9, BF16)
        x1, x2 = qk.chunk(2, dim=-1)
        expected = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        cpu_kernels.rotary_(qk, cos, sin)
        assert torch.equal(qk, expected)


@needs_gemv
@pytest.mark.parametrize("num_out,num_in", [(37, 576), (64, 45), (5, 1000), (5000, 32)])  # N % 4 != 0, K % 32 != 0; chunks
def test_bf16_gemv_matches_a_float64_reference(num_out, num_in):
    gen = torch.Generator().manual_seed(num_in)
    w, b = torch.randn(num_out, num_in, generator=gen).to(BF16), torch.randn(num_out, generator=gen).to(BF16)
    for rows in range(1, cpu_kernels.bf16_gemv_max_rows() + 1):
        x = torch.randn(rows, num_in, generator=gen).to(BF16)
        exact = x.double() @ w.double().t() + b.double()  # [M, N]
        got = cpu_kernels.bf16_gemv(x, w, b)
        assert got.dtype == BF16 and got.shape == (rows, num_out)
        # float32 sums (their error far under bf16's) rounded once to bf16: within half a bf16 step and a little
        assert ((got.double() - exact).abs() <= exact.abs() * 2 ** -8 + 1e-3 * num_in ** 0.5).all()


@needs_gemv
def test_bf16_decode_rows_take_the_gemv_and_larger_batches_onednn(monkeypatch):
    w = torch.randn(40, 64).to(BF16)
    with torch.inference_mode():
        assert linear_mod.uses_bf16_gemv(torch.randn(8, 64).to(BF16), w)
        assert not linear_mod.uses_bf16_gemv(torch.randn(9, 64).to(BF16), w)
        assert not linear_mod.uses_bf16_gemv(torch.randn(2, 64), w.float())
        monkeypatch.setenv("LLMSERVE_CPU_LINEAR", "onednn")
        assert not linear_mod.uses_bf16_gemv(torch.randn(1, 64).to(BF16), w)
    with pytest.raises(RuntimeError, match="M <= 8"):
        cpu_kernels.bf16_gemv(torch.randn(9, 64).to(BF16), w)


@needs_gemv
@pytest.mark.parametrize("path", ["auto", "onednn"])
def test_a_loaded_bf16_linear_chooses_the_gemv_once(monkeypatch, path):
    """`pack_linears` marks a bf16 Linear for the GEMV under the path read at load: decode rows then take it
    (the GEMV's bits), batches past 4 rows and every row under LLMSERVE_CPU_LINEAR=onednn take F.linear."""
    monkeypatch.setenv("LLMSERVE_CPU_LINEAR", path)
    layer = linear_mod.Linear(64, 40, bias=True).to(BF16).requires_grad_(False)
    assert linear_mod.pack_linears(layer) == 0 and layer.is_gemv_weight == (path == "auto")
    gen = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        for rows in (1, 4, 5):
            x = torch.randn(rows, 64, generator=gen).to(BF16)
            takes_gemv = path == "auto" and rows <= cpu_kernels.bf16_gemv_max_rows()
            expected = cpu_kernels.bf16_gemv(x, layer.weight, layer.bias) if takes_gemv else \
                F.linear(x, layer.weight, layer.bias)
            assert torch.equal(layer(x), expected)


@needs_avx512
def test_avx512_panels_give_the_avx2_kernels_bits():
    gen = torch.Generator().manual_seed(3)
    w, b = torch.randn(520, 300, generator=gen), torch.randn(520, generator=gen)
    panels = cpu_kernels.pack_linear_weight(w)
    for rows in [1, 2, 5, 6, 7, 16, 64, 65, 200]:
        x = torch.randn(rows, 300, generator=gen)
        avx2 = torch.empty(rows, 520)
        torch.ops.llmserve_cpu.packed_linear(avx2, x, panels, b)
        assert torch.equal(cpu_kernels.packed_linear_avx512(x, panels, 520, b), avx2)


VOCAB = 512


@pytest.fixture(scope="module")
def bf16_checkpoint(tmp_path_factory):
    import transformers

    path = str(tmp_path_factory.mktemp("llama-bf16"))
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=256, intermediate_size=512, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      initializer_range=0.1, tie_word_embeddings=True, eos_token_id=2,
                                      pad_token_id=0, bos_token_id=None, architectures=["LlamaForCausalLM"])
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(BF16)
    model.save_pretrained(path)
    toy_tokenizer.save_tokenizer(path, VOCAB, 256)
    return path, model.eval()


@needs_kernels
def test_a_bf16_checkpoint_greedy_equals_transformers_in_bf16(bf16_checkpoint):
    """The decode rows through the GEMV (where built) and the fused bf16 ops, a batch of mixed lengths."""
    path, hf = bf16_checkpoint
    prompts = [hf_parity.random_prompt(n, i, VOCAB) for i, n in enumerate((5, 23, 1))]
    llm = LLM(path, dtype="bfloat16", max_model_len=128, num_kv_blocks=64, block_size=4)
    outs = hf_parity.engine_greedy(llm, prompts, num_out=8)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_parity.hf_greedy(hf, p, 8) for p in prompts]
    llm.engine.check_integrity()


@needs_kernels
def test_bf16_greedy_equals_transformers_through_chunks_a_prefix_hit_and_preemption(bf16_checkpoint):
    """Prompts in chunks of at most 8 tokens (the kernel takes bf16 prompt rows), a prompt whose first blocks come
    from the prefix cache, and a pool too small for every request at once (preempted and recomputed)."""
    path, hf = bf16_checkpoint
    llm = LLM(path, dtype="bfloat16", max_model_len=64, num_kv_blocks=32, block_size=4, max_num_batched_tokens=8,
              enable_prefix_caching=True)
    shared = hf_parity.random_prompt(21, 7, VOCAB)
    (first,) = hf_parity.engine_greedy(llm, [shared], num_out=8)
    assert list(first.outputs[0].token_ids) == hf_parity.hf_greedy(hf, shared, 8)
    longer = shared + hf_parity.random_prompt(6, 8, VOCAB)
    (second,) = hf_parity.engine_greedy(llm, [longer], num_out=8)
    assert second.num_cached_tokens >= 20 and list(second.outputs[0].token_ids) == hf_parity.hf_greedy(hf, longer, 8)
    llm.engine.check_integrity()
    small_pool = LLM(path, dtype="bfloat16", max_model_len=32, num_kv_blocks=10, block_size=4,
                     max_num_batched_tokens=8, enable_prefix_caching=True)
    prompts = [hf_parity.random_prompt(n, i, VOCAB) for i, n in enumerate((5, 23, 1))]  # the batch test's prompts
    outs = hf_parity.engine_greedy(small_pool, prompts, num_out=8)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_parity.hf_greedy(hf, p, 8) for p in prompts]
    assert small_pool.num_preemptions > 0
    small_pool.engine.check_integrity()
