"""Which LoRA adapter a request runs with (vLLM's LoRARequest): a wire record, below the front and the core."""

from __future__ import annotations

import msgspec


class LoRARequest(msgspec.Struct, frozen=True, array_like=True):
    """lora_int_id: unique per adapter loaded (a reload under the same name gets a new one), > 0; the worker
    keeps weights and the prefix cache keys blocks by it. lora_path: a PEFT adapter directory."""

    lora_name: str
    lora_int_id: int
    lora_path: str

    def __post_init__(self) -> None:
        if self.lora_int_id < 1:
            raise ValueError(f"lora_int_id must be >= 1, got {self.lora_int_id}")
