"""The runner's LoRA adapters: a fixed pool of slots on the device, an LRU of adapters in host memory, and
each forward's token -> slot map.

A request's adapter takes a slot when the runner first sees it (read from disk, or from the host LRU of
--max-cpu-loras adapters) and holds it until the request finishes or is preempted; a slot no request
holds is reused, least recently released first. The scheduler admits at most --max-loras adapters among
running requests, so a slot is always free when one is asked for, and starts a request only once its
adapter is in memory (`is_in_memory`: read from disk on a background thread, worker/lora_reader.py, and laid
out there as the slots hold it); the copy into a slot, a few contiguous copies per projection, runs on the
step loop.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import torch

from llmserve.lora_request import LoRARequest
from llmserve.model.lora_adapter import base_shapes, read_adapter
from llmserve.model.lora_layers import AdapterImage, adapter_image, attach_lora, load_slot, lora_step, shard_adapter
from llmserve.worker.lora_reader import LoRAReader


class LoRAManager:
    def __init__(self, model: torch.nn.Module, max_loras: int, max_lora_rank: int, max_cpu_loras: int,
                 max_num_rows: int, device: torch.device, slot_dtype: torch.dtype | None = None) -> None:
        """slot_dtype: the adapters' dtype in slots and host memory (None: the model's, --lora-dtype auto)."""
        self.dtype = slot_dtype or model.model.embed_tokens.weight.dtype
        self.context, self.wrapped = attach_lora(model, max_loras, max_lora_rank, self.dtype)
        self.shapes = base_shapes(model.config)
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = max_cpu_loras
        self.device = device
        self.layout = getattr(model, "layout", None)  # tensor parallelism: this rank's share (None: one rank)
        self.host: OrderedDict[int, AdapterImage] = OrderedDict()  # adapter id -> its slot image, least recent first
        self.slot_ids: list[int | None] = [None] * max_loras  # the adapter each slot holds
        self.slot_names: list[str | None] = [None] * max_loras  # and its name (what routers prefer replicas by)
        self.slot_users = [0] * max_loras  # running requests on each slot
        self.free_order: OrderedDict[int, None] = OrderedDict((s, None) for s in range(max_loras))  # unheld slots
        self.slot_of_row = np.full(max_num_rows, -1, np.int64)  # [rows] each batch row's slot (-1: base)
        self.num_loads = 0  # adapters written into a slot (swaps included)
        self.reader = LoRAReader(self._read, max_cpu_loras)

    def is_in_memory(self, lora: LoRARequest) -> bool:
        """Whether the adapter is in a slot, in host memory or read; if not, its read from disk starts in the
        background (the scheduler holds its requests until it ends)."""
        lora_id = lora.lora_int_id
        return lora_id in self.slot_ids or lora_id in self.host or self.reader.has_read(lora)

    def acquire(self, row: int, lora: LoRARequest | None) -> None:
        """Batch row `row`'s request runs with `lora` (None: the base model) from now on."""
        if row >= len(self.slot_of_row):  # the persistent batch grew its rows
            grown = np.full(max(row + 1, 2 * len(self.slot_of_row)), -1, np.int64)
            grown[:len(self.slot_of_row)] = self.slot_of_row
            self.slot_of_row = grown
        if lora is None:
            self.slot_of_row[row] = -1
            return
        slot = self._slot_of(lora.lora_int_id)
        if slot is None:
            slot = self._evict()
            load_slot(self.wrapped, slot, self._image(lora))
            self.slot_ids[slot], self.slot_names[slot] = lora.lora_int_id, lora.lora_name
            self.num_loads += 1
        self.free_order.pop(slot, None)
        self.slot_users[slot] += 1
        self.slot_of_row[row] = slot

    def resident_names(self) -> list[str]:
        """The names of the adapters in the slots (held or not)."""
        return sorted({name for name in self.slot_names if name is not None})

    def release(self, row: int) -> None:
        slot = int(self.slot_of_row[row])
        self.slot_of_row[row] = -1
        if slot < 0:
            return
        self.slot_users[slot] -= 1
        if self.slot_users[slot] == 0:
            self.free_order[slot] = None  # most recently released last

    def begin_forward(self, rows: np.ndarray, counts: np.ndarray | None) -> None:
        """The next forward runs `counts` [B] tokens of batch rows `rows` [B] (None: one each, a decode step)."""
        slots = self.slot_of_row[rows]  # [B]
        if (slots < 0).all():
            self.context.step = None
            return
        token_slots = slots if counts is None else np.repeat(slots, counts)  # [T]
        self.context.step = lora_step(token_slots, self.device)

    def _slot_of(self, lora_int_id: int) -> int | None:
        try:
            return self.slot_ids.index(lora_int_id)
        except ValueError:
            return None

    def _evict(self) -> int:
        """A slot no running request holds: an empty one, else the least recently released."""
        assert self.free_order, "more adapters running than slots (the scheduler caps them at --max-loras)"
        empty = [s for s in self.free_order if self.slot_ids[s] is None]
        slot = empty[0] if empty else next(iter(self.free_order))
        self.free_order.pop(slot)
        return slot

    def _image(self, lora: LoRARequest) -> AdapterImage:
        image = self.host.pop(lora.lora_int_id, None)
        if image is None:
            image = self.reader.take(lora)
        self.host[lora.lora_int_id] = image
        while len(self.host) > self.max_cpu_loras:
            self.host.popitem(last=False)
        return image

    def _read(self, lora: LoRARequest) -> AdapterImage:
        """From disk, checked; this rank's share with tensor parallelism, laid out as the slots hold it (runs on
        the reader thread)."""
        weights = read_adapter(lora.lora_path, self.shapes, self.max_lora_rank, self.dtype)
        return adapter_image(self.wrapped, weights if self.layout is None else shard_adapter(weights, self.layout))

    def check_integrity(self, rows: list[int]) -> None:
        """`rows`: the batch rows in use. Each slot's user count is the rows on it; unheld slots are free."""
        slots = self.slot_of_row[rows]
        for slot, users in enumerate(self.slot_users):
            assert users == int((slots == slot).sum()), f"LoRA slot {slot}'s user count is off"
            assert (users == 0) == (slot in self.free_order), f"LoRA slot {slot} held and free"
        assert (self.slot_of_row[np.setdiff1d(np.arange(len(self.slot_of_row)), rows)] == -1).all()
