"""Index arithmetic of a forward over the paged KV cache, for the runner (worker/step_inputs.py) and the draft
model (spec/draft_inputs.py): flat token positions, cache slots, the sampling rows' logits indices, the Triton
kernel's query tiles, and the host-to-device copy of these arrays."""

from __future__ import annotations

import numpy as np
import torch


def on_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host array -> tensor on device; on CUDA through pinned memory, non_blocking (the host never waits)."""
    tensor = torch.from_numpy(array)
    if device.type == "cpu":
        return tensor  # what .to(device) would return, without its dispatch
    if device.type != "cuda":
        return tensor.to(device)
    return tensor.pin_memory().to(device, non_blocking=True)


def logits_indices(ends: np.ndarray, num_drafts: np.ndarray) -> np.ndarray:
    """Per sampling row (its tokens end at `ends`): the last num_drafts + 1 token indices, flattened."""
    if not num_drafts.any():
        return ends - 1
    counts = num_drafts + 1  # [S]
    offsets = np.arange(int(counts.sum())) - np.repeat(np.cumsum(counts) - counts, counts)  # [N]
    return np.repeat(ends - counts, counts) + offsets


def flat_positions(starts: np.ndarray, counts: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per row `counts` tokens from `starts`: (cu [B + 1], row of each token [T], positions [T])."""
    cu = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=cu[1:])
    if cu[-1] == len(counts) and (counts == 1).all():  # one token per row (decode steps)
        return cu, np.arange(len(counts)), starts.copy()
    row_of_token = np.repeat(np.arange(len(counts)), counts)  # [T]
    positions = np.arange(int(cu[-1])) - cu[:-1][row_of_token] + starts[row_of_token]  # [T]
    return cu, row_of_token, positions


def slot_mapping(block_table: np.ndarray, row_of_token: np.ndarray, positions: np.ndarray,
                 block_size: int) -> np.ndarray:
    """[T] cache slot of each token: its block's id * block_size + offset (numpy arrays, or torch tensors
    on the device: the draft chain's)."""
    block_ids = block_table[row_of_token, positions // block_size]
    block_ids = block_ids.long() if isinstance(block_ids, torch.Tensor) else block_ids.astype(np.int64)
    return block_ids * block_size + positions % block_size


def query_tiles(query_lens: list[int], block_q: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows' queries cut into tiles of block_q -> (tile_rows, tile_starts), both [tiles] int32."""
    lens = np.asarray(query_lens, dtype=np.int64)  # [B]
    num_tiles = -(-lens // block_q)  # [B]
    tile_rows = np.repeat(np.arange(len(lens)), num_tiles)  # [tiles]
    first_tile = np.cumsum(num_tiles) - num_tiles  # [B]
    tile_starts = (np.arange(int(num_tiles.sum())) - first_tile[tile_rows]) * block_q  # [tiles]
    return tile_rows.astype(np.int32), tile_starts.astype(np.int32)
