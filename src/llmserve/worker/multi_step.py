"""The runner's side of multi-step decoding (core/decode_steps.py): one scheduled step of up to k
forwards of one token a row and one output of them all. The first forward is launched like a plain
step (it takes in the step's diff: new blocks, finished requests); the later ones run over a
DecodeWindow (worker/decode_window.py), each row's input the id the forward before sampled.

Row i runs num_scheduled_tokens[i] forwards and drops out after its last. The runner's `window_interrupt`
may end the window after any forward (input came for the engine), and with `window_ends_at_finish` (an
engine whose outputs are read as they come) the window ends where a row ran its last: each row then
reports the ids it got, and the scheduler rolls the rest of its count back. A row that samples an id it
stops on (EOS, a stop id, past min_tokens) runs no further forward: a window costs no compute past a stop.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from llmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from llmserve.worker.decode_window import DecodeWindow

if TYPE_CHECKING:
    from llmserve.worker.input_batch import CachedRequestState
    from llmserve.worker.model_runner import ModelRunner


@torch.inference_mode()  # one context for the window's forwards (`ModelRunner.window_forward`)
def run_decode_steps(runner: ModelRunner, sched_out: SchedulerOutput) -> ModelRunnerOutput:
    """Per row of the step its sampled ids, one a forward it ran."""
    started = time.perf_counter()
    req_ids = list(sched_out.num_scheduled_tokens)
    counts = np.fromiter(sched_out.num_scheduled_tokens.values(), np.int64, count=len(req_ids))  # [B]
    sampled = np.zeros((sched_out.num_steps, len(req_ids)), np.int64)  # [k, B]
    first = dataclasses.replace(sched_out, num_scheduled_tokens=dict.fromkeys(req_ids, 1),
                                total_num_scheduled_tokens=len(req_ids), num_steps=1)
    ids = sampled[0] = runner.finish_sampled(runner.launch(first, finishes_at_once=True))  # [B]
    states, batch_rows = runner.step_rows(req_ids)  # batch_rows [B]
    window = DecodeWindow(runner.batch, states, batch_rows, sched_out.num_steps, runner.device)
    stop_ids = _stop_ids(states)  # [N] ids some row stops on, or None
    rows = np.arange(len(req_ids))  # [B'] the rows of the next forward
    num_all = int(counts.min())  # forwards that every row runs
    if stop_ids is not None:
        num_all = min(num_all, _end_stopped(ids, stop_ids, rows, states, counts, 1))
    for j in range(1, sched_out.num_steps):
        ends_at_finish = j >= num_all and runner.window_ends_at_finish  # some row ran its last forward
        if ends_at_finish or (runner.window_interrupt is not None and runner.window_interrupt()):
            counts = np.minimum(counts, j)  # [B] the forwards each row ran
            break
        if j >= num_all:  # some row ran its last forward
            is_left = counts[rows] > j  # [B']
            if not is_left.any():
                break  # every row ran its last forward (rows stopped early)
            if not is_left.all():  # some rows ran their last forward
                kept = np.flatnonzero(is_left)
                rows, ids = rows[kept], ids[kept]
                window.keep(kept)
        ids = sampled[j, rows] = runner.window_forward(window, j, ids)  # [B']
        if stop_ids is not None:
            num_all = min(num_all, _end_stopped(ids, stop_ids, rows, window.states, counts, j + 1))
    token_ids = sampled.T.tolist()
    for i in np.flatnonzero(counts < sampled.shape[0]).tolist():
        del token_ids[i][counts[i]:]
    if runner.speculator is not None and counts.min() == counts.max():  # every row ran every forward
        runner.speculator.observe_window(len(req_ids), int(counts[0]), time.perf_counter() - started)
    return ModelRunnerOutput(req_ids=req_ids, sampled_token_ids=token_ids)


def _stop_ids(states: list[CachedRequestState]) -> np.ndarray | None:
    """[N] the ids that end some row of the window (EOS unless ignored, stop_token_ids), or None if none do."""
    ids = {token_id for state in states for token_id in state.stop_token_ids_for_min_tokens}
    return np.fromiter(ids, np.int64, count=len(ids)) if ids else None


def _end_stopped(ids: np.ndarray, stop_ids: np.ndarray, rows: np.ndarray, states: list[CachedRequestState],
                 counts: np.ndarray, num_ran: int) -> int:
    """Rows [B'] whose id [B'] of the forward just run ends them (a stop id, past min_tokens) run no more
    forwards: their counts [B] become `num_ran` (the scheduler stops them at that id). Returns the
    smallest count now."""
    for i in np.flatnonzero(np.isin(ids, stop_ids)).tolist():
        state = states[i]
        if int(ids[i]) in state.stop_token_ids_for_min_tokens and state.num_output_tokens >= state.params.min_tokens:
            counts[rows[i]] = num_ran
    return int(counts.min())
