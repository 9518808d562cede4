"""Flags whose value is one JSON object (`--speculative-config`, `--pooler-config`): parsed, its keys checked,
ValueError naming the flag and what is wrong."""

from __future__ import annotations

import json


def parse_json_object_flag(flag: str, text: str, keys) -> dict:
    """`text` as a JSON object whose keys are all among `keys`."""
    try:
        settings = json.loads(text)
    except ValueError as e:
        raise ValueError(f"--{flag}: not JSON: {e}") from None
    if not isinstance(settings, dict):
        raise ValueError(f"--{flag}: must be a JSON object")
    for key in settings:
        if key not in keys:
            raise ValueError(f"--{flag}: unsupported key {key!r}; supported: {', '.join(keys)}")
    return settings
