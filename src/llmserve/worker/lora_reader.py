"""Adapters read from disk on a background thread, so that a request whose adapter is not in memory waits
aside while the other requests keep stepping (as a request waiting for its KV does: core/kv_loading.py).

The scheduler asks `is_in_memory` before it starts a request of an adapter: an adapter in a slot, in the
host LRU or read already is; one that is not has its read started here (safetensors read, checked against
the base model's shapes, split for this tensor-parallel rank, laid out as the slots hold it) and the request
waits, keeping its place at the head of the queue. The read image stays here until the runner takes it
(`take`) to copy into a slot, on the step loop. A read that failed hands its error to `take`, as a read on the loop would raise.
With tensor parallelism rank 0 tells the other ranks when it starts a read (`on_start`, the step broadcast),
so each reads its share beside rank 0 instead of on its step loop when the request first runs.
"""

from __future__ import annotations

import concurrent.futures
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from llmserve.lora_request import LoRARequest
from llmserve.model.lora_layers import AdapterImage


class LoRAReader:
    def __init__(self, read: Callable[[LoRARequest], AdapterImage], max_kept: int) -> None:
        """read: an adapter's weights from disk, checked and ready for a slot (runs on the reader thread).
        max_kept: reads kept untaken (those of aborted requests), the oldest ended dropped past it."""
        self.read = read
        self.max_kept = max_kept
        self.reads: dict[int, Future[AdapterImage]] = {}  # adapter id -> its read (done or under way)
        self._pool: ThreadPoolExecutor | None = None  # started on the first read
        self.on_start: Callable[[LoRARequest], None] | None = None  # told of each read started here

    @property
    def num_reading(self) -> int:
        return sum(not read.done() for read in self.reads.values())

    def has_read(self, lora: LoRARequest) -> bool:
        """Whether the adapter's read ended (or failed); if none was started, it starts now."""
        read = self.reads.get(lora.lora_int_id)
        if read is None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(1, thread_name_prefix="lora-reader")
            read = self.reads[lora.lora_int_id] = self._pool.submit(self.read, lora)
            self._drop_untaken()
            if self.on_start is not None:
                self.on_start(lora)
        return read.done()

    def take(self, lora: LoRARequest) -> AdapterImage:
        """The adapter's weights: its read's (waited for if under way; raised if it failed), else read now."""
        read = self.reads.pop(lora.lora_int_id, None)
        return self.read(lora) if read is None else read.result()

    def _drop_untaken(self) -> None:
        ended = [lora_id for lora_id, read in self.reads.items() if read.done()]
        for lora_id in ended[:max(0, len(self.reads) - self.max_kept)]:
            del self.reads[lora_id]

    def wait(self, timeout: float) -> None:
        """Block until a read ends or `timeout` seconds pass (an engine with nothing else to run)."""
        pending = [read for read in self.reads.values() if not read.done()]
        if pending:
            concurrent.futures.wait(pending, timeout, return_when=concurrent.futures.FIRST_COMPLETED)
