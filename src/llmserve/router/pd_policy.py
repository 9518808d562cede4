"""Where a prefill/decode request's prompt is computed: at a prefill server, or on the decode server chosen for
it. One decision for both P/D front ends, `llmserve route --pd-disaggregation` (router/pd.py) and the Ray
Serve P/D ingress (rayserve/pd_ingress.py), each giving it the prompt's length and what it has in flight.

The rules, first match wins (docs/disaggregation.md):
- `max_local_prefill_length` N (Dynamo's conditional disaggregation): a prompt of at most N tokens is computed on
  the decode server, always (it costs a decode step little, and a prefill server's queue would cost its TTFT).
- `max_local_prefill_length_if_busy` N: a prompt of at most N tokens is computed on the decode server when every
  prefill server is computing a longer prompt (it would wait behind that prompt's chunks); a longer prompt
  never goes to a decode server by this rule, so streams there stall for at most a short prompt's prefill.
- `prefill_on_idle_decode`: a decode server with nothing in flight computes any prompt while every prefill
  server has one in flight (no stream there to stall; work conserving).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PrefillPlace(enum.Enum):
    PREFILL_SERVER = "prefill_server"
    LOCAL_SHORT = "local_short"  # max_local_prefill_length
    LOCAL_BESIDE_LONG = "local_beside_long"  # max_local_prefill_length_if_busy
    IDLE_DECODE = "idle_decode"  # prefill_on_idle_decode

    @property
    def is_local(self) -> bool:
        return self is not PrefillPlace.PREFILL_SERVER


@dataclass(frozen=True)
class PDPolicy:
    max_local_prefill_length: int = 0  # 0: off
    max_local_prefill_length_if_busy: int = 0  # 0: off
    prefill_on_idle_decode: bool = False

    def __post_init__(self) -> None:
        for name in ("max_local_prefill_length", "max_local_prefill_length_if_busy"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{name.replace('_', '-')}: must be >= 0, got {getattr(self, name)}")

    @property
    def needs_prompt_length(self) -> bool:
        """Whether a decision reads the prompt's length (a /tokenize call for a text prompt)."""
        return self.max_local_prefill_length > 0 or self.max_local_prefill_length_if_busy > 0

    def is_long(self, prompt_length: int | None) -> bool:
        """A prompt that, in flight at a prefill server, makes a shorter one wait (unknown length: long)."""
        return prompt_length is None or prompt_length > self.max_local_prefill_length_if_busy


@dataclass(frozen=True)
class PDLoad:
    """What the front end has in flight, as it counts it."""

    num_decode_in_flight: int  # at the decode server chosen for the request
    num_prefill_servers: int
    num_busy_prefill_servers: int  # with at least one prompt in flight
    num_long_busy_prefill_servers: int  # with a long prompt in flight (PDPolicy.is_long)

    def __post_init__(self) -> None:
        assert 0 <= self.num_long_busy_prefill_servers <= self.num_busy_prefill_servers <= self.num_prefill_servers


def place_prefill(policy: PDPolicy, prompt_length: int | None, load: PDLoad) -> PrefillPlace:
    """Where to compute a prompt of `prompt_length` tokens (None: unknown, e.g. a batch of prompts)."""
    is_known = prompt_length is not None
    if is_known and 0 < policy.max_local_prefill_length and prompt_length <= policy.max_local_prefill_length:
        return PrefillPlace.LOCAL_SHORT
    if (is_known and 0 < policy.max_local_prefill_length_if_busy
            and prompt_length <= policy.max_local_prefill_length_if_busy
            and load.num_long_busy_prefill_servers == load.num_prefill_servers):
        return PrefillPlace.LOCAL_BESIDE_LONG
    if (policy.prefill_on_idle_decode and load.num_decode_in_flight == 0
            and load.num_busy_prefill_servers == load.num_prefill_servers):
        return PrefillPlace.IDLE_DECODE
    return PrefillPlace.PREFILL_SERVER


def prompt_length_query(body: dict) -> int | dict | None:
    """The prompt's length when the body gives token ids; else the `POST /tokenize` body that counts it (a
    text prompt, or chat messages); None when it has no single prompt (a batch of prompts)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        return len(prompt)
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if prompt is None and isinstance(body.get("messages"), list):
        return {"messages": body["messages"]}
    return None
