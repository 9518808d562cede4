"""MoE layers inside the C++ decoder stack (model/cpu_stack_moe.py, csrc/moe_layer.cpp): a float32 Qwen3-MoE or
Mixtral decode step is one C++ call whose logits and expert load equal the Python layers' bit for bit (routing ties
included, top-k past 2, with and without norm_topk_prob); the models and layers it does not take keep their MLPs in
Python between the attention halves; and a served model through it gives transformers' greedy tokens."""

from __future__ import annotations

import pytest
import torch

import hf_parity
from test_moe_models import _record_expert_balance, write_checkpoint

from llmserve import LLM
from llmserve.model import cpu_decode_stack, cpu_kernels, cpu_stack_moe
from llmserve.model import linear as linear_mod
from llmserve.model.attention import select_attention_backend
from llmserve.model.loader import load_model
from llmserve.testing.maker import make_model
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches

VOCAB = 512  # test_moe_models' checkpoints and make_model's tiny shapes
pytestmark = pytest.mark.skipif(not (cpu_kernels.available() and cpu_kernels.packs_linears()),
                                reason="float32 linears not packed as our panels (no AVX2 build, or oneDNN's layout)")


@pytest.fixture
def packs_small_weights(monkeypatch):
    """float32 linears and experts of every size packed for the panel kernels (the test models' are smaller than
    the threshold under which F.linear keeps them)."""
    monkeypatch.setattr(linear_mod, "MIN_ONEDNN_WEIGHT", 1)


def _one_call_model(path: str, change=None):
    """The model with its stack, built after change(model) where given."""
    model = load_model(path, torch.float32, "cpu", 128)
    if change is not None:
        change(model)
    model.decode_stack = cpu_decode_stack.build(model)
    assert model.decode_stack is not None and model.decode_stack.mlps is None  # whole layers: one call a step
    assert model.decode_stack.stack.has_mlps()
    return model


def _loads(model) -> torch.Tensor:
    """The MoE layers' tokens per expert since the last call [L, E] (then zeroed)."""
    counts = torch.stack([block.load.counts.clone() for block in model.moe_blocks()])
    for block in model.moe_blocks():
        block.load.counts.zero_()
    return counts


def _check_steps(model, num_rows: int, num_steps: int = 3) -> list[torch.Tensor]:
    """Prompts of mixed lengths through the Python layers, then decode steps of num_rows rows each run through the
    stack and through the Python layers (both write the same K/V): the same logits and the same expert load, bit
    for bit. Returns each step's load [L, E]."""
    backend = select_attention_backend(torch.device("cpu"), "auto", torch.float32)
    caches = allocate_kv_caches(model, 64 + 8 * num_rows, 4)
    builder = PagedBatchBuilder(64 + 8 * num_rows, 4, seed=2)
    stack, loads = model.decode_stack, []
    gen = torch.Generator().manual_seed(num_rows)
    prompts = [torch.randint(3, VOCAB, (3 + 5 * (row % 4),), generator=gen).tolist() for row in range(num_rows)]
    with torch.inference_mode():
        model.decode_stack = None
        ids, positions, inputs = builder.step(list(enumerate(prompts)))
        model(ids, positions, caches, backend.build_metadata(inputs), backend)
        _loads(model)
        for step in range(num_steps):
            ids, positions, inputs = builder.step([(row, [7 + row + step]) for row in range(num_rows)])
            assert stack.takes(backend.build_metadata(inputs), caches[0])
            logits = []
            for use_stack in (True, False):
                model.decode_stack = stack if use_stack else None
                hidden = model(ids, positions, caches, backend.build_metadata(inputs), backend)
                logits.append(model.compute_logits(hidden))
                loads.append(_loads(model))
            assert torch.equal(logits[0], logits[1])
            assert torch.equal(loads[-2], loads[-1])
    model.decode_stack = stack
    return loads[::2]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
@pytest.mark.parametrize("num_rows", [1, 5, 16])
def test_an_moe_step_in_one_call_gives_the_python_layers_logits_and_load(tmp_path, packs_small_weights, arch,
                                                                         num_rows):
    model = _one_call_model(make_model(arch, "tiny-moe", str(tmp_path)))
    top_k = model.moe_blocks()[0].spec.top_k
    for load in _check_steps(model, num_rows):
        assert (load.sum(dim=1) == num_rows * top_k).all()  # every layer counted each token's k experts


@pytest.mark.parametrize("norm_topk_prob", [True, False])
def test_top_k_past_two_with_and_without_renormalised_weights(tmp_path, packs_small_weights, norm_topk_prob):
    path = write_checkpoint("qwen3_moe", str(tmp_path), num_experts_per_tok=4, norm_topk_prob=norm_topk_prob,
                            mlp_only_layers=[])
    _check_steps(_one_call_model(path), num_rows=6)


