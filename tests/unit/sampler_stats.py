"""Pearson's chi-squared statistic of drawn token counts against a distribution, for the sampler's tests."""

import torch


def chi2(counts: torch.Tensor, expected_probs: torch.Tensor) -> float:
    """counts [V] against expected_probs [V] (normalised here); asserts that no filtered (probability 0) token was
    drawn."""
    expected = expected_probs / expected_probs.sum() * counts.sum()
    is_kept = expected > 0
    assert counts[~is_kept].sum() == 0, "a filtered token was drawn"
    return float(((counts[is_kept] - expected[is_kept]) ** 2 / expected[is_kept]).sum())
