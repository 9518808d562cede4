"""The C++ decoder stack (model/cpu_decode_stack.py): a decode step's logits equal the Python layers' bit for bit
(bfloat16 GEMV and float32 panels; q/k/v biases; a sliding window), it declines the steps and models it does not
take, and a served model through it still gives transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

import hf_parity

from llmserve import LLM
from llmserve.model import cpu_decode_stack, cpu_isa, cpu_kernels
from llmserve.model import linear as linear_mod
from llmserve.model.attention import select_attention_backend
from llmserve.model.attn_torch import TorchAttentionBackend
from llmserve.model.lora_layers import attach_lora
from llmserve.model.loader import load_model
from llmserve.testing import toy_tokenizer
from llmserve.testing.maker import make_model
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches

BF16 = torch.bfloat16
VOCAB = 512
# LLMSERVE_CPU_LINEAR=onednn: no model takes the stack (the test below checks that), so its other tests skip
pytestmark = pytest.mark.skipif(cpu_isa.linear_path() == "onednn", reason="oneDNN's linears: the stack takes no model")
needs_kernels = pytest.mark.skipif(not cpu_kernels.available(), reason="CPU kernels not built")
needs_gemv = pytest.mark.skipif(not cpu_kernels.has_bf16_gemv(), reason="no AVX512-BF16 build")
needs_avx2 = pytest.mark.skipif(not cpu_kernels.has_avx2_kernels(), reason="no AVX2 build")


def _write_checkpoint(path: str, arch: str, **extra) -> str:
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
                    "mistral": transformers.MistralConfig, "qwen3": transformers.Qwen3Config}[arch]
    config = config_class(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=3,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          initializer_range=0.1, tie_word_embeddings=True, eos_token_id=2, pad_token_id=0,
                          bos_token_id=None, **extra)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(path)
    toy_tokenizer.save_tokenizer(path, VOCAB, 256)
    return path


@pytest.fixture
def packs_small_weights(monkeypatch):
    """float32 linears of every size packed for the panel kernels (the test models are smaller than the
    threshold under which F.linear keeps them)."""
    monkeypatch.setattr(linear_mod, "MIN_ONEDNN_WEIGHT", 1)


def _decode_steps(model, dtype: torch.dtype, num_rows: int):
    """(logits with the stack, logits without) of three decode steps of num_rows rows after prompts of mixed
    lengths (and of the prompts' step too where the stack takes it)."""
    backend = select_attention_backend(torch.device("cpu"), "auto", dtype)
    caches = allocate_kv_caches(model, 64, 4, dtype=dtype)
    builder = PagedBatchBuilder(64, 4, seed=2)
    stack = model.decode_stack
    gen = torch.Generator().manual_seed(num_rows)
    prompts = [torch.randint(3, VOCAB, (5 + 7 * row,), generator=gen).tolist() for row in range(num_rows)]
    with torch.inference_mode():
        ids, positions, inputs = builder.step(list(enumerate(prompts)))
        if stack.takes(backend.build_metadata(inputs), caches[0]):  # float32 prompts: the kernel's rows
            yield _logits_both_ways(model, stack, backend, caches, ids, positions, inputs)
        else:
            model.decode_stack = None
            model(ids, positions, caches, backend.build_metadata(inputs), backend)
        for step in range(3):
            ids, positions, inputs = builder.step([(row, [7 + row + step]) for row in range(num_rows)])
            assert stack.takes(backend.build_metadata(inputs), caches[0])
            yield _logits_both_ways(model, stack, backend, caches, ids, positions, inputs)
    model.decode_stack = stack


def _logits_both_ways(model, stack, backend, caches, ids, positions, inputs) -> list[torch.Tensor]:
    """The step's logits with the stack, then through the Python layers (both write the same K/V)."""
    logits = []
    for use_stack in (True, False):
        model.decode_stack = stack if use_stack else None
        logits.append(model.compute_logits(model(ids, positions, caches, backend.build_metadata(inputs), backend)))
    return logits


@needs_kernels
@pytest.mark.parametrize("arch,extra", [("llama", {}), ("qwen2", {}), ("qwen3", {}), ("mistral", {"sliding_window": 9})])
@pytest.mark.parametrize("dtype,num_rows", [pytest.param(BF16, 1, marks=needs_gemv),
                                            pytest.param(BF16, 4, marks=needs_gemv),
                                            pytest.param(BF16, 6, marks=needs_gemv),  # past the GEMV: at::linear
                                            pytest.param(torch.float32, 1, marks=needs_avx2),
                                            pytest.param(torch.float32, 6, marks=needs_avx2)])
def test_the_stack_gives_the_python_layers_logits_bit_for_bit(tmp_path, packs_small_weights, arch, extra, dtype,
                                                              num_rows):
    model = load_model(_write_checkpoint(str(tmp_path), arch, **extra), dtype, "cpu", 128)
    model.decode_stack = cpu_decode_stack.build(model)
    assert model.decode_stack is not None
    if extra:
        assert model.model.layers[0].self_attn.window == 9  # contexts reach past it: the window is exercised
    for with_stack, without in _decode_steps(model, dtype, num_rows):
        assert torch.equal(with_stack, without)


@needs_gemv
def test_the_stack_declines_steps_it_does_not_take(tmp_path):
    model = load_model(_write_checkpoint(str(tmp_path), "llama"), BF16, "cpu", 128)
    stack = cpu_decode_stack.build(model)
    backend = select_attention_backend(torch.device("cpu"), "auto", BF16)
    caches = allocate_kv_caches(model, 64, 4, dtype=BF16)
    builder = PagedBatchBuilder(64, 4)
    _, _, prompt_inputs = builder.step([(0, [5, 6, 7])])
    assert stack.takes(backend.build_metadata(prompt_inputs), caches[0]) == cpu_kernels.attends_prompts(BF16)
    short_kernel_prompts = TorchAttentionBackend(kernel_takes_prompts=True, max_kernel_prompt_seq_len=2)
    prompt = short_kernel_prompts.build_metadata(prompt_inputs)
    assert prompt.groups and not stack.takes(prompt, caches[0])  # a prompt past it goes to torch's attention groups
    _, _, inputs = builder.step([(0, [8])])
    decode = backend.build_metadata(inputs)
    assert stack.takes(decode, caches[0])
    assert not stack.takes([decode] * model.num_layers, caches[0])  # one metadata a KV cache group
    assert not stack.takes(decode, caches[0].float())  # a cache the bf16 kernels do not read


@needs_gemv
def test_the_stack_is_not_built_where_it_would_change_the_model(tmp_path, monkeypatch):
    llama = _write_checkpoint(str(tmp_path / "llama"), "llama")
    lora_model = load_model(llama, BF16, "cpu", 128)
    attach_lora(lora_model, num_slots=2, max_rank=8)  # adapters' products live in the Python layers
    assert cpu_decode_stack.build(lora_model) is None
    gemma = load_model(make_model("gemma3", "tiny-gemma3", str(tmp_path / "gemma3")), BF16, "cpu", 128)
    assert cpu_decode_stack.build(gemma) is None  # its own norms, GeLU MLP, embedding scale, sandwich norms
    gpt_oss = load_model(make_model("gpt_oss", "tiny-gpt-oss", str(tmp_path / "gpt-oss")), BF16, "cpu", 128)
    assert cpu_decode_stack.build(gpt_oss) is None  # attention sinks
    monkeypatch.setenv(cpu_isa.LINEAR_ENV, "onednn")  # every linear oneDNN's, which the stack does not run
    assert cpu_decode_stack.build(load_model(llama, BF16, "cpu", 128)) is None
    assert cpu_decode_stack.build(load_model(llama, torch.float32, "cpu", 128)) is None
    monkeypatch.delenv(cpu_isa.LINEAR_ENV)
    monkeypatch.setenv(cpu_decode_stack.ENV, "0")
    assert cpu_decode_stack.build(load_model(llama, BF16, "cpu", 128)) is None


@needs_gemv
def test_a_served_bf16_model_decodes_through_the_stack_with_transformers_tokens(tmp_path):
    import transformers

    path = _write_checkpoint(str(tmp_path), "llama")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=BF16).eval()
    prompts = [hf_parity.random_prompt(n, i, VOCAB) for i, n in enumerate((5, 23, 1))]
    llm = LLM(path, dtype="bfloat16", max_model_len=128, num_kv_blocks=64, block_size=4)
    stack = llm.engine.runner.model.decode_stack
    calls = []
    for name in ("forward", "step"):  # the layers' call, or the whole forward's (model/cpu_decode_head.py)
        run = getattr(stack, name)
        setattr(stack, name, lambda *args, run=run: calls.append(args[0].shape[0]) or run(*args))
    outs = hf_parity.engine_greedy(llm, prompts, num_out=8)
    assert len(prompts) in calls  # the decode steps ran through it (the prompts' step too, where the kernel takes them)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_parity.hf_greedy(hf, p, 8) for p in prompts]
    llm.engine.check_integrity()


@needs_kernels
@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("dtype,num_rows", [pytest.param(BF16, 3, marks=needs_gemv),
                                            pytest.param(torch.float32, 5, marks=needs_avx2)])
def test_an_moe_models_attention_halves_give_the_python_layers_logits(tmp_path, packs_small_weights, arch, dtype,
                                                                      num_rows):
    """The stack holds an MoE model's attention halves (and in float32 its MoE layers: test_cpu_decode_stack_moe.py);
    in bfloat16 each layer's MLP (experts, routing, the expert-load count) runs in Python between them: the same
    logits bit for bit, and the same expert load recorded."""
    model = load_model(make_model(arch, "tiny-moe", str(tmp_path)), dtype, "cpu", 128)
    model.decode_stack = cpu_decode_stack.build(model)
    assert model.decode_stack is not None and (model.decode_stack.mlps is None) == (dtype == torch.float32)
    for with_stack, without in _decode_steps(model, dtype, num_rows):
        assert torch.equal(with_stack, without)
    assert model.take_expert_balance() is not None
