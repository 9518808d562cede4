"""The load balance of the MoE layers: tokens routed to each expert, summed over a step, max over mean.

Every MoE forward adds its (token, expert) pairs to its layer's counts [E] on the device (`ExpertLoad.record`:
a scatter-add, no host sync, so CUDA graphs capture it on the grouped-GEMM path as on the CPU path); once a
step the engine takes them (`ExpertLoadReader.take`): each layer's max over mean (1 = even, E / k = every
token to the same k experts), averaged over the layers that ran, and the counts start again from zero. On
CUDA the counts are copied to host memory behind the work in flight and read at the next take, once that
copy has finished: the figure is a step late, and the engine never waits for the device to report it.
"""

from __future__ import annotations

import torch


class ExpertLoad:
    """Tokens routed to each of a layer's experts since the last take (counts [E] int64 on the ids' device)."""

    def __init__(self, num_experts: int) -> None:
        self.num_experts = num_experts
        self.counts: torch.Tensor | None = None  # made on the first forward's device (the model's)

    def record(self, ids: torch.Tensor) -> None:
        """ids [T, k]: the experts (global ids) each token was routed to."""
        flat = ids.reshape(-1)  # [T*k]
        self.counts_on(flat.device).scatter_add_(0, flat, torch.ones_like(flat))

    def counts_on(self, device: torch.device) -> torch.Tensor:
        """The counts [E] on `device` (zeros made there if they are elsewhere or not yet made): also for a caller
        that adds to them in place (the C++ decoder stack's MoE layers: model/cpu_stack_moe.py)."""
        if self.counts is None or self.counts.device != torch.device(device):
            self.counts = torch.zeros(self.num_experts, dtype=torch.int64, device=device)
        return self.counts


def max_over_mean(counts: torch.Tensor) -> float | None:
    """counts [L, E] -> each layer's max over mean averaged over the layers with tokens; None when none had."""
    counts = counts[counts.sum(dim=1) > 0].double()  # [L', E]
    if counts.shape[0] == 0:
        return None
    return (counts.amax(dim=1) / counts.mean(dim=1)).mean().item()


class ExpertLoadReader:
    """Takes the layers' counts once a step without waiting for the device (see the module's docstring)."""

    def __init__(self) -> None:
        self.pending: tuple[torch.Tensor, torch.cuda.Event] | None = None  # host copy [L, E], its copy's event

    def take(self, loads: list[ExpertLoad]) -> float | None:
        """The balance of the steps since the last take (CUDA: of those before it); None when nothing ran."""
        counted = [load.counts for load in loads if load.counts is not None]
        if not counted:
            return None
        if not counted[0].is_cuda:
            return max_over_mean(self._take_counts(counted))
        if self.pending is not None and not self.pending[1].query():
            return None  # the last copy is still behind the work in flight: the counts keep adding up
        ready = None if self.pending is None else self.pending[0]
        host = torch.empty((len(counted), counted[0].numel()), dtype=torch.int64, pin_memory=True)
        host.copy_(self._take_counts(counted), non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self.pending = (host, event)
        return None if ready is None else max_over_mean(ready)

    @staticmethod
    def _take_counts(counted: list[torch.Tensor]) -> torch.Tensor:
        """The layers' counts [L, E], which start again from zero (made in the forward's inference mode)."""
        with torch.inference_mode():
            stacked = torch.stack(counted)
            torch._foreach_zero_(counted)
        return stacked
