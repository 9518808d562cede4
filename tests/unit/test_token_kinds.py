"""Decode and prompt tokens of a step (model/quant/token_kinds.py) and how an FP8 layer routes them: decode
tokens through fp8_triton's decode kernel, prompt tokens through quantize_rows + `_scaled_mm`. The layer's
CUDA path runs here through Triton's interpreter (conftest.py sets it without CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from llmserve.model import quant
from llmserve.model.loader import load_model
from llmserve.testing.maker import make_model
from llmserve.model.quant.linear import Fp8Linear
from llmserve.model.quant.token_kinds import ALL_DECODE, ALL_PROMPT, StepKinds, token_kinds

CPU = torch.device("cpu")


def _kinds(positions, prompt_lens, counts):
    return token_kinds(np.array(positions, np.int64), np.array(prompt_lens, np.int64), np.array(counts, np.int64), CPU)


def test_one_token_rows_past_their_prompts_are_decode_tokens():
    assert _kinds([7, 20, 3], [5, 12, 3], [1, 1, 1]) is ALL_DECODE


def test_a_last_prompt_token_alone_in_its_row_is_a_prompt_token():
    """A prompt's last chunk of one token (a prefix-cache hit, a chunk boundary) stays on the prompt kernel:
    kinds follow positions, never a row's token count, so a token's kernel does not depend on the batch."""
    kinds = _kinds([11, 7], [12, 5], [1, 1])
    assert kinds.decode_index.tolist() == [1] and kinds.prompt_index.tolist() == [0]
    assert _kinds([0, 1, 2], [3], [3]) is ALL_PROMPT


def test_decode_tokens_before_the_prompts_are_a_split_not_index_sets():
    """The scheduler's usual order: running rows (decode, a verification) before new prompts. Then the
    layers take the step's first D tokens as decode rows, the rest as prompt rows: slices, no gathers."""
    kinds = _kinds([9, 12, 13, 14, 0, 1, 2], [4, 10, 8], [1, 3, 3])
    assert kinds.is_mixed and not kinds.is_all_decode
    assert kinds.num_leading_decode == 4 and kinds.decode_index is None and kinds.prompt_index is None
    assert _kinds([7, 11], [5, 12], [1, 1]).num_leading_decode == 1


def test_a_mixed_step_lists_both_kinds():
    """Rows: a decode row, a prompt chunk, a verification (token + 2 drafts), and a resumed request whose
    recomputed chunk crosses its prompt's end (its outputs are decode tokens, as when first computed)."""
    positions = [9, 0, 1, 2, 6, 7, 8, 3, 4, 5]
    kinds = _kinds(positions, [4, 8, 5, 4], [1, 3, 3, 3])
    assert not kinds.is_all_decode and kinds.is_mixed
    assert kinds.decode_index.tolist() == [0, 4, 5, 6, 8, 9]
    assert kinds.prompt_index.tolist() == [1, 2, 3, 7]


def test_step_kinds_hold_only_inside_using():
    step = StepKinds()
    assert step.current is ALL_PROMPT
    with step.using(ALL_DECODE):
        assert step.current is ALL_DECODE
    assert step.current is ALL_PROMPT
    with pytest.raises(RuntimeError), step.using(ALL_DECODE):
        raise RuntimeError("a failed forward")
    assert step.current is ALL_PROMPT


