"""The adapters a server serves by name (--lora-modules, then POST /v1/load_lora_adapter): each name maps
to a LoRARequest with an id of its own, checked against the base model before any request can name it."""

from __future__ import annotations

import json
import os

from collections.abc import Callable

from llmserve.http.errors import APIError
from llmserve.lora_request import LoRARequest
from llmserve.model.lora_adapter import AdapterError, BaseShapes, base_shapes, check_adapter


class LoRARegistry:
    def __init__(self, is_enabled: bool, max_rank: int, base_path: str, reserved_names: tuple[str, ...],
                 on_count: Callable[[int], None] = lambda num: None) -> None:
        """base_path: the base model's directory (its config.json gives the shapes adapters must fit);
        reserved_names: the base model's own names, which no adapter may take; on_count: told the number of
        adapters after each change (the metrics gauge)."""
        self.on_count = on_count
        self.is_enabled = is_enabled
        self.max_rank = max_rank
        self.reserved_names = reserved_names
        self.shapes = _read_shapes(base_path) if is_enabled else None
        self.adapters: dict[str, LoRARequest] = {}
        self.next_id = 1

    def add(self, name: str, path: str) -> LoRARequest:
        """Check the adapter at `path` and serve it as `name`; 400 for a bad adapter or a name in use."""
        if not self.is_enabled:
            raise APIError(400, "LoRA adapters are not enabled on this server (start it with --enable-lora)",
                           param="lora_name")
        if not name or name in self.reserved_names or name in self.adapters:
            raise APIError(400, f"The lora adapter name {name!r} is empty, the base model's, or already loaded.",
                           param="lora_name")
        try:
            check_adapter(path, self.shapes, self.max_rank)
        except AdapterError as e:
            raise APIError(400, str(e), param="lora_path") from None
        lora = self.adapters[name] = LoRARequest(name, self.next_id, os.path.abspath(path))
        self.next_id += 1
        self.on_count(len(self.adapters))
        return lora

    def remove(self, name: str) -> None:
        """Stop serving `name` (requests running with it finish with it); 404 when no adapter has it."""
        if self.adapters.pop(name, None) is None:
            raise APIError(404, f"The lora adapter {name!r} cannot be found.", param="lora_name",
                           code="model_not_found")
        self.on_count(len(self.adapters))

    def get(self, name: str | None) -> LoRARequest | None:
        return None if name is None else self.adapters.get(name)


def _read_shapes(base_path: str) -> BaseShapes | None:
    """The base's projection shapes, None where config.json cannot tell them (the worker still checks)."""
    try:
        with open(os.path.join(base_path, "config.json")) as f:
            return base_shapes(json.load(f))
    except (OSError, ValueError, TypeError):
        return None
