"""Sampler ops: the CPU top-p path (candidates only) agrees with the one-sort path; CUDA smoke tests."""

import pytest
import torch

from llmserve.sample.metadata import PositionRow as Row
from llmserve.sampling_params import SamplingParams
from llmserve.sample import Sampler, build_sampling_metadata, ops


def reference_mask(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    """Per-row loop, straight from the definitions: True where a token is filtered out."""
    masks = []
    for row, k, p in zip(logits, top_k, top_p):
        order = row.argsort(descending=True)
        kept = order[:k]
        probs = row[kept].softmax(dim=-1)
        if p < 1.0:
            mass_above = probs.cumsum(dim=0) - probs
            kept = kept[mass_above < p]
        mask = torch.ones_like(row, dtype=torch.bool)
        mask[kept] = False
        masks.append(mask)
    return torch.stack(masks)


@pytest.mark.parametrize("scale", [0.5, 3.0, 8.0])
@pytest.mark.parametrize("use_top_k", [False, True])
def test_top_k_top_p_paths_agree_with_the_definition(scale, use_top_k):
    gen = torch.Generator().manual_seed(int(scale * 10) + use_top_k)
    num_rows, vocab_size = 24, 300
    logits = torch.randn(num_rows, vocab_size, generator=gen) * scale  # [B, V]
    top_p = [1.0 if i % 4 == 0 else float(x) for i, x in enumerate(torch.rand(num_rows, generator=gen))]
    top_k = [vocab_size if (i % 3 == 0 or not use_top_k) else 1 + i * 7 for i in range(num_rows)]
    top_k_tensor = torch.tensor(top_k) if use_top_k else None
    max_top_k = max((k for k in top_k if k < vocab_size), default=0)
    expected = reference_mask(logits, top_k, top_p)
    cpu = ops.apply_top_k_top_p(logits.clone(), top_k_tensor, max_top_k, torch.tensor(top_p))
    one_sort = ops.apply_top_k_top_p_sorted(logits.clone(), top_k_tensor, torch.tensor(top_p))
    assert torch.equal(cpu.isinf(), expected)
    assert torch.equal(one_sort.isinf(), expected)
    assert torch.equal(cpu[~expected], logits[~expected])  # kept logits are untouched


def test_top_k_only_keeps_k_tokens():
    logits = torch.randn(5, 100, generator=torch.Generator().manual_seed(0))
    top_k = torch.tensor([1, 10, 100, 37, 100])
    ops.apply_top_k_only(logits, top_k, max_top_k=37)
    assert (~logits.isinf()).sum(dim=-1).tolist() == [1, 10, 100, 37, 100]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_sampler_matches_the_definitions():
    logits = torch.randn(64, 1000, device="cuda") * 3  # [B, V]
    params = [SamplingParams(temperature=0), SamplingParams(top_k=1, logprobs=3),
              SamplingParams(top_p=1e-6, seed=5), SamplingParams(top_k=50, top_p=0.9, min_p=0.05)] * 16
    rows = [Row(p, generator=torch.Generator("cuda").manual_seed(p.seed) if p.seed is not None else None)
            for p in params]
    meta = build_sampling_metadata(rows, 1000, "cuda")
    out = Sampler()(logits.clone(), meta)
    is_greedy_like = torch.arange(64, device="cuda") % 4 != 3
    assert torch.equal(out.sampled_token_ids[is_greedy_like], logits.argmax(dim=-1)[is_greedy_like])
    assert torch.equal(out.logprobs.token_ids[:, 0], out.sampled_token_ids)
    assert torch.allclose(out.logprobs.logprobs, logits.log_softmax(-1).gather(1, out.logprobs.token_ids))


def test_argmax_rows_takes_each_rows_first_maximum_like_torch():
    logits = torch.randn(6, 40)
    logits[1, 3] = logits[1, 30] = 50.0  # a tie: the first one
    logits[2, 7] = logits[2, 9] = float("nan")  # NaN counts as the maximum, the first one
    logits[4] = 0.0  # all equal
    got = ops.argmax_rows(logits)
    assert got.dtype == torch.int64
    assert got.tolist() == logits.argmax(dim=-1).tolist()
    assert got.tolist()[1:3] == [3, 7] and got.tolist()[4] == 0
    transposed = torch.randn(40, 6).t()  # not contiguous: torch's own argmax
    assert ops.argmax_rows(transposed).tolist() == transposed.argmax(dim=-1).tolist()
