"""DeepSeek-V3 and V2 checkpoints written by transformers itself: greedy tokens from the engine equal
transformers' `generate` through a batch of mixed lengths, chunked prefill, a prefix-cache hit and preemption;
the routing equals transformers' router; the latent cache holds kv_lora_rank + qk_rope_head_dim values a token a
layer and the block count follows it (float16, fp8 and int8 caches too); what the engine cannot run is refused,
naming the field."""

from __future__ import annotations

from functools import partial

import pytest
import torch

import hf_parity
from kv_int8_rows import dequantize_int8_rows

from llmserve import LLM
from llmserve.model import attn_latent, cpu_kernels
from llmserve.model.attention import quantize_int8_rows
from llmserve.model.mla import MlaAttention
from llmserve.testing import toy_tokenizer
from llmserve.model.llama import CausalLM
from llmserve.model.loader import load_model
from llmserve.testing.maker import SHAPES, build_config, make_model
from llmserve.model.moe import SparseMoeBlock, route_grouped
from llmserve.worker.kv_cache import kv_bytes_per_token

VOCAB = 512
NUM_OUT = 8
KV_LORA, ROPE, LAYERS = 32, 8, 3

hf_greedy = partial(hf_parity.hf_greedy, num_out=NUM_OUT)
greedy = partial(hf_parity.engine_greedy, num_out=NUM_OUT)
prompt = partial(hf_parity.random_prompt, vocab_size=VOCAB)

_FIELDS = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
               num_hidden_layers=LAYERS, num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
               topk_group=1, kv_lora_rank=KV_LORA, qk_rope_head_dim=ROPE, qk_nope_head_dim=16, v_head_dim=16,
               first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=256, initializer_range=0.1,
               eos_token_id=2, pad_token_id=0, bos_token_id=None,
               # YaRN whose attention factor (mscale / mscale_all_dim) and softmax scale (mscale_all_dim) both act
               rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "mscale": 1.0,
                                "mscale_all_dim": 0.5, "original_max_position_embeddings": 64})
ARCHS = {
    # V3: q through its low-rank pair, sigmoid scores + correction bias within the best group, 2.5x weights
    "v3": ("DeepseekV3", dict(q_lora_rank=48, routed_scaling_factor=2.5)),
    # V2 (as V2-Lite): q_proj without LoRA, softmax scores limited to the best group by its best expert
    "v2": ("DeepseekV2", dict(q_lora_rank=None, topk_method="group_limited_greedy", routed_scaling_factor=1.5)),
}


def write_checkpoint(arch: str, out_dir: str, seed: int = 0, **fields) -> str:
    """transformers' random DeepSeek model saved by save_pretrained, with the toy tokenizer; V3's correction bias
    (zeros after transformers' init) drawn at random so that it moves the choice."""
    import transformers

    name, extra = ARCHS[arch]
    config = getattr(transformers, f"{name}Config")(**{**_FIELDS, **extra, **fields},
                                                     architectures=[f"{name}ForCausalLM"])
    torch.manual_seed(seed)
    model = getattr(transformers, f"{name}ForCausalLM")(config)
    with torch.no_grad():
        for layer in model.model.layers[config.first_k_dense_replace:]:
            if hasattr(layer.mlp.gate, "e_score_correction_bias"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.3)
        model.lm_head.weight.mul_(3.0)  # clearer argmaxes
    model.save_pretrained(out_dir)
    toy_tokenizer.save_tokenizer(out_dir, VOCAB, 256)
    return out_dir


@pytest.fixture(scope="module", params=list(ARCHS))
def checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = write_checkpoint(request.param, str(tmp_path_factory.mktemp(request.param)), seed=1)
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def test_a_batch_of_mixed_lengths_equals_transformers(checkpoint):
    path, hf = checkpoint
    prompts = [prompt(n, i) for i, n in enumerate((3, 29, 1, 17))]
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4)
    outs = greedy(llm, prompts)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_greedy(hf, p) for p in prompts]
    llm.engine.check_integrity()


def test_chunked_prefill_and_a_prefix_cache_hit_equal_transformers(checkpoint):
    path, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    shared = prompt(21, 7)
    first = greedy(llm, [shared])[0]  # 21 prompt tokens in chunks of at most 8
    assert list(first.outputs[0].token_ids) == hf_greedy(hf, shared)
    longer = shared + prompt(6, 8)
    second = greedy(llm, [longer])[0]
    assert second.num_cached_tokens >= 20  # the shared prompt's 5 full blocks of 4, read back as latents
    assert list(second.outputs[0].token_ids) == hf_greedy(hf, longer)
    llm.engine.check_integrity()


