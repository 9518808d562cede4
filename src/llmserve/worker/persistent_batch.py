"""The runner's persistent input batch: every request it holds keeps a row in preallocated host arrays
(token ids, computed count, block table), updated from each step's diff. A step's flat inputs are
gathered from those rows with a few numpy ops instead of being rebuilt from Python lists. The rows are
also the one home of what changes per request every step (its token history, its count of sampled ids
still on the device): a step's bookkeeping is a few numpy ops over its rows, not a loop over requests.

With KV cache groups (core/kv_cache_groups.py) a row's block table holds every group's blocks, interleaved
as the scheduler sends them (column i * G + g: group g's block i); each group's table and cache slots are
taken from it per step (`group_tables`).

Async scheduling: a row may end in one token that was sampled on the device by the step launched
last and is not on the host yet. `gather` leaves such tokens to the caller as (token index, index in
that step's sampled ids) pairs, which it fills on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from llmserve.model.paged_indices import flat_positions, slot_mapping

INITIAL_TOKEN_COLUMNS = 256
INITIAL_BLOCK_COLUMNS = 16
_NONE = np.zeros(0, np.int64)  # no pending tokens (never written)


@dataclass
class StepArrays:
    """A step's flat inputs on the host; T tokens over B rows (row order of the schedule)."""

    input_ids: np.ndarray  # [T] int64; 0 where the token is pending on the device
    positions: np.ndarray  # [T] int64
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int64
    block_table: np.ndarray  # [B, G * W] int32, padded with the null block 0 (G groups interleaved)
    slot_mapping: np.ndarray  # [T] int64; with G > 1 groups [G, T]: each group's
    sample_rows: np.ndarray  # [S] int64: rows whose last token here is the last known or pending one
    pending_tokens: np.ndarray  # [P] int64: token indices whose id is on the device only
    pending_sources: np.ndarray  # [P] int64: their index in the last launched step's sampled ids


