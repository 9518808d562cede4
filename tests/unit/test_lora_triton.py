"""The LoRA Triton kernels (model/lora_triton.py) against the per-row reference: compiled on CUDA, through
Triton's interpreter on CPU."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")  # without CUDA, conftest.py set TRITON_INTERPRET=1 before anything imported it

from test_lora_layers import OUT_SIZES, _per_row_reference, _pool  # noqa: E402

from llmserve.model.lora_layers import LoRAStep, lora_step  # noqa: E402
from llmserve.model.lora_triton import add_lora_triton  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("token_slots", [[1, -1, 0, 2, 1, 1, -1, 2, 0, 1], [2, 0, 1], [-1, 0]],
                         ids=["mixed-prompt", "decode", "one-adapter-token"])
def test_triton_products_equal_the_per_row_reference(token_slots):
    a, bs, _ = _pool(0)
    slots = np.array(token_slots)
    x = torch.randn(len(slots), a.shape[-1], generator=torch.Generator().manual_seed(2))
    expected = 1 + _per_row_reference(x, a, bs, slots)
    out = torch.ones(len(slots), sum(OUT_SIZES), device=DEVICE)
    step = lora_step(slots, torch.device(DEVICE))
    # small tiles: several K and output tiles a token even on these shapes
    add_lora_triton(out, x.to(DEVICE), a.to(DEVICE), [b.to(DEVICE) for b in bs], step, block_k=16, block_n=8)
    torch.testing.assert_close(out.cpu(), expected, atol=1e-4, rtol=1e-4)


def test_a_padded_step_skips_the_base_models_tokens_and_equals_the_grouped_one():
    """A decode graph's step (every token in order, slot -1 for the base model's and the padding) adds the
    same products as the runner's grouped step, and leaves the base model's rows untouched."""
    a, bs, _ = _pool(0)
    slots = np.array([1, -1, 0, 2, -1, 1, -1, -1])  # the last two: a graph's padding rows
    x = torch.randn(len(slots), a.shape[-1], generator=torch.Generator().manual_seed(3)).to(DEVICE)
    pool = a.to(DEVICE), [b.to(DEVICE) for b in bs]
    grouped, padded = (torch.ones(len(slots), sum(OUT_SIZES), device=DEVICE) for _ in range(2))
    add_lora_triton(grouped, x, *pool, lora_step(slots, torch.device(DEVICE)), block_k=16, block_n=8)
    step = LoRAStep(torch.arange(len(slots), device=DEVICE), torch.from_numpy(slots).to(DEVICE), [], is_padded=True)
    add_lora_triton(padded, x, *pool, step, block_k=16, block_n=8)
    torch.testing.assert_close(padded, grouped, atol=0, rtol=0)
    assert (padded[torch.from_numpy(slots < 0).to(DEVICE)] == 1).all()
    assert (padded[torch.from_numpy(slots >= 0).to(DEVICE)] != 1).any()


def test_steps_through_the_graph_buffers_give_peft_tokens(tmp_path):
    """An engine's steps run the padded LoRA step inside the graph buffers (eagerly here; on CUDA replayed), rows
    of two adapters and the base model in one batch: decode steps padded to 4 rows, prompt chunks through the
    mixed-step buffers padded to 16 tokens. transformers + peft's greedy tokens."""
    from hf_parity import random_prompt
    from lora_helpers import make_adapter, peft_greedy

    import graph_buffers
    from llmserve import LLM, LoRARequest, SamplingParams
    from llmserve.testing.maker import make_model

    base = make_model("llama", "tiny", str(tmp_path / "base"), seed=1)
    loras = [LoRARequest(f"a{i}", i + 1, make_adapter(base, str(tmp_path / f"a{i}"), seed=50 + i, rank=8))
             for i in range(2)]
    requests = [loras[0], None, loras[1]]
    prompts = [random_prompt(9 + 3 * i, seed=60 + i, vocab_size=512) for i in range(3)]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    llm = LLM(base, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, attention_backend="triton",
              enforce_eager=True, device=DEVICE, max_model_len=64, num_kv_blocks=64, max_num_batched_tokens=16)
    runner = llm.engine.runner
    decode_runs = graph_buffers.attach(runner, "decode", max_blocks=8, lora=runner.lora.context)
    mixed_runs = graph_buffers.attach(runner, "mixed", max_blocks=8, max_tokens=16, max_rows=3,
                                      lora=runner.lora.context)
    outs = llm.generate(prompts, params, lora_request=requests)
    padded_sizes = {size for _, size in decode_runs}
    assert padded_sizes and padded_sizes <= {1, 2, 4}
    assert (16, 16) in mixed_runs  # prompt chunks through the mixed buffers
    expected = [peft_greedy(base, None if lora is None else lora.lora_path, prompt, 5)
                for prompt, lora in zip(prompts, requests)]
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    assert runner.lora.context.step is None or not runner.lora.context.step.is_padded  # the runner's step back
    llm.engine.check_integrity()
