"""Where the runner's steps spend their time (read by the offline benchmark and the speculator's tests)."""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch


@dataclass
class StepTimes:
    """Seconds spent in each part of the runner's steps since the last reset (with `sync_timing` on
    CUDA the device is synchronised at each boundary, so that a part's time is its own)."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    propose: float = 0.0
    num_steps: int = 0
    num_tokens: int = 0  # tokens the forwards computed (their KV written)
    num_device_inputs: int = 0  # input tokens read from the last step's sampled ids on the device

    def add(self, t0: float, t1: float, t2: float, t3: float) -> None:
        """One forward: prepared from t0 to t1, run to t2, sampled to t3."""
        self.prepare += t1 - t0
        self.forward += t2 - t1
        self.sample += t3 - t2
        self.num_steps += 1


def mark(device: torch.device, is_synced: bool) -> float:
    """Now; with `is_synced` on CUDA once the device has run all it was given."""
    if is_synced and device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()