def test_the_torch_groups_path_equals_transformers(checkpoint, monkeypatch):
    """Without the C++ kernel (another dtype, no build, CUDA): fresh prompts expanded, the rest absorbed over
    gathered latents; a mixed batch, then a chunked prompt that hits the cached prefix."""
    monkeypatch.setattr(attn_latent, "kernel_takes", lambda *args: False)
    path, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    prompts = [prompt(n, 40 + i) for i, n in enumerate((3, 13, 1))]
    assert [list(o.outputs[0].token_ids) for o in greedy(llm, prompts)] == [hf_greedy(hf, p) for p in prompts]
    longer = prompts[1] + prompt(5, 50)
    hit = greedy(llm, [longer])[0]
    assert hit.num_cached_tokens >= 12  # the 13-token prompt's 3 full blocks of 4
    assert list(hit.outputs[0].token_ids) == hf_greedy(hf, longer)
    llm.engine.check_integrity()


def test_the_triton_backend_and_the_graph_buffers_equal_transformers(checkpoint):
    """The latent cache read by the Triton kernel (on CPU through Triton's interpreter): chunked prompts beside
    decode rows through the mixed-step buffers (padded to 16 tokens, the tiles past a step's on the empty row),
    then decode steps through the decode buffers (run eagerly here; tests/gpu captures them)."""
    pytest.importorskip("triton")
    import graph_buffers

    path, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=64, num_kv_blocks=64, block_size=4, max_num_batched_tokens=16,
              attention_backend="triton", enforce_eager=True)
    runner = llm.engine.runner
    assert runner.attn_backend.name == "triton"
    decode_runs = graph_buffers.attach(runner, "decode", max_blocks=16)
    mixed_runs = graph_buffers.attach(runner, "mixed", max_blocks=16, max_tokens=16, max_rows=3)
    prompts = [prompt(n, 60 + i) for i, n in enumerate((3, 21, 1))]
    # 4 tokens, not NUM_OUT: each decode step runs 16 flash-decoding splits a layer in Triton's interpreter
    num_out = 4
    outs = hf_parity.engine_greedy(llm, prompts, num_out)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_parity.hf_greedy(hf, p, num_out) for p in prompts]
    assert decode_runs and {tokens for tokens, _ in decode_runs} <= {1, 2, 3}  # decode steps through the buffers
    assert (16, 16) in mixed_runs and any(tokens < 16 for tokens, _ in mixed_runs)
    llm.engine.check_integrity()


def test_preemption_under_a_small_cache_equals_transformers(checkpoint):
    path, hf = checkpoint
    prompts = [prompt(n, 20 + i) for i, n in enumerate((20, 17, 22, 19))]
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=33, block_size=4)
    outs = greedy(llm, prompts, num_out=16)
    assert llm.num_preemptions > 0, "the small pool was meant to force preemption"
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_parity.hf_greedy(hf, p, 16) for p in prompts]
    llm.engine.check_integrity()


def test_ngram_speculation_verifies_over_the_latent_cache_as_transformers(checkpoint):
    path, hf = checkpoint
    repeated = prompt(8, 30) * 3
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4, speculative="ngram",
              num_speculative_tokens=3)
    assert list(greedy(llm, [repeated])[0].outputs[0].token_ids) == hf_greedy(hf, repeated)
    llm.engine.check_integrity()


def test_routing_and_layers_are_those_transformers_builds(checkpoint):
    """The dense and MoE layers, the softmax scale, and each token's experts and weights equal transformers'."""
    path, hf = checkpoint
    model = load_model(path, torch.float32, "cpu")
    hf_is_moe = [hasattr(layer.mlp, "experts") for layer in hf.model.layers]
    assert [isinstance(layer.mlp, SparseMoeBlock) for layer in model.model.layers] == hf_is_moe == [False, True, True]
    for ours, theirs in zip(model.model.layers, hf.model.layers, strict=True):
        assert ours.self_attn.scale == pytest.approx(theirs.self_attn.scaling, rel=1e-12)
    x = torch.randn(64, 64, generator=torch.Generator().manual_seed(0))
    block, hf_router = model.model.layers[1].mlp, hf.model.layers[1].mlp.gate
    logits = x @ block.gate.weight.T
    weights, ids = route_grouped(logits, block.spec, block.gate.e_score_correction_bias)
    _, hf_weights, hf_ids = hf_router(x)
    order, hf_order = ids.argsort(dim=-1), hf_ids.argsort(dim=-1)  # torch.topk's order is unspecified
    assert torch.equal(ids.gather(1, order), hf_ids.gather(1, hf_order))
    torch.testing.assert_close(weights.gather(1, order), hf_weights.gather(1, hf_order))