def test_fp8_layer_routes_each_token_to_its_kernel():
    from llmserve.model.quant import fp8_triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # row-wise _scaled_mm on CUDA: bf16
    gen = torch.Generator().manual_seed(4)
    layer = Fp8Linear.from_float((torch.randn(48, 256, generator=gen) * 0.05).to(device), None)
    layer.step_kinds = StepKinds()
    x = torch.randn(6, 256, generator=gen).to(device, dtype)  # [T, K]
    decode_all = fp8_triton.fp8_decode_matmul(x, layer.weight, layer.scale.reshape(-1))
    prompt_all = layer._prompt_matmul(x)
    if device.type == "cpu":  # two kernels, two summation orders (else nothing below is tested)
        assert not torch.equal(decode_all, prompt_all)
    assert torch.equal(layer._matmul_cuda(x), prompt_all)  # outside `using`: every token a prompt token
    with layer.step_kinds.using(ALL_DECODE):
        assert torch.equal(layer._matmul_cuda(x), decode_all)
    kinds = token_kinds(np.array([0, 1, 9, 2, 3, 10]), np.array([4, 4]), np.array([3, 3]), device)  # decode: 2, 5
    with layer.step_kinds.using(kinds):
        mixed = layer._matmul_cuda(x)
    decode_rows = fp8_triton.fp8_decode_matmul(x[[2, 5]], layer.weight, layer.scale.reshape(-1))
    assert torch.equal(mixed[[2, 5]], decode_rows)
    assert torch.equal(mixed[[0, 1, 3, 4]], layer._prompt_matmul(x[[0, 1, 3, 4]]))
    kinds = token_kinds(np.array([9, 10, 0, 1, 2, 3]), np.array([4, 4, 8]), np.array([1, 1, 4]), device)
    assert kinds.num_leading_decode == 2  # two decode rows, then a prompt chunk: each kernel writes its slice
    with layer.step_kinds.using(kinds):
        mixed = layer._matmul_cuda(x)
    assert torch.equal(mixed[:2], fp8_triton.fp8_decode_matmul(x[:2], layer.weight, layer.scale.reshape(-1)))
    assert torch.equal(mixed[2:], layer._prompt_matmul(x[2:]))


def test_fp8_model_shares_one_step_kinds_among_its_layers(tmp_path):
    path = make_model("llama", "tiny", str(tmp_path / "m"), seed=1)
    model = load_model(path, torch.float32, CPU, quantization="fp8")
    layers = [m for m in model.modules() if isinstance(m, Fp8Linear)]
    assert layers and all(m.step_kinds is model.step_kinds for m in layers)
    assert isinstance(model.step_kinds, StepKinds)
    int8 = quant.quantize_model(load_model(path, torch.float32, CPU), "int8")
    assert not hasattr(int8, "step_kinds")


def test_the_batch_keeps_each_rows_prompt_end_through_growth():
    """The runner's kinds read the rows' prompt ends from the persistent batch: a resumed request brings its
    outputs with its prompt, and says where the prompt ends."""
    from llmserve.worker.persistent_batch import PersistentBatch

    batch = PersistentBatch(max_num_rows=1, max_model_len=64, block_size=16)
    fresh = batch.add("a", [5, 6, 7], [1])
    resumed = batch.add("b", [5, 6, 7, 8, 9], [2], num_prompt=3)  # a second row: the arrays grow
    assert batch.num_prompt[[fresh, resumed]].tolist() == [3, 3]
    kinds = token_kinds(np.array([2, 3, 4]), batch.num_prompt[[fresh, resumed]], np.array([1, 2]), CPU)
    assert kinds.decode_index.tolist() == [1, 2] and kinds.prompt_index.tolist() == [0]


def test_an_engines_mixed_steps_have_their_decode_tokens_first(tmp_path, monkeypatch):
    """What the slices rely on, in the engine's own steps: running rows (decoding, or a prompt chunked over
    steps) come before new prompts, so a step with both kinds starts with its decode tokens. On CPU the
    runner is made to compute kinds as it does for an FP8 model on CUDA; 3 rows at most and a 32-token
    budget make prompts arrive, and get chunked, beside decoding rows."""
    from llmserve import LLM, SamplingParams
    from llmserve.worker import step_inputs

    path = make_model("llama", "tiny", str(tmp_path / "m"), seed=1)
    llm = LLM(path, device="cpu", dtype="float32", quantization="fp8", max_num_seqs=3, max_num_batched_tokens=32,
              max_model_len=128, num_kv_blocks=64)
    runner = llm.engine.runner
    runner.step_kinds = runner.inputs.step_kinds = runner.model.step_kinds  # what the runner takes on CUDA
    seen = []
    monkeypatch.setattr(step_inputs, "token_kinds", lambda *args: seen.append(token_kinds(*args)) or seen[-1])
    prompts = [list(range(5, 5 + n)) for n in (20, 45, 9, 30, 60, 12)]
    llm.generate(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    mixed = [kinds for kinds in seen if kinds.is_mixed]
    assert len(mixed) >= 3 and all(kinds.num_leading_decode > 0 for kinds in mixed)
    llm.engine.check_integrity()
