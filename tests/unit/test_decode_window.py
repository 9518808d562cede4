"""A multi-step window's precomputed inputs (worker/decode_window.py) are the inputs the persistent batch's
gather gives for the same rows and positions; vectorized block appends equal row-by-row ones."""

import random

import numpy as np
import torch

from llmserve.worker.decode_window import DecodeWindow
from llmserve.worker.persistent_batch import PersistentBatch

BLOCK_SIZE = 4
NUM_FORWARDS = 6


def _batch(rng: random.Random, num_rows: int) -> tuple[PersistentBatch, list[int]]:
    """Rows with a few tokens each, every block they need for a window, and their first forward run."""
    batch = PersistentBatch(max_num_rows=4, max_model_len=64, block_size=BLOCK_SIZE)  # grows its rows
    rows, next_block = [], 1
    for i in range(num_rows):
        num_tokens = rng.randint(1, 13)
        num_blocks = (num_tokens + NUM_FORWARDS + BLOCK_SIZE - 1) // BLOCK_SIZE
        blocks = rng.sample(range(next_block, next_block + 3 * num_blocks), num_blocks)
        next_block += 3 * num_blocks
        # the window's first forward computed the row's last token but one and sampled its last
        rows.append(batch.add(str(i), [rng.randrange(100) for _ in range(num_tokens + 1)], blocks,
                              num_computed=num_tokens))
    return batch, rows


def test_window_inputs_equal_the_gathered_ones_as_rows_drop_out():
    rng = random.Random(3)
    batch, rows = _batch(rng, 7)
    batch_rows = np.array(rows[::-1], np.int64)  # not in row order
    window = DecodeWindow(batch, [f"state{r}" for r in batch_rows], batch_rows, NUM_FORWARDS, torch.device("cpu"))
    live = list(range(len(batch_rows)))  # indices of the rows still in the window
    for j in range(1, NUM_FORWARDS):
        if j in (2, 4):  # rows drop out
            kept = np.array([i for i in range(len(live)) if (live[i] + j) % 3], np.int64)
            live = [live[i] for i in kept.tolist()]
            window.keep(kept)
        current = batch_rows[live]
        starts = batch.num_computed[current].copy()
        expected = batch.gather(current, starts, np.ones(len(current), np.int64))
        ids = expected.input_ids  # the tokens gather reads are the ones the forward before sampled
        inputs = window.inputs(j, ids)
        assert window.states == [f"state{r}" for r in current]
        assert (inputs.positions.numpy() == expected.positions).all()
        assert (inputs.attn.slot_mapping.numpy() == expected.slot_mapping).all()
        assert (inputs.attn.seq_lens.numpy() == expected.seq_lens).all() and inputs.attn.seq_lens_cpu == \
            expected.seq_lens.tolist()
        width = expected.block_table.shape[1]
        assert (inputs.attn.block_table.numpy()[:, :width] == expected.block_table).all()
        assert (inputs.attn.query_start_loc.numpy() == expected.query_start_loc).all()
        assert (inputs.input_ids.numpy() == ids).all() and (batch.num_computed[current] == starts + 1).all()
        sampled = np.array([rng.randrange(100) for _ in current], np.int64)
        window.append(sampled)
        assert (batch.num_tokens[current] == starts + 2).all()
        assert (batch.token_ids[current, starts + 1] == sampled).all()
    batch.check_integrity()


def test_appending_several_blocks_a_row_equals_setting_them():
    rng = random.Random(5)
    vectorized, rows = _batch(rng, 5)
    one_by_one, _ = _batch(random.Random(5), 5)
    appended = []
    for row in rows[1:4]:
        num_old = int(vectorized.num_blocks[row])
        new = [rng.randrange(1, 500) for _ in range(rng.randint(1, 5))]
        appended += [(row, num_old + i, block) for i, block in enumerate(new)]
        one_by_one.set_blocks(row, num_old, new)
    vectorized.append_blocks(np.array(appended, np.int64))
    assert (vectorized.num_blocks == one_by_one.num_blocks).all()
    width = one_by_one.block_table.shape[1]
    assert (vectorized.block_table[:, :width] == one_by_one.block_table).all()
