"""The decoder stack's head (model/cpu_decode_head.py): a CPU decode step's embedding, rotary, layers, final norm and
logits in one C++ call give `forward` + `compute_logits`' hidden rows and logits bit for bit (bfloat16 GEMV and
float32 panels, tied and untied heads, any rows sampled); heads it cannot run so keep the Python prologue/epilogue;
a served model's decode steps take the one call and still give transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

import hf_parity

from llmserve import LLM
from llmserve.model import cpu_decode_head, cpu_decode_stack, cpu_isa, cpu_kernels
from llmserve.model import linear as linear_mod
from llmserve.model.attention import select_attention_backend
from llmserve.model.loader import load_model
from llmserve.testing import toy_tokenizer
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches

BF16 = torch.bfloat16
VOCAB = 512
# LLMSERVE_CPU_LINEAR=onednn: no model takes the stack (tests/unit/test_cpu_decode_stack.py checks that)
pytestmark = pytest.mark.skipif(cpu_isa.linear_path() == "onednn", reason="oneDNN's linears: the stack takes no model")
needs_gemv = pytest.mark.skipif(not cpu_kernels.has_bf16_gemv(), reason="no AVX512-BF16 build")
needs_avx2 = pytest.mark.skipif(not cpu_kernels.has_avx2_kernels(), reason="no AVX2 build")


def _write_checkpoint(path: str, arch: str, is_tied: bool) -> str:
    import transformers

    config_class = {"llama": transformers.LlamaConfig, "qwen3": transformers.Qwen3Config}[arch]
    config = config_class(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                          initializer_range=0.1, tie_word_embeddings=is_tied, eos_token_id=2, pad_token_id=0,
                          bos_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    toy_tokenizer.save_tokenizer(path, VOCAB, 256)
    return path


@pytest.fixture
def packs_small_weights(monkeypatch):
    """float32 linears (and the tied table) of every size packed for the panel kernels."""
    monkeypatch.setattr(linear_mod, "MIN_ONEDNN_WEIGHT", 1)


def _both_ways(model, dtype: torch.dtype, num_rows: int):
    """((hidden, logits) in one call, (hidden, logits) through Python) of three decode steps of num_rows rows, the
    logits of every row, then of the rows in reverse with the first left out."""
    stack = model.decode_stack
    backend = select_attention_backend(torch.device("cpu"), "auto", dtype)
    caches = allocate_kv_caches(model, 64, 4, dtype=dtype)
    builder = PagedBatchBuilder(64, 4, seed=3)
    for row in range(num_rows):
        builder.add_cached(row, 5 + 7 * row)
    with torch.inference_mode():
        for step in range(3):
            ids, positions, inputs = builder.step([(row, [7 + row + step]) for row in range(num_rows)])
            picks = torch.arange(num_rows) if step != 1 else torch.arange(num_rows - 1, 0, -1)  # [N] int64
            assert stack.takes(backend.build_metadata(inputs), caches[0])
            outs = []
            for use_stack in (True, False):  # both write the same K/V
                model.decode_stack = stack if use_stack else None
                outs.append(model.forward_logits(ids, positions, caches, backend.build_metadata(inputs), backend,
                                                 picks))
            yield outs
    model.decode_stack = stack


@pytest.mark.parametrize("arch,is_tied", [("llama", True), ("llama", False), ("qwen3", True)])
@pytest.mark.parametrize("dtype,num_rows", [pytest.param(BF16, 1, marks=needs_gemv, id="bf16-1"),
                                            pytest.param(BF16, 6, marks=needs_gemv, id="bf16-6"),  # at::linear
                                            pytest.param(torch.float32, 1, marks=needs_avx2, id="f32-1"),
                                            pytest.param(torch.float32, 5, marks=needs_avx2, id="f32-5")])
def test_one_call_gives_forward_and_compute_logits_bit_for_bit(tmp_path, packs_small_weights, arch, is_tied, dtype,
                                                               num_rows):
    model = load_model(_write_checkpoint(str(tmp_path), arch, is_tied), dtype, "cpu", 128)
    model.decode_stack = cpu_decode_stack.build(model)
    assert model.decode_stack is not None and model.decode_stack.has_head
    for (hidden, logits), (py_hidden, py_logits) in _both_ways(model, dtype, num_rows):
        assert logits.dtype == torch.float32 and logits.shape[1] == VOCAB
        assert torch.equal(hidden, py_hidden) and torch.equal(logits, py_logits)


@needs_avx2
@pytest.mark.parametrize("num_table_positions", [8, 0])  # past the table from the second row on; no table rows
def test_positions_past_the_rotary_table_are_computed_with_the_same_bits(tmp_path, packs_small_weights, monkeypatch,
                                                                           num_table_positions):
    monkeypatch.setattr(cpu_decode_head, "MAX_TABLE_POSITIONS", num_table_positions)
    model = load_model(_write_checkpoint(str(tmp_path), "llama", True), torch.float32, "cpu", 128)
    model.decode_stack = cpu_decode_stack.build(model)
    assert model.decode_stack.has_head
    for (hidden, logits), (py_hidden, py_logits) in _both_ways(model, torch.float32, 3):
        assert torch.equal(hidden, py_hidden) and torch.equal(logits, py_logits)


@needs_avx2
def test_a_head_it_cannot_run_so_stays_in_python(tmp_path, packs_small_weights):
    model = load_model(_write_checkpoint(str(tmp_path), "llama", True), torch.float32, "cpu", 128)
    model.tied_head_packed = None  # compute_logits then takes the plain table through oneDNN
    model.decode_stack = cpu_decode_stack.build(model)
    assert model.decode_stack is not None and not model.decode_stack.has_head
    for (hidden, logits), (py_hidden, py_logits) in _both_ways(model, torch.float32, 2):
        assert torch.equal(hidden, py_hidden) and torch.equal(logits, py_logits)


@needs_gemv
def test_a_served_model_decodes_in_one_call_with_transformers_tokens(tmp_path):
    import transformers

    path = _write_checkpoint(str(tmp_path), "llama", False)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=BF16).eval()
    prompts = [hf_parity.random_prompt(n, i, VOCAB) for i, n in enumerate((5, 23, 1))]
    llm = LLM(path, dtype="bfloat16", max_model_len=128, num_kv_blocks=64, block_size=4)
    stack = llm.engine.runner.model.decode_stack
    calls = []
    run_step = stack.step
    stack.step = lambda *args: calls.append(args[0].shape[0]) or run_step(*args)
    outs = hf_parity.engine_greedy(llm, prompts, num_out=8)
    assert len(prompts) in calls  # the decode steps ran in one call (the prompts' step too, where the kernel takes it)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_parity.hf_greedy(hf, p, 8) for p in prompts]
    llm.engine.check_integrity()
