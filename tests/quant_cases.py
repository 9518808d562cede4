"""Shared by the quantization tests: a random checkpoint whose logits are peaked."""

from __future__ import annotations

from llmserve.testing.maker import Shape, write_checkpoint

# Peaked logits (maker's is_peaked): the lm_head's rows scaled by 3 * lognormal(0, 1), so that the top token
# usually leads the second by several logit standard deviations (plain random weights leave near-ties). The
# decoder layers at std 0.02, transformers' default initializer_range: at 0.05 the random network amplifies
# FP8's rounding (top-1 agreement 0.932 there, 0.965 at 0.02; int8 0.968 and 0.985).
PEAKED = Shape(128, 2, 4, 2, 256, 512, 2048, init_std=0.02)


def write_peaked(path: str) -> str:
    """PEAKED's checkpoint with the lm_head rescaled (seeded: the same files every time)."""
    return write_checkpoint("llama", PEAKED, path, seed=5, is_peaked=True)