def test_a_bfloat16_model_keeps_its_router_float32(checkpoint):
    """As transformers keeps gate.weight (and V3's e_score_correction_bias) float32: a bf16 bias would move the
    choice."""
    path, _ = checkpoint
    model = load_model(path, torch.bfloat16, "cpu")
    block = model.model.layers[1].mlp
    router = [t for t in (block.gate.weight, block.gate.e_score_correction_bias) if t is not None]
    assert {t.dtype for t in router} == {torch.float32}
    assert block.experts.gate_up_proj.dtype == model.model.layers[1].self_attn.o_proj.weight.dtype == torch.bfloat16


def test_the_latent_cache_holds_one_entry_a_token_and_sizes_the_blocks(checkpoint):
    path, _ = checkpoint
    budget = 2**20
    llm = LLM(path, dtype="float32", max_model_len=128, kv_cache_memory=str(budget), block_size=4)
    caches = llm.engine.runner.kv_caches
    per_token = (KV_LORA + ROPE) * LAYERS * 4  # float32
    assert kv_bytes_per_token(caches) == per_token
    assert llm.engine.num_blocks == budget // (4 * per_token)
    assert [tuple(c.shape) for c in caches] == [(1, llm.engine.num_blocks, 4, 1, KV_LORA + ROPE)] * LAYERS


def test_a_draft_model_beside_a_latent_cache_sizes_blocks_by_both_layouts(tmp_path):
    target = make_model("deepseek_v3", "tiny-deepseek-v3", str(tmp_path / "target"), seed=3)
    draft = make_model("llama", "tiny", str(tmp_path / "draft"), seed=4)  # 2 layers of 2 kv heads of 16
    budget = 2**20
    llm = LLM(target, dtype="float32", max_model_len=128, kv_cache_memory=str(budget), block_size=4,
              speculative="draft", draft_model=draft, num_speculative_tokens=2)
    per_token = (KV_LORA + ROPE) * LAYERS * 4 + 2 * 2 * 2 * 16 * 4  # latents, then the draft's K and V
    assert llm.engine.num_blocks == budget // (4 * per_token)
    assert len(greedy(llm, [prompt(9, 1)])[0].outputs[0].token_ids) == NUM_OUT
    llm.engine.check_integrity()


def test_deepseek_v3_shape_caches_57x_fewer_bytes_than_per_head_k_and_v():
    config = build_config("deepseek_v3", SHAPES["deepseek-v3"], "bfloat16")
    with torch.device("meta"):
        model = CausalLM(config)
    entry = model.kv_cache_shape(1, 1)
    assert entry == (1, 1, 1, 1, 512 + 64)
    per_head_kv = 2 * config.num_attention_heads * config.v_head_dim  # 128 heads of K and V, 128 wide
    assert per_head_kv / (512 + 64) == pytest.approx(56.9, abs=0.1)


@pytest.mark.parametrize(("arch", "field", "match"), [
    ("v3", dict(scoring_func="softmax"), "scoring_func='softmax' is not supported for DeepseekV3ForCausalLM"),
    ("v3", dict(n_group=8), "n_group=8 leaves fewer than 2 experts per group"),
    ("v2", dict(topk_method="noaux_tc"), "topk_method='noaux_tc' is not supported for DeepseekV2ForCausalLM"),
    ("v2", dict(norm_topk_prob=True), "norm_topk_prob=True is not supported"),
    ("v2", dict(hidden_act="gelu"), "hidden_act='gelu'"),
])
def test_a_config_field_the_decoder_does_not_run_is_refused_by_name(tmp_path, arch, field, match):
    path = write_checkpoint(arch, str(tmp_path / "ckpt"), **field)
    with pytest.raises(ValueError, match=match):
        load_model(path, torch.float32, "cpu")


