"""Penalties' seen tokens kept on the device: per persistent-batch row of a request with penalties, its
output ids (appended on the device from each step's sampled ids, so a step never waits for the last
token to reach the host) and, with a repetition penalty, its prompt ids. Padded with vocab_size.

While the same rows sample, a step reuses the last PenaltyMetadata: where the rows are one run of the batch,
its output ids are a view of their rows of the buffer, so each step's appended ids are in it already. A step's
host work between two weight streams runs with cold caches, where every op costs tens of microseconds
(docs/benchmarks.md, "A step's host work with cold caches")."""

from __future__ import annotations

import numpy as np
import torch

from llmserve.model.paged_indices import on_device
from llmserve.sample.metadata import PenaltyMetadata, to_device
from llmserve.worker.input_batch import CachedRequestState


class PenaltyTokens:
    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output_ids = self._padded(1, 16)  # [R, C] int64
        self.prompt_ids = self._padded(1, 16)  # [R, Cp] int64
        self.num_output = np.zeros(1, np.int64)  # [R] ids written (or being written) per row
        self._cached: tuple[tuple, PenaltyMetadata] | None = None  # (its rows' key, the metadata)

    def add(self, state: CachedRequestState) -> None:
        """A new row: its prompt (repetition penalty) and the outputs it resumes with."""
        self._cached = None
        self._fit_rows(state.row + 1)
        self.output_ids[state.row].fill_(self.vocab_size)
        self.num_output[state.row] = 0
        self.append_host(state.row, state.output_token_ids)
        if state.params.repetition_penalty != 1.0:
            self.prompt_ids = self._fit_columns(self.prompt_ids, len(state.prompt_token_ids))
            self.prompt_ids[state.row].fill_(self.vocab_size)
            prompt = to_device(state.prompt_token_ids, torch.int64, self.device)
            self.prompt_ids[state.row, :len(state.prompt_token_ids)] = prompt

    def append_host(self, row: int, token_ids: list[int]) -> None:
        start = int(self.num_output[row])
        self.output_ids = self._fit_columns(self.output_ids, start + len(token_ids))
        if token_ids:
            self.output_ids[row, start:start + len(token_ids)] = to_device(token_ids, torch.int64, self.device)
        self.num_output[row] = start + len(token_ids)

    def append_sampled(self, rows: np.ndarray, sampled: torch.Tensor) -> None:
        """rows [S'] (batch rows) take one id each from sampled [S'] (device), without a host sync."""
        ends = self.num_output[rows]  # [S'] int64
        self.output_ids = self._fit_columns(self.output_ids, int(ends.max()) + 1)
        if self.device.type == "cpu":  # one numpy assignment: no index tensor, no dispatch
            self.output_ids.numpy()[rows, ends] = sampled.numpy()
        else:
            index = on_device(np.stack([rows, ends]), self.device)  # [2, S'] int64: rows, columns
            self.output_ids[index[0], index[1]] = sampled
        self.num_output[rows] = ends + 1

    def metadata(self, states: list[CachedRequestState]) -> PenaltyMetadata | None:
        indices = [i for i, s in enumerate(states) if s.has_penalties]
        if not indices:
            return None
        rows = [states[i].row for i in indices]
        key = (*indices, *rows)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        is_run = rows == list(range(rows[0], rows[0] + len(rows)))
        meta = self._build(states, indices, rows, is_run)
        self._cached = (key, meta) if is_run else None
        return meta

    def _build(self, states: list[CachedRequestState], indices: list[int], rows: list[int],
               is_run: bool) -> PenaltyMetadata:
        """Rows that are one run of the batch read a view of theirs (all columns: the unwritten ones are padding);
        others a copy of the columns written so far."""
        params = [states[i].params for i in indices]
        if is_run:
            output_ids = self.output_ids[rows[0]:rows[0] + len(rows)]  # [P, C] view
        else:
            width = max(1, int(self.num_output[rows].max()))
            output_ids = self.output_ids[to_device(rows, torch.int64, self.device), :width]  # [P, width]
        has_repetition = any(p.repetition_penalty != 1.0 for p in params)
        prompt_width = max([len(states[i].prompt_token_ids) for i in indices] + [1])
        row_ids = to_device(rows, torch.int64, self.device)  # [P]
        return PenaltyMetadata(
            row_indices=to_device(indices, torch.int64, self.device),
            repetition_penalties=to_device([p.repetition_penalty for p in params], torch.float32, self.device),
            frequency_penalties=to_device([p.frequency_penalty for p in params], torch.float32, self.device),
            presence_penalties=to_device([p.presence_penalty for p in params], torch.float32, self.device),
            output_token_ids=output_ids,
            prompt_token_ids=self._prompts(row_ids, params, prompt_width) if has_repetition else None,
            has_output_penalties=any(p.frequency_penalty != 0.0 or p.presence_penalty != 0.0 for p in params))

    def _prompts(self, rows: torch.Tensor, params: list, width: int) -> torch.Tensor:
        """[P, width] prompt ids; rows without a repetition penalty see none (all padding)."""
        ids = self.prompt_ids[rows, :width]
        uses = to_device([p.repetition_penalty != 1.0 for p in params], torch.bool, self.device)
        return torch.where(uses.unsqueeze(1), ids, self.vocab_size)

    def _padded(self, num_rows: int, num_columns: int) -> torch.Tensor:
        return torch.full((num_rows, num_columns), self.vocab_size, dtype=torch.int64, device=self.device)

    def _fit_rows(self, num_rows: int) -> None:
        if num_rows <= len(self.num_output):
            return
        self._cached = None
        grown = max(num_rows, 2 * len(self.num_output))
        for name in ("output_ids", "prompt_ids"):
            old = getattr(self, name)
            new = self._padded(grown, old.shape[1])
            new[:old.shape[0]] = old
            setattr(self, name, new)
        self.num_output = np.concatenate([self.num_output, np.zeros(grown - len(self.num_output), np.int64)])

    def _fit_columns(self, ids: torch.Tensor, num_columns: int) -> torch.Tensor:
        if num_columns <= ids.shape[1]:
            return ids
        self._cached = None
        wider = self._padded(ids.shape[0], max(num_columns, 2 * ids.shape[1]))
        wider[:, :ids.shape[1]] = ids
        return wider
