"""LoRA on a bfloat16 model on CPU: the C++ kernel (AVX512-BF16 where the CPU has it, and its AVX2 build) and
the segmented torch form against a float64 reference, one rounding into the output; greedy tokens of a batch
mixing two adapters and the base model equal transformers + peft's in bfloat16."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import numpy as np
import pytest
import torch
from hf_parity import random_prompt
from lora_helpers import float64_lora_delta, make_adapter, peft_greedy

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.model import cpu_isa, lora_cpu
from llmserve.model.lora_layers import LoRAContext, LoRALinear, lora_step
from llmserve.testing.maker import make_model

BF16 = torch.bfloat16
HALF_ULP = 2.0 ** -8  # bfloat16 keeps 8 significant bits: one rounding is off by at most this, relatively
needs_kernel = pytest.mark.skipif(not lora_cpu.available(), reason="the CPU LoRA kernel does not build here")


def _linear(gen: torch.Generator, in_features: int, out_sizes: list[int]) -> LoRALinear:
    """Four slots of ranks 2, 8, 5, 8 (some sub-projections without LoRA) over a bfloat16 base projection."""
    base = torch.nn.Linear(in_features, sum(out_sizes), dtype=BF16)
    linear = LoRALinear(base, in_features, out_sizes, 4, 8, LoRAContext(), BF16, torch.device("cpu"))
    for slot, (rank, present) in enumerate([(2, [1, 1, 1]), (8, [1, 0, 1]), (5, [1, 1, 1]), (8, [1, 1, 0])]):
        linear.set_slot(slot, [(torch.randn(rank, in_features, generator=gen).to(BF16),
                                torch.randn(size, rank, generator=gen).to(BF16))
                               if is_present else None for size, is_present in zip(out_sizes, present)])
    return linear



@pytest.mark.parametrize("form", [pytest.param("kernel", marks=needs_kernel), "segmented"])
@pytest.mark.parametrize("token_slots", [[1, -1, 0, 2, 1, 1, -1, 2, 0, 1, 1, 1, 1, 3, 3], [2, 0, 1, 3], [-1, 3]],
                         ids=["mixed", "one-token-each", "one-adapter-token"])
def test_bf16_lora_equals_the_float64_reference_within_one_rounding(form, token_slots, monkeypatch):
    """Sizes that leave tails past the vector widths (in 45: under one 32-pair dot, out 70, 33, 8)."""
    if form == "segmented":
        monkeypatch.setattr(lora_cpu, "can_run", lambda *args: False)
    gen = torch.Generator().manual_seed(7)
    linear = _linear(gen, 45, [70, 33, 8])
    token_slots = np.array(token_slots)
    x = torch.randn(len(token_slots), 45, generator=gen).to(BF16)
    linear.context.step = lora_step(token_slots, torch.device("cpu"))
    with torch.no_grad():
        out = linear(x)
        expected = linear.base(x).double() + float64_lora_delta(x, linear, token_slots)
    assert out.dtype == BF16
    torch.testing.assert_close(out.double(), expected, rtol=HALF_ULP, atol=1e-4)


@pytest.mark.skipif(not {"avx2", "fma"} <= cpu_isa.cpu_flags(), reason="no AVX2 on this CPU")
def test_the_avx2_build_of_the_bf16_kernel_equals_the_float64_reference():
    """The kernel built without AVX-512 (bfloat16 widened to float32 for AVX2's FMAs), in a process of its
    own (its library registers the same ops)."""
    script = textwrap.dedent("""
        import torch
        from llmserve.model import cpu_build, lora_cpu
        cpu_build.avx512_flags = lambda: []
        assert "-mavx2" in cpu_build.compile_flags() and "-mavx512bf16" not in cpu_build.compile_flags()
        assert lora_cpu.available()
        out, expected = lora_cpu._self_test_case(lora_cpu._ops(), torch.bfloat16)
        torch.testing.assert_close(out.double(), expected, rtol=2.0 ** -8, atol=1e-4)
        print("ok")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


@pytest.mark.parametrize("form", [pytest.param("kernel", marks=needs_kernel), "segmented"])
def test_a_bf16_batch_of_two_adapters_and_the_base_model_matches_peft_in_bf16(form, tmp_path, monkeypatch):
    """Adapters saved in bfloat16 (held in bfloat16 in the slots, upcast to float32 by peft: the same values);
    scales of powers of two, so folding them into B rounds nothing."""
    if form == "segmented":
        monkeypatch.setattr(lora_cpu, "can_run", lambda *args: False)
    base = make_model("llama", "tiny", str(tmp_path / "base"), seed=1)
    loras = [LoRARequest("all", 1, make_adapter(base, str(tmp_path / "a0"), seed=50, rank=8, alpha=16, dtype=BF16)),
             LoRARequest("some", 2, make_adapter(base, str(tmp_path / "a1"), seed=51, rank=16, alpha=16, dtype=BF16,
                                                 targets=["q_proj", "o_proj", "gate_proj", "down_proj"],
                                                 use_rslora=True))]
    prompts = [random_prompt(15 + 6 * i, seed=60 + i, vocab_size=512) for i in range(3)]
    requests = [*loras, None]
    llm = LLM(base, dtype="bfloat16", enable_lora=True, max_loras=2, max_lora_rank=16, block_size=4,
              max_num_batched_tokens=16, max_model_len=64, num_kv_blocks=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), lora_request=requests)
    expected = [peft_greedy(base, None if lora is None else lora.lora_path, prompt, 8, dtype=BF16)
                for prompt, lora in zip(prompts, requests)]
    assert [list(o.outputs[0].token_ids) for o in outs] == expected
    llm.engine.check_integrity()
