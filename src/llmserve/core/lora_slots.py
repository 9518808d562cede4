"""Which waiting requests may start while LoRA adapters hold the runner's slots.

A request starts only while its adapter runs already or a slot is left (`max_loras` adapters at once), so a
slot is always free for the step. One whose adapter waits for a slot keeps its place at the head of the
queue while requests of running adapters (and of the base model) go past; after LORA_PASS_LIMIT went past
(aging), the adapters' requests wait behind it until a running adapter drains and frees its slot.
A request whose adapter is read from disk waits likewise, its slot kept, until the read ends.
"""

from __future__ import annotations

from typing import Protocol

from llmserve.core.request import Request
from llmserve.lora_request import LoRARequest

LORA_PASS_LIMIT = 16


class AdapterMemory(Protocol):
    """The runner's adapters in memory (worker/lora_manager.py)."""

    def is_in_memory(self, lora: LoRARequest) -> bool:
        """Whether the adapter is in a slot or host memory; if not, its read from disk starts in the
        background and this is asked again in a later step."""


def running_adapters(running: list[Request], max_loras: int) -> set[int]:
    """The adapter ids the running requests hold slots for (empty with LoRA off)."""
    return {r.lora.lora_int_id for r in running if r.lora is not None} if max_loras else set()


def is_held_behind(request: Request, set_aside: list[Request]) -> bool:
    """An adapter's request waits behind the first one set aside for a slot once that one was passed
    LORA_PASS_LIMIT times (base-model requests hold no slot and still go past)."""
    return bool(set_aside) and request.lora is not None and set_aside[0].num_lora_passes >= LORA_PASS_LIMIT


def take_lora_slot(request: Request, adapters: set[int], max_loras: int) -> bool:
    """Whether the request's adapter runs already or a slot is left for it (then it takes it: `adapters`
    grows)."""
    if request.lora is None or request.lora.lora_int_id in adapters:
        return True
    if len(adapters) >= max_loras:
        return False
    adapters.add(request.lora.lora_int_id)
    return True


def has_adapter_in_memory(request: Request, memory: AdapterMemory | None) -> bool:
    """Whether the request may start as far as its adapter's weights go (base-model requests always may)."""
    return request.lora is None or memory is None or memory.is_in_memory(request.lora)
