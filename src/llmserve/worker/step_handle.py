"""A launched step whose sampled ids may still be on their way to the host.

On CUDA the sampled ids (and logprobs) are copied into pinned host memory with non_blocking copies
queued right after sampling, and an event marks their arrival: the host waits only for that event,
when it needs the ids, while the device already runs the next step. On CPU the values are ready when
the step returns (the same code path with a device that never runs ahead).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
import torch

from llmserve.core.sched_output import ModelRunnerOutput
from llmserve.sample.sampler import SamplerOutput


@dataclass
class HostCopy:
    """Device tensors on their way to host memory."""

    tensors: dict[str, torch.Tensor]
    event: torch.cuda.Event | None = None

    @classmethod
    def start(cls, tensors: dict[str, torch.Tensor]) -> HostCopy:
        sample = next(iter(tensors.values()), None)
        if sample is None or sample.device.type != "cuda":
            return cls(tensors)
        host = {name: torch.empty(t.shape, dtype=t.dtype, pin_memory=True).copy_(t, non_blocking=True)
                for name, t in tensors.items()}
        event = torch.cuda.Event()
        event.record()
        return cls(host, event)

    def wait(self) -> dict[str, torch.Tensor]:
        if self.event is not None:
            self.event.synchronize()
            self.event = None
        return self.tensors


@dataclass
class StepHandle:
    """What `ModelRunner.launch` returns; `ModelRunner.finish` turns it into the step's output."""

    req_ids: list[str]  # the step's rows, in order
    sample_rows: np.ndarray  # [S] rows that sampled
    sampled: torch.Tensor  # [S] int64 on the device: the next step's inputs read it there
    copy: HostCopy
    batch_rows: np.ndarray  # [S] int64 their rows in the runner's PersistentBatch
    serials: np.ndarray | None  # [S] int64 those rows' serials at launch (a row taken over meanwhile differs);
    # None: the step finished at once (ModelRunner.execute), its ids never pending
    num_logprobs: list[int | None] = field(default_factory=list)  # [S] per sampling row, asked count
    output: ModelRunnerOutput | None = None  # set once finished
    is_sync: bool = False  # verified on the host at launch (drafts): the ids below, no copy
    host_tokens: list[list[int]] | None = None  # is_sync: per sampling row its emitted ids
    host_logprobs: list | None = None  # is_sync: per sampling row its Logprobs list, or None
    host_num_accepted: list[int] | None = None  # is_sync: per sampling row its accepted drafts
    use_speculation: bool = False  # propose drafts for the next step once finished
    prompt_plan: Any = None  # worker.prompt_logprobs.PromptLogprobsPlan of the step's scored prompt tokens


def start_host_copy(out: SamplerOutput, extra: dict[str, torch.Tensor] | None = None) -> HostCopy:
    tensors = {"sampled": out.sampled_token_ids, **(extra or {})}
    if out.logprobs is not None:
        tensors.update(lp_ids=out.logprobs.token_ids, lp_values=out.logprobs.logprobs,
                       lp_ranks=out.logprobs.sampled_ranks)
    return HostCopy.start(tensors)


def rows_of_samples(sampled: list, sample_rows: np.ndarray, num_rows: int, fill: Callable[[], Any] = list) -> list:
    """Per sampling row values [S] -> per row of the step [num_rows]; rows that did not sample get `fill()`."""
    if len(sampled) == num_rows:
        return sampled  # every row sampled: already in row order
    per_row = [fill() for _ in range(num_rows)]
    for value, row in zip(sampled, sample_rows.tolist()):
        per_row[row] = value
    return per_row
