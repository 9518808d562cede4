"""A finished step's sampled ids on the host: into the persistent batch (and the penalties' seen tokens),
and out as the step's ModelRunnerOutput, per row of the step.

Rows whose request finished or was preempted while the step's ids were pending are skipped (their
serials changed); a step finished at once had no meanwhile.
"""

from __future__ import annotations

import numpy as np

from llmserve.core.sched_output import ModelRunnerOutput
from llmserve.worker.penalty_tokens import PenaltyTokens
from llmserve.worker.persistent_batch import PersistentBatch
from llmserve.worker.prompt_logprobs import host_prompt_logprobs
from llmserve.worker.sampling_step import host_logprobs
from llmserve.worker.step_handle import StepHandle, rows_of_samples

_NONE = type(None)  # called: None


class StepOutput:
    def __init__(self, batch: PersistentBatch, penalty_tokens: PenaltyTokens) -> None:
        self.batch = batch
        self.penalty_tokens = penalty_tokens

    def output(self, handle: StepHandle) -> ModelRunnerOutput:
        """Per row of the step its sampled ids (empty for a partial prefill), appended to the batch."""
        num_rows = len(handle.req_ids)
        if handle.is_sync:
            logprobs = handle.host_logprobs
            self._append_sampled(handle, handle.host_tokens)
            token_ids = rows_of_samples(handle.host_tokens, handle.sample_rows, num_rows)
        else:
            sampled = self.take(handle)  # [S]
            logprobs = host_logprobs(handle.copy.wait(), handle.num_logprobs)
            token_ids = rows_of_samples(sampled.reshape(-1, 1).tolist(), handle.sample_rows, num_rows)
        row_logprobs = None if logprobs is None else rows_of_samples(logprobs, handle.sample_rows, num_rows, _NONE)
        num_accepted = None  # per row of a step that verified drafts: its accepted drafts (0 without any)
        if handle.host_num_accepted is not None:
            num_accepted = rows_of_samples(handle.host_num_accepted, handle.sample_rows, num_rows, int)
        prompt_logprobs = None
        if handle.prompt_plan is not None:
            prompt_logprobs = host_prompt_logprobs(handle.copy.wait(), handle.prompt_plan, num_rows)
        return ModelRunnerOutput(req_ids=handle.req_ids, sampled_token_ids=token_ids, logprobs=row_logprobs,
                                 prompt_logprobs=prompt_logprobs, num_accepted=num_accepted)

    def take(self, handle: StepHandle) -> np.ndarray:
        """A step without drafts: its sampled ids [S] on the host, appended to the batch."""
        sampled = handle.copy.wait()["sampled"].numpy()  # [S]
        self._append_one_each(handle, sampled)
        return sampled

    def _append_sampled(self, handle: StepHandle, sampled: list[list[int]]) -> None:
        """A step that verified drafts: per sampling row its emitted ids join its batch row."""
        batch = self.batch
        is_held = batch.still_held(handle.batch_rows, handle.serials).tolist()
        rows: list[int] = []
        tokens: list[int] = []
        for row, row_ids, held in zip(handle.batch_rows.tolist(), sampled, is_held):
            if not held:
                continue
            batch.num_pending[row] -= 1
            if batch.has_penalties[row]:  # verified drafts: their ids come from the host
                self.penalty_tokens.append_host(row, row_ids)
            if len(row_ids) == 1:
                rows.append(row)
                tokens.append(row_ids[0])
            else:
                batch.append_tokens(row, row_ids)
        if rows:
            batch.append_one_each(np.asarray(rows, np.int64), np.asarray(tokens, np.int64))

    def _append_one_each(self, handle: StepHandle, sampled: np.ndarray) -> None:
        """A step without drafts: each sampling row's one id [S] joins its batch row."""
        rows = handle.batch_rows  # [S]
        if handle.serials is not None:  # its ids were pending
            is_held = self.batch.still_held(rows, handle.serials)  # [S]
            if not is_held.all():
                rows, sampled = rows[is_held], sampled[is_held]
            self.batch.num_pending[rows] -= 1
        if len(rows):
            self.batch.append_one_each(rows, sampled)
