"""CausalLM logits equal transformers' for every supported architecture, through the paged cache."""

from __future__ import annotations

import pytest
import torch

from llmserve.model.attention import select_attention_backend
from llmserve.model.loader import load_model
from llmserve.testing.maker import make_model
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches

ATOL = 1e-4
BLOCK_SIZE = 4
NUM_BLOCKS = 64


@pytest.fixture(scope="module", params=["llama", "mistral", "qwen2", "qwen3", "llama:tiny-llama3",
                                                "qwen3_moe:tiny-moe", "mixtral:tiny-moe", "gpt_oss:tiny-gpt-oss",
                                                "phi3:tiny-phi3", "gemma3:tiny-gemma3",
                                                "deepseek_v3:tiny-deepseek-v3", "deepseek_v2:tiny-deepseek-v3"])
def models(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM
    arch, _, shape = request.param.partition(":")
    path = make_model(arch, shape or "tiny", str(tmp_path_factory.mktemp(arch)), seed=1)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return load_model(path, torch.float32, "cpu"), hf


def hf_logits(hf, tokens: list[int]) -> torch.Tensor:
    """[len(tokens), vocab] logits of transformers' model over one sequence."""
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


class Runner:
    """Drives CausalLM step by step over a shuffled paged cache."""

    def __init__(self, model):
        self.model = model
        self.backend = select_attention_backend(torch.device("cpu"), "auto", torch.float32)  # the engine's
        self.builder = PagedBatchBuilder(NUM_BLOCKS, BLOCK_SIZE, seed=3)
        self.kv_caches = allocate_kv_caches(model, NUM_BLOCKS, BLOCK_SIZE)

    def step(self, rows: list[tuple[object, list[int]]]) -> list[torch.Tensor]:
        """-> per row, logits [len(new tokens), vocab]."""
        input_ids, positions, inputs = self.builder.step(rows)
        metadata = self.backend.build_metadata(inputs)
        with torch.no_grad():
            hidden = self.model(input_ids, positions, self.kv_caches, metadata, self.backend)
            logits = self.model.compute_logits(hidden)
        return list(logits.split(inputs.query_lens_cpu))


def prompt(length: int, seed: int) -> list[int]:
    return torch.randint(3, 512, (length,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_one_prompt_prefilled_at_once(models):
    model, hf = models
    tokens = prompt(37, 0)  # three tiles of the CPU kernel's (16 query tokens each)
    (ours,) = Runner(model).step([("a", tokens)])
    torch.testing.assert_close(ours, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_mixed_length_batch_in_one_step(models):
    model, hf = models
    prompts = {name: prompt(n, i) for i, (name, n) in enumerate([("a", 5), ("b", 1), ("c", 9), ("d", 3)])}
    outs = Runner(model).step(list(prompts.items()))
    for out, tokens in zip(outs, prompts.values()):
        torch.testing.assert_close(out, hf_logits(hf, tokens), atol=ATOL, rtol=0)


def test_chunked_prefill_then_decode_with_shuffled_blocks(models):
    model, hf = models
    a, b = prompt(20, 10), prompt(7, 11)
    runner = Runner(model)
    got_a, got_b = runner.step([("a", a[:12]), ("b", b)])  # two prefills
    steps_a, steps_b = [got_a], [got_b]
    got_b, got_a = runner.step([("b", [5]), ("a", a[12:])])  # a decode row before a prefill chunk
    steps_a.append(got_a)
    steps_b.append(got_b)
    for i in range(3):  # decode only
        got_a, got_b = runner.step([("a", [7 + i]), ("b", [9 + i])])
        steps_a.append(got_a)
        steps_b.append(got_b)
    full_a, full_b = a + [7, 8, 9], b + [5, 9, 10, 11]
    assert runner.builder.block_ids["a"] != sorted(runner.builder.block_ids["a"])
    torch.testing.assert_close(torch.cat(steps_a), hf_logits(hf, full_a), atol=ATOL, rtol=0)
    torch.testing.assert_close(torch.cat(steps_b), hf_logits(hf, full_b), atol=ATOL, rtol=0)
