"""Pooling (--runner pooling): a prompt's hidden states -> one vector, over the chunks its prefill ran in.

A step's rows are prompt chunks (positions start .. start + count of each prompt). Last-token pooling
reads the last chunk's last row; CLS keeps the first chunk's first row; mean pooling keeps a running
float32 sum over the chunks. A row whose prompt ends this step gets its vector (normalised if the config
says), the others None. A preempted request starts again from its first token (no prefix cache but for
last-token pooling, which needs no earlier hidden state): `forget` drops what it had kept.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from llmserve.pooling import PoolerConfig


class Pooler:
    def __init__(self, config: PoolerConfig) -> None:
        config.validate()
        self.config = config
        self.partial: dict[str, torch.Tensor] = {}  # req id -> [hidden] float32: MEAN's sum so far, CLS's first row

    def pool(self, hidden: torch.Tensor, req_ids: list[str], starts: np.ndarray, counts: np.ndarray,
             num_prompt: np.ndarray) -> list[bytes | None]:
        """hidden [T, H] the step's rows (each row's `counts` tokens in turn, from position `starts`) -> per
        row its pooled vector (float32 bytes) if its prompt ends in this step, else None."""
        ends = np.cumsum(counts)  # [B]
        done: list[int] = []
        vectors: list[torch.Tensor] = []
        for i, req_id in enumerate(req_ids):
            chunk = hidden[ends[i] - counts[i]:ends[i]]  # [count, H]
            is_last = starts[i] + counts[i] == num_prompt[i]
            vector = self._take(req_id, chunk, starts[i] == 0, is_last, int(num_prompt[i]))
            if vector is not None:
                done.append(i)
                vectors.append(vector)
        out: list[bytes | None] = [None] * len(req_ids)
        if not vectors:
            return out
        pooled = torch.stack(vectors).float()  # [R, H]
        if self.config.normalize:
            pooled = F.normalize(pooled, dim=-1)
        host = pooled.cpu().numpy().astype("<f4")  # [R, H]
        for i, row in zip(done, host):
            out[i] = row.tobytes()
        return out

    def _take(self, req_id: str, chunk: torch.Tensor, is_first: bool, is_last: bool,
              num_prompt: int) -> torch.Tensor | None:
        kind = self.config.pooling_type
        if kind == "LAST":
            return chunk[-1] if is_last else None
        if kind == "CLS":
            if is_first:
                self.partial[req_id] = chunk[0].float()
            return self.partial.pop(req_id) if is_last else None
        assert kind == "MEAN", kind
        assert is_first == (req_id not in self.partial), "mean pooling lost a chunk"
        total = chunk.float().sum(dim=0)  # [H]
        if not is_first:
            total += self.partial[req_id]
        if is_last:
            self.partial.pop(req_id, None)
            return total / num_prompt
        self.partial[req_id] = total
        return None

    def forget(self, req_ids) -> None:
        for req_id in req_ids:
            self.partial.pop(req_id, None)

    def check_integrity(self, live_req_ids) -> None:
        assert set(self.partial) <= set(live_req_ids), "the pooler keeps sums of requests that are gone"
