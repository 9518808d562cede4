"""The runner's calls to its speculator around a step (the speculator itself: spec/speculator.py): the
step it may speculate in, timed for its rule, and the next step's drafts, one list a row of the step."""

from __future__ import annotations

import numpy as np
import torch

from llmserve.core.sched_output import SchedulerOutput
from llmserve.spec.speculator import Speculator
from llmserve.worker.input_batch import CachedRequestState
from llmserve.worker.step_handle import StepHandle


def begin_spec_step(speculator: Speculator, sched_out: SchedulerOutput) -> None:
    """The speculator times the steps it may speculate in (its rule weighs their cost)."""
    num_rows = len(sched_out.num_scheduled_tokens)
    num_drafts = sum(len(d) for d in sched_out.scheduled_spec_tokens.values())
    is_decode = sched_out.total_num_scheduled_tokens == num_rows + num_drafts
    speculator.begin_step(num_rows, len(sched_out.scheduled_spec_tokens), is_decode)


def hand_features(speculator: Speculator, model: torch.nn.Module, states: list[CachedRequestState],
                  starts: np.ndarray, counts: np.ndarray, hidden: torch.Tensor) -> None:
    """The forward's features to an EAGLE head: hidden [T, H] (after the final norm), or EAGLE-3's [T, 3H], the
    inputs of the target's feature layers (model.aux_hidden); starts, counts [B]: each row's first position and
    its tokens."""
    if not speculator.wants_features(states):
        return
    features = torch.cat([model.aux_hidden[i] for i in model.aux_layers], dim=-1) if model.aux_layers else hidden
    speculator.proposer.take_features(states, starts, counts, features)


def propose_drafts(speculator: Speculator, states: dict[str, CachedRequestState], handle: StepHandle) -> list[list[int]]:
    """Drafts for the next step, per row of this step (none for rows that did not sample or have finished);
    [] when no row has any (the scheduler then takes the step in as a plain one)."""
    proposals: list[list[int]] = [[] for _ in handle.req_ids]
    rows = [(j, states.get(handle.req_ids[j])) for j in handle.sample_rows.tolist()]
    rows = [(j, s) for j, s in rows if s is not None]
    drafts = speculator.propose([s for _, s in rows], len(handle.req_ids), handle.use_speculation)
    for (j, _), row_drafts in zip(rows, drafts):
        proposals[j] = row_drafts
    return proposals if any(drafts) else []
