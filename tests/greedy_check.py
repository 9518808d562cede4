"""Greedy-equivalence checks against transformers that tell a real mismatch from a logit near-tie."""

from __future__ import annotations

import torch

TIE_GAP = 1e-4  # float32: top-2 logits closer than this may legitimately flip order


def check_greedy_against_hf(hf_model, prompt_ids: list[int], output_ids: list[int],
                            tie_gap: float = TIE_GAP) -> str | None:
    """Run HF on prompt + our output and verify each output token was HF's argmax.

    Returns None when all match; raises AssertionError on a real mismatch; returns a message when the
    first mismatch is at a near-tie (the caller reports it, it does not loosen the check).
    """
    ids = torch.tensor([prompt_ids + output_ids], device=hf_model.device)
    with torch.no_grad():
        logits = hf_model(ids).logits[0].float()  # [P + O, V]
    start = len(prompt_ids) - 1
    for i, token in enumerate(output_ids):
        row = logits[start + i]
        best = int(row.argmax())
        if best == token:
            continue
        top2 = row.topk(2).values
        gap = float(top2[0] - top2[1])
        if gap < tie_gap and float(row[best] - row[token]) < tie_gap:
            return f"near-tie at output position {i}: HF argmax {best}, ours {token}, gap {gap:.2e}"
        raise AssertionError(f"greedy mismatch at output position {i}: HF {best}, ours {token}, gap {gap:.3e}")
    return None