@pytest.mark.parametrize(("kv_cache_dtype", "bytes_a_layer"), [
    ("fp16", (KV_LORA + ROPE) * 2), ("fp8", KV_LORA + ROPE), ("int8", KV_LORA + ROPE + 4)])  # int8: its scale
def test_a_float16_fp8_or_int8_latent_cache_holds_its_bytes_a_token_and_serves(checkpoint, kv_cache_dtype,
                                                                             bytes_a_layer):
    """The latent cache in float16 (the C++ kernel widens it), fp8 (the torch groups do) or int8 (the kernel's
    AVX2 path): its bytes a token, and greedy tokens through chunked prompts and decode (the attention's error:
    tests/unit/test_mla_attention.py), mostly transformers' own."""
    if kv_cache_dtype == "int8" and not cpu_kernels.has_avx2_kernels():
        pytest.skip("--kv-cache-dtype int8 runs with the C++ kernels' AVX2 build")
    path, hf = checkpoint
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4, max_num_batched_tokens=8,
              kv_cache_dtype=kv_cache_dtype)
    assert kv_bytes_per_token(llm.engine.runner.kv_caches) == bytes_a_layer * LAYERS
    prompts = [prompt(n, 70 + i) for i, n in enumerate((3, 13, 1))]
    got = [list(o.outputs[0].token_ids) for o in greedy(llm, prompts)]
    want = [hf_greedy(hf, p) for p in prompts]
    assert sum(a == b for g, w in zip(got, want) for a, b in zip(g, w)) >= 0.8 * NUM_OUT * len(prompts)
    llm.engine.check_integrity()


@pytest.mark.skipif(not cpu_kernels.has_avx2_kernels(), reason="--kv-cache-dtype int8 runs with the AVX2 build")
def test_an_int8_latent_cache_serves_as_a_float32_cache_of_its_dequantized_entries(checkpoint, monkeypatch):
    """Against the float cache: within the other quantized caches' tolerance (8 tokens in 10 alike), and bit for bit
    the tokens of a float32 cache whose entries are rounded through int8 as they are made (chunked prompts, a
    prefix-cache hit, decode: every read sees the rounded entries)."""
    path, _ = checkpoint
    engine = dict(dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4, max_num_batched_tokens=8)
    prompts = [prompt(n, 80 + i) for i, n in enumerate((3, 13, 1, 21))]
    prompts.append(prompts[3] + prompt(6, 90))  # hits the 21-token prompt's cached blocks

    def tokens(llm: LLM) -> list[list[int]]:
        outs = [greedy(llm, prompts[:4]), greedy(llm, prompts[4:])]
        assert outs[1][0].num_cached_tokens >= 20
        llm.engine.check_integrity()
        return [list(o.outputs[0].token_ids) for batch in outs for o in batch]

    int8_llm = LLM(path, kv_cache_dtype="int8", **engine)
    assert int8_llm.engine.runner.kv_caches[0].dtype == torch.int8
    got, plain = tokens(int8_llm), tokens(LLM(path, **engine))
    assert sum(a == b for g, p in zip(got, plain) for a, b in zip(g, p)) >= 0.8 * NUM_OUT * len(prompts)
    latent_entries = MlaAttention._latent_entries
    monkeypatch.setattr(MlaAttention, "_latent_entries", lambda self, x, cos_sin: dequantize_int8_rows(
        quantize_int8_rows(latent_entries(self, x, cos_sin).float())))
    assert tokens(LLM(path, **engine)) == got


def test_make_model_writes_deepseek_shapes_transformers_runs(tmp_path):
    from transformers import AutoModelForCausalLM

    path = make_model("deepseek_v3", "tiny-deepseek-v3", str(tmp_path / "tiny"), seed=3, is_peaked=True)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4)
    p = prompt(12, 5)
    assert list(greedy(llm, [p])[0].outputs[0].token_ids) == hf_greedy(hf, p)
    with pytest.raises(ValueError, match="latent-attention shapes .* are for deepseek_v2, deepseek_v3"):
        make_model("mixtral", "tiny-deepseek-v3", str(tmp_path / "a"))
    with pytest.raises(ValueError, match="got arch 'deepseek_v3'"):
        make_model("deepseek_v3", "tiny-moe", str(tmp_path / "b"))
