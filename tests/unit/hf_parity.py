"""Greedy parity with transformers for the architecture tests: its tokens, ours, and random prompts."""

from __future__ import annotations

import torch

from llmserve import LLM, SamplingParams


def hf_greedy(hf, prompt: list[int], num_out: int) -> list[int]:
    """transformers' greedy tokens, num_out of them: no EOS stop, none of generation_config.json's sampling
    defaults (its repetition penalty), as our SamplingParams(temperature=0, ignore_eos=True)."""
    from transformers import GenerationConfig

    hf.generation_config = GenerationConfig(do_sample=False, pad_token_id=0)  # what generate merges its kwargs into
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), max_new_tokens=num_out)
    return out[0, len(prompt):].tolist()


def engine_greedy(llm: LLM, prompts: list[list[int]], num_out: int):
    """Our engine's greedy outputs (RequestOutputs), num_out tokens each."""
    return llm.generate(prompts, SamplingParams(temperature=0, max_tokens=num_out, ignore_eos=True))


def random_prompt(length: int, seed: int, vocab_size: int) -> list[int]:
    """Token ids in [3, vocab_size): past the toy tokenizer's special ids."""
    return torch.randint(3, vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