class PersistentBatch:
    def __init__(self, max_num_rows: int, max_model_len: int, block_size: int, num_groups: int = 1) -> None:
        self.block_size = block_size
        self.num_groups = num_groups
        self.max_model_len = max_model_len
        self.token_ids = np.zeros((max_num_rows, min(INITIAL_TOKEN_COLUMNS, max_model_len)), np.int64)  # [R, L]
        self.num_tokens = np.zeros(max_num_rows, np.int64)  # [R] ids known on the host (drafts excluded)
        self.num_computed = np.zeros(max_num_rows, np.int64)  # [R] tokens whose KV is computed or scheduled
        self.num_drafts = np.zeros(max_num_rows, np.int64)  # [R] draft ids written after them
        self.num_prompt = np.zeros(max_num_rows, np.int64)  # [R] prompt tokens (past them: decode tokens)
        self.block_table = np.zeros((max_num_rows, INITIAL_BLOCK_COLUMNS), np.int32)  # [R, W]
        self.num_blocks = np.zeros(max_num_rows, np.int64)  # [R]
        self.last_sample_index = np.full(max_num_rows, -1, np.int64)  # [R] row in the last step's samples
        self.has_pending = False  # some row's last_sample_index is set (a launched step's ids not on the host)
        self.num_pending = np.zeros(max_num_rows, np.int64)  # [R] ids sampled on the device, not on the host yet
        self.has_penalties = np.zeros(max_num_rows, bool)  # [R] its sampling reads its output ids
        self.serial = np.full(max_num_rows, -1, np.int64)  # [R] which request holds the row (-1: none)
        self.num_added = 0  # requests added so far: the next one's serial
        self.row_of: dict[str, int] = {}
        self.free_rows = list(range(max_num_rows - 1, -1, -1))

    # ---- rows in and out ----------------------------------------------------------------------------

    def add(self, req_id: str, token_ids: list[int], block_ids: list[int], has_penalties: bool = False,
            num_computed: int = 0, num_prompt: int | None = None) -> int:
        """A row for a new request (a resumed one comes back with its outputs in `token_ids`: num_prompt,
        default all of them, says where its prompt ends)."""
        if not self.free_rows:
            self._grow_rows()
        row = self.free_rows.pop()
        self.row_of[req_id] = row
        self.num_tokens[row] = self.num_drafts[row] = self.num_blocks[row] = self.num_pending[row] = 0
        self.last_sample_index[row] = -1
        self.has_penalties[row] = has_penalties
        self.num_computed[row] = num_computed
        self.num_prompt[row] = len(token_ids) if num_prompt is None else num_prompt
        self.serial[row] = self.num_added
        self.num_added += 1
        self.append_tokens(row, token_ids)
        self.set_blocks(row, 0, block_ids)
        return row

    def remove(self, req_id: str) -> None:
        row = self.row_of.pop(req_id, None)
        if row is not None:
            self.last_sample_index[row] = -1
            self.serial[row] = -1  # ids of steps still in flight for it no longer find it
            self.free_rows.append(row)

    def set_blocks(self, row: int, num_kept: int, new_block_ids: list[int]) -> None:
        """The row's first `num_kept` blocks stay (later ones were trimmed); `new_block_ids` follow."""
        end = num_kept + len(new_block_ids)
        self._ensure_block_columns(end)
        self.block_table[row, num_kept:end] = new_block_ids
        self.num_blocks[row] = end

    def append_blocks(self, appended: np.ndarray) -> None:
        """Blocks after rows' blocks, vectorized; appended [N, 3]: (row, column, block id), a row's in a run of
        consecutive columns from its block count."""
        rows, columns = appended[:, 0], appended[:, 1]  # [N]
        self._ensure_block_columns(int(columns.max()) + 1)
        self.block_table[rows, columns] = appended[:, 2]
        is_last = np.append(rows[1:] != rows[:-1], True)  # [N] a row's last new block
        self.num_blocks[rows[is_last]] = columns[is_last] + 1

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        start = int(self.num_tokens[row])
        self.ensure_token_columns(start + len(token_ids))
        self.token_ids[row, start:start + len(token_ids)] = token_ids
        self.num_tokens[row] = start + len(token_ids)
        self.num_drafts[row] = 0

    def append_one_each(self, rows: np.ndarray, token_ids: np.ndarray) -> None:
        """One token per row (the common decode step), vectorized; rows [S], token_ids [S]."""
        ends = self.num_tokens[rows]  # [S]
        self.ensure_token_columns(int(ends.max()) + 1)
        self.token_ids[rows, ends] = token_ids
        self.num_tokens[rows] = ends + 1
        self.num_drafts[rows] = 0

    def set_drafts(self, row: int, drafts: list[int]) -> None:
        """Draft ids scheduled after the row's tokens for this step (overwritten by later tokens)."""
        start = int(self.num_tokens[row])
        self.ensure_token_columns(start + len(drafts))
        self.token_ids[row, start:start + len(drafts)] = drafts
        self.num_drafts[row] = len(drafts)

    # ---- one step --------------------------------------------------------------------------------------

    def gather(self, rows: np.ndarray, starts: np.ndarray, counts: np.ndarray) -> StepArrays:
        """The step's inputs: row i computes counts[i] tokens from position starts[i]."""
        cu, row_of_token, positions = flat_positions(starts, counts)
        batch_rows = rows if len(positions) == len(rows) else rows[row_of_token]  # [T] (one token a row: rows)
        num_known = self.num_tokens[rows] + self.num_drafts[rows]  # [B]
        seq_lens = starts + counts
        if self.has_pending:
            input_ids, pending_tokens, pending_sources = self._with_pending(batch_rows, positions, num_known[row_of_token])
            num_known = num_known + (self.last_sample_index[rows] >= 0)
        else:  # nothing in flight: every token is on the host
            assert (seq_lens <= num_known).all(), "a token is neither on the host nor in flight"
            input_ids, pending_tokens = self.token_ids[batch_rows, positions], _NONE
            pending_sources = _NONE
        sample_rows = np.flatnonzero(seq_lens == num_known)
        block_table, slots = self._blocks_and_slots(rows, row_of_token, positions)
        return StepArrays(input_ids, positions, cu.astype(np.int32), seq_lens, block_table, slots, sample_rows,
                          pending_tokens, pending_sources)

    def _blocks_and_slots(self, rows: np.ndarray, row_of_token: np.ndarray,
                          positions: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The rows' block table [B, G * W] and each token's cache slot [T] ([G, T] with G > 1 groups)."""
        block_table = self.rows_block_table(rows)
        if self.num_groups == 1:
            return block_table, slot_mapping(block_table, row_of_token, positions, self.block_size)
        return block_table, np.stack([slot_mapping(table, row_of_token, positions, self.block_size)
                                      for table in self.group_tables(block_table)])

    def rows_block_table(self, rows: np.ndarray) -> np.ndarray:
        """The rows' block table [B, G * W], as wide as the widest row's blocks (at least one column a group)."""
        return self.block_table[rows, :max(self.num_groups, int(self.num_blocks[rows].max()))]

    def group_tables(self, block_table: np.ndarray) -> list[np.ndarray]:
        """[G] each group's table [B, W] (views) of a rows' block table [B, G * W]."""
        return [block_table[:, group::self.num_groups] for group in range(self.num_groups)]

    def _with_pending(self, batch_rows: np.ndarray, positions: np.ndarray,
                      num_known: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Input ids [T] with 0 where a token is on the device only; those tokens' indices [P] and their
        index in the last launched step's sampled ids [P]."""
        is_known = positions < num_known  # [T]
        columns = np.minimum(positions, self.token_ids.shape[1] - 1)
        input_ids = np.where(is_known, self.token_ids[batch_rows, columns], 0)
        pending_tokens = np.flatnonzero(~is_known)
        pending_sources = self.last_sample_index[batch_rows[pending_tokens]]
        assert (pending_sources >= 0).all(), "a token is neither on the host nor in the last step's samples"
        return input_ids, pending_tokens, pending_sources

    def mark_sampled(self, rows: np.ndarray) -> None:
        """`rows` (in order) sample in the step just launched: their next token is its sample j."""
        if self.has_pending:
            self.last_sample_index[:] = -1
        self.last_sample_index[rows] = np.arange(len(rows))
        self.has_pending = len(rows) > 0

    def still_held(self, rows: np.ndarray, serials: np.ndarray) -> np.ndarray:
        """[S] bool: row i still holds the request that held it when `serials` [S] was read."""
        return self.serial[rows] == serials

    def clear_pending(self) -> None:
        """The last launched step's ids reached the host: no row has a token on the device only."""
        if self.has_pending:
            self.last_sample_index[:] = -1
            self.has_pending = False

    # ---- capacity -----------------------------------------------------------------------------------

    def ensure_token_columns(self, num: int) -> None:
        assert num <= self.max_model_len + 64, "more tokens than the context length"
        if num > self.token_ids.shape[1]:
            self.token_ids = _widen(self.token_ids, num)

    def _ensure_block_columns(self, num: int) -> None:
        if num > self.block_table.shape[1]:
            self.block_table = _widen(self.block_table, num)

    def _grow_rows(self) -> None:
        old = len(self.num_tokens)
        self.token_ids = np.concatenate([self.token_ids, np.zeros_like(self.token_ids)])
        self.block_table = np.concatenate([self.block_table, np.zeros_like(self.block_table)])
        for name in ("num_tokens", "num_computed", "num_drafts", "num_prompt", "num_blocks", "num_pending",
                     "has_penalties"):
            setattr(self, name, np.concatenate([getattr(self, name), np.zeros_like(getattr(self, name))]))
        for name in ("last_sample_index", "serial"):
            setattr(self, name, np.concatenate([getattr(self, name), np.full(old, -1, np.int64)]))
        self.free_rows = list(range(2 * old - 1, old - 1, -1)) + self.free_rows

    def check_integrity(self) -> None:
        rows = list(self.row_of.values())
        assert len(set(rows)) == len(rows), "two requests share a row"
        assert not set(rows) & set(self.free_rows), "a held row is also free"
        assert len(rows) + len(self.free_rows) == len(self.num_tokens), "rows lost"
        assert (self.serial[rows] >= 0).all() and (self.serial[self.free_rows] == -1).all(), "row serials"
        assert len(set(self.serial[rows].tolist())) == len(rows), "two rows share a serial"
        assert ((self.num_pending[rows] >= 0) & (self.num_pending[rows] <= 2)).all(), "pending ids miscounted"
        assert self.has_pending or (self.last_sample_index == -1).all(), "a sample index set, none pending"


def _widen(array: np.ndarray, num_columns: int) -> np.ndarray:
    """A copy with at least num_columns columns (doubling, so growth is amortized)."""
    columns = array.shape[1]
    while columns < num_columns:
        columns *= 2
    wider = np.zeros((array.shape[0], columns), array.dtype)
    wider[:, :array.shape[1]] = array
    return wider
