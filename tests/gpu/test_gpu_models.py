"""The architectures beyond Llama on CUDA: Qwen3-MoE and Mixtral (the MoE block), gpt-oss (MoE with biases and
clamps, sliding windows, sinks, YaRN) and Gemma 3 (interleaved windows, soft-capped logits) give transformers'
greedy tokens through the Triton kernel, with and without decode graphs, from prompts several windows long."""

from __future__ import annotations

import sys
import warnings
from pathlib import Path

import pytest
import torch

from llmserve import LLM, SamplingParams

from greedy_check import check_greedy_against_hf

sys.path.insert(0, str(Path(__file__).parents[1] / "unit"))  # the architecture tests' checkpoint writers
import test_deepseek_model  # noqa: E402
import test_gemma3_model  # noqa: E402
import test_gpt_oss_model  # noqa: E402
import test_moe_models  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

WRITERS = {
    "qwen3_moe": lambda out: test_moe_models.write_checkpoint("qwen3_moe", out, seed=1),
    "mixtral": lambda out: test_moe_models.write_checkpoint("mixtral", out, seed=1),
    "gpt_oss": lambda out: test_gpt_oss_model.write_checkpoint(out, seed=1),
    "gemma3": lambda out: test_gemma3_model.write_checkpoint(out, seed=1),
}
PARAMS = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


@pytest.fixture(scope="module", params=list(WRITERS))
def checkpoint(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    path = WRITERS[request.param](str(tmp_path_factory.mktemp(request.param)))
    return path, AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("backend,enforce_eager", [("triton", False), ("triton", True), ("torch", True)])
def test_greedy_equals_transformers_on_cuda(checkpoint, backend, enforce_eager):
    path, hf = checkpoint
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=128, block_size=16,
              attention_backend=backend, enforce_eager=enforce_eager, max_num_batched_tokens=32)  # prompts chunked
    assert llm.engine.runner.attn_backend.name == backend
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 5, 29, 47, 70)]
    outputs = llm.generate(prompts, PARAMS)
    for prompt, out in zip(prompts, outputs):
        note = check_greedy_against_hf(hf, prompt, list(out.outputs[0].token_ids))
        if note:
            warnings.warn(note)
    llm.engine.check_integrity()


def _cpu_tokens(path: str, prompts: list[list[int]]) -> list[list[int]]:
    llm = LLM(path, device="cpu", dtype="float32", max_model_len=128, num_kv_blocks=128, block_size=16)
    return [list(o.outputs[0].token_ids) for o in llm.generate(prompts, PARAMS)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "gpt_oss"])
def test_moe_in_bfloat16_runs_through_decode_graphs(arch, tmp_path):
    """bfloat16 on Hopper: the experts run as grouped GEMMs with no host sync, so decode steps replay graphs, and
    give the eager engine's tokens."""
    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("grouped GEMMs need compute capability 9.0")
    path = WRITERS[arch](str(tmp_path / arch))
    engine = dict(device="cuda", dtype="bfloat16", max_model_len=128, num_kv_blocks=128, block_size=16)
    graphed, eager = LLM(path, **engine), LLM(path, enforce_eager=True, **engine)
    assert not graphed.engine.runner.model.has_host_syncs() and graphed.engine.runner.graphs is not None
    gen = torch.Generator().manual_seed(4)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 9, 40)]
    tokens = [[list(o.outputs[0].token_ids) for o in llm.generate(prompts, PARAMS)] for llm in (graphed, eager)]
    assert tokens[0] == tokens[1]
    graphed.engine.check_integrity()


@pytest.mark.parametrize("arch", list(test_deepseek_model.ARCHS))
@pytest.mark.parametrize("backend,expected", [("auto", "triton"), ("torch", "torch")])
def test_deepseek_latent_cache_on_cuda_equals_the_cpu_engine(arch, backend, expected, tmp_path):
    """DeepSeek on CUDA: `auto` picks the Triton backend (model/mla_triton.py reads the latent cache), `torch` its
    groups; chunked prompts, decode over the latents. The reference is the CPU engine's tokens (tests/unit ties them
    to transformers)."""
    path = test_deepseek_model.write_checkpoint(arch, str(tmp_path / arch), seed=1)
    llm = LLM(path, device="cuda", dtype="float32", max_model_len=128, num_kv_blocks=128, block_size=16,
              max_num_batched_tokens=32, attention_backend=backend)
    assert llm.engine.runner.attn_backend.name == expected
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 512, (n,), generator=gen).tolist() for n in (1, 5, 29, 47, 70)]
    outputs = llm.generate(prompts, PARAMS)
    assert [list(o.outputs[0].token_ids) for o in outputs] == _cpu_tokens(path, prompts)
    llm.engine.check_integrity()