def test_routing_ties_go_to_the_lower_expert_ids_as_in_python(tmp_path, packs_small_weights):
    def tie(model):
        blocks = model.moe_blocks()
        with torch.no_grad():
            blocks[0].gate.weight.zero_()  # layer 0: every logit equal, so experts 0 and 1 for every token
            blocks[1].gate.weight[5:] = blocks[1].gate.weight[4]  # layer 1: experts 4-7 tie on every token

    model = _one_call_model(make_model("qwen3_moe", "tiny-moe", str(tmp_path)), tie)
    loads = _check_steps(model, num_rows=5)
    for load in loads:
        assert load[0].tolist() == [5, 5, 0, 0, 0, 0, 0, 0]
        assert load[1, 6:].sum() == 0 and load[1, 5] <= load[1, 4]  # of 4-7 only 4, then 5, are ever taken
    assert sum(load[1, 4] for load in loads) > 0  # the tie was at the top for some tokens


@pytest.mark.parametrize("fields,reason", [
    (dict(mlp_only_layers=[1]), "layer 1: a GatedMLP, not an MoE block"),
    (dict(mlp_only_layers=[], moe_intermediate_size=24), "layer 0: an expert's width is not a multiple of 16"),
])
def test_layers_it_does_not_take_keep_their_mlps_in_python(tmp_path, packs_small_weights, fields, reason):
    path = write_checkpoint("qwen3_moe", str(tmp_path), **fields)
    model = load_model(path, torch.float32, "cpu", 128)
    assert cpu_stack_moe.decline_reason(model.model.layers, True).startswith(reason)
    model.decode_stack = cpu_decode_stack.build(model)
    assert model.decode_stack.mlps is not None and not model.decode_stack.stack.has_mlps()  # the attention halves
    _check_steps(model, num_rows=3, num_steps=1)


def test_unpacked_or_bf16_experts_keep_their_mlps_in_python(tmp_path):
    path = make_model("qwen3_moe", "tiny-moe", str(tmp_path))
    unpacked = load_model(path, torch.float32, "cpu", 128)  # experts under the size packing takes: F.linear
    assert "not stacked in our kernels' panels" in cpu_stack_moe.decline_reason(unpacked.model.layers, True)
    bf16 = load_model(path, torch.bfloat16, "cpu", 128)
    assert cpu_stack_moe.decline_reason(bf16.model.layers, False).startswith("not a float32 model")


def test_a_served_moe_model_decodes_in_one_call_with_transformers_tokens(tmp_path, packs_small_weights, monkeypatch):
    import transformers

    path = make_model("qwen3_moe", "tiny-moe", str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = [hf_parity.random_prompt(n, i, VOCAB) for i, n in enumerate((5, 23, 1))]
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=64, block_size=4)
    stack = llm.engine.runner.model.decode_stack
    assert stack.mlps is None and stack.has_head  # the whole forward, the embedding to the logits, in one call
    calls = []
    for name in ("forward", "step"):  # the layers' call, and the whole step's
        run = getattr(stack, name)
        setattr(stack, name, lambda *args, run=run: calls.append(args[0].shape[0]) or run(*args))
    balances = _record_expert_balance(llm, monkeypatch)
    outs = hf_parity.engine_greedy(llm, prompts, num_out=8)
    assert calls.count(len(prompts)) >= 7  # the decode steps ran through it (the float32 prompts' step too)
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_parity.hf_greedy(hf, p, 8) for p in prompts]
    llm.engine.check_integrity()
    assert balances and all(1.0 <= b <= 8 / 2 for b in balances)  # the metric, from the C++ layers' counts


@pytest.mark.parametrize("arch,shape", [("qwen3_moe", "tiny-moe"), ("qwen3", "tiny")])
def test_one_call_steps_through_chunked_prefill_a_prefix_hit_and_preemption_give_transformers_tokens(
        tmp_path, packs_small_weights, arch, shape):
    """The whole step in one call (an MoE model's layers, or a dense one's, with the head) across the scheduler's
    paths: prompts in chunks of at most 8 tokens, a prefix-cache hit, and preemption under a small cache."""
    import transformers

    path = make_model(arch, shape, str(tmp_path))
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    llm = LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=33, block_size=4, max_num_batched_tokens=8)
    stack = llm.engine.runner.model.decode_stack
    assert stack is not None and stack.mlps is None and stack.has_head
    calls = []
    run = stack.step
    stack.step = lambda *args: calls.append(args[0].shape[0]) or run(*args)
    shared = hf_parity.random_prompt(21, 7, VOCAB)
    prompts = [shared, shared + hf_parity.random_prompt(6, 8, VOCAB),
               *(hf_parity.random_prompt(n, 20 + i, VOCAB) for i, n in enumerate((20, 17, 22)))]
    first = hf_parity.engine_greedy(llm, prompts[:1], num_out=16)  # then the others hit its prefix
    outs = first + hf_parity.engine_greedy(llm, prompts[1:], num_out=16)
    assert outs[1].num_cached_tokens >= 20 and llm.num_preemptions > 0 and calls
    assert [list(o.outputs[0].token_ids) for o in outs] == [hf_parity.hf_greedy(hf, p, 16) for p in prompts]
    llm.engine.check_integrity()
