"""The checks every config section's `validate` runs: an error names the CLI flag that sets the value."""

from __future__ import annotations

import dataclasses
from typing import Any


def check(is_ok: bool, flag: str, message: str) -> None:
    """ValueError('--flag: message') unless `is_ok`: a config error names the CLI flag that sets it."""
    if not is_ok:
        raise ValueError(f"--{flag}: {message}")


def check_min(flag: str, value: float | None, minimum: float) -> None:
    """`value` (None: unset, allowed) is at least `minimum`."""
    check(value is None or value >= minimum, flag, f"must be >= {minimum}, got {value}")


def check_choice(flag: str, value: Any, choices: tuple[Any, ...]) -> None:
    check(value in choices, flag, f"must be one of {', '.join(map(str, choices))}; got {value!r}")


def check_field_choices(config) -> None:
    """Each set field of a config dataclass whose metadata lists `choices` (the CLI's too) holds one of them:
    the list is written once, beside the field."""
    for f in dataclasses.fields(config):
        value, choices = getattr(config, f.name), f.metadata.get("choices")
        if choices is not None and value is not None:
            check_choice(f.metadata.get("flag", f.name.replace("_", "-")), value, tuple(choices))


_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 10**6, "mb": 10**6, "mib": 2**20,
          "g": 10**9, "gb": 10**9, "gib": 2**30, "t": 10**12, "tb": 10**12, "tib": 2**40}


def parse_bytes(text: str, flag: str | None = None) -> int:
    """'4GiB' -> 4294967296; '512MB' -> 512000000; '1000' -> 1000. `flag`: named in the error."""
    s = text.strip().lower().replace("_", "")
    num = s.rstrip("abcdefghijklmnopqrstuvwxyz ")
    unit = s[len(num):].strip()
    try:
        if unit in _UNITS:
            return int(float(num) * _UNITS[unit])
    except ValueError:
        pass
    prefix = f"--{flag}: " if flag else ""
    raise ValueError(f"{prefix}cannot parse a byte size from {text!r} (examples: 4GiB, 512MB)")
