"""Prompt logprobs (`prompt_logprobs=k`): each prompt token's logprob given the tokens before it, its
rank and the top k, for the positions a step's chunk computes. The first prompt token has none."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from llmserve.messages import Logprobs, PromptLogprobs
from llmserve.worker.input_batch import CachedRequestState


@dataclass
class PromptLogprobsPlan:
    """Which hidden rows score which prompt tokens in one step."""

    token_indices: list[int]  # [M] flat token index in the step whose next prompt token is scored
    targets: list[int]  # [M] that next prompt token
    rows: list[tuple[int, int, int, int]]  # per scored row: (row, first prompt position, count, k)


def plan_prompt_logprobs(states: list[CachedRequestState], counts: list[int]) -> PromptLogprobsPlan | None:
    """`states` before this step's advance; counts: tokens each row computes."""
    plan = PromptLogprobsPlan([], [], [])
    offset = 0
    for i, (state, count) in enumerate(zip(states, counts)):
        k = state.params.prompt_logprobs
        start = state.num_computed_tokens
        end = min(start + count, len(state.prompt_token_ids) - 1)  # the last prompt token scores no prompt token
        if k is not None and end > start:
            plan.token_indices.extend(range(offset, offset + end - start))
            plan.targets.extend(state.prompt_token_ids[start + 1:end + 1])
            plan.rows.append((i, start + 1, end - start, k))
        offset += count
    return plan if plan.rows else None


@torch.inference_mode()
def score_prompt(model: torch.nn.Module, hidden: torch.Tensor, plan: PromptLogprobsPlan) -> dict[str, torch.Tensor]:
    """hidden [T, H] of the step -> device tensors of the scored tokens (copied to the host later)."""
    device = hidden.device
    index = torch.tensor(plan.token_indices, dtype=torch.int64).to(device)
    targets = torch.tensor(plan.targets, dtype=torch.int64).to(device).unsqueeze(1)  # [M, 1]
    logprobs = model.compute_logits(hidden[index]).log_softmax(dim=-1)  # [M, V]
    target_logprobs = logprobs.gather(1, targets)  # [M, 1]
    ranks = (logprobs > target_logprobs).sum(dim=-1) + 1  # [M]
    top_logprobs, top_ids = logprobs.topk(max(k for *_, k in plan.rows), dim=-1)  # [M, K]
    return {"plp_ids": torch.cat([targets, top_ids], dim=1), "plp_values": torch.cat([target_logprobs, top_logprobs], dim=1),
            "plp_ranks": ranks}


def host_prompt_logprobs(host: dict[str, torch.Tensor], plan: PromptLogprobsPlan, num_rows: int) -> list | None:
    """Per row of the step its PromptLogprobs, or None."""
    ids, values, ranks = host["plp_ids"].tolist(), host["plp_values"].tolist(), host["plp_ranks"].tolist()
    out: list[PromptLogprobs | None] = [None] * num_rows
    first = np.cumsum([0] + [count for _, _, count, _ in plan.rows]).tolist()
    for (row, start, count, k), lo in zip(plan.rows, first):
        out[row] = PromptLogprobs(start, [Logprobs(ids[m][:k + 1], values[m][:k + 1], ranks[m])
                                          for m in range(lo, lo + count)])
    return out
