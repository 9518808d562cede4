"""The step broadcast of a tensor-parallel engine: rank 0 publishes each step's SchedulerOutput to the
other ranks over one ZMQ XPUB socket (loopback TCP), msgpack-encoded with msgspec, never pickle.

Each message is two frames `[kind byte, payload]`:
  EXECUTE StepMessage (run the step) | DROP list[str] (forget finished requests) | SHUTDOWN
  | READ_ADAPTER LoRARequest (rank 0 started reading an adapter: read this rank's share now, off the loop)

The structured-output grammar of a step stays on rank 0, the only rank that samples. XPUB tells rank
0 when a rank has subscribed, so no step is published before every rank listens (ZMQ's slow joiner).
Ranks wait for messages outside any collective: an idle engine never runs into a collective timeout.
"""

from __future__ import annotations

import enum
import os
import time
from collections.abc import Callable

import msgspec
import zmq

from llmserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from llmserve.lora_request import LoRARequest

POLL_MS = 500  # how often a waiting rank checks that the engine (its parent) is alive


class StepKind(enum.IntEnum):
    EXECUTE = 0
    DROP = 1
    SHUTDOWN = 2
    READ_ADAPTER = 3


class StepMessage(msgspec.Struct, array_like=True, omit_defaults=True):
    """A SchedulerOutput without its grammar (see the module doc)."""

    new_reqs: list[NewRequestData] = []
    cached_reqs: list[CachedRequestData] = []
    num_scheduled_tokens: dict[str, int] = {}  # in row order (msgpack maps keep it)
    total_num_scheduled_tokens: int = 0
    finished_req_ids: list[str] = []
    num_steps: int = 1


_ENCODER = msgspec.msgpack.Encoder()
_DECODERS = {StepKind.EXECUTE: msgspec.msgpack.Decoder(StepMessage), StepKind.DROP: msgspec.msgpack.Decoder(list[str]),
             StepKind.SHUTDOWN: msgspec.msgpack.Decoder(), StepKind.READ_ADAPTER: msgspec.msgpack.Decoder(LoRARequest)}


def step_message(sched_out: SchedulerOutput) -> StepMessage:
    return StepMessage(sched_out.new_reqs, sched_out.cached_reqs, sched_out.num_scheduled_tokens,
                       sched_out.total_num_scheduled_tokens, list(sched_out.finished_req_ids), sched_out.num_steps)


def scheduler_output(msg: StepMessage) -> SchedulerOutput:
    return SchedulerOutput(msg.new_reqs, msg.cached_reqs, msg.num_scheduled_tokens, msg.total_num_scheduled_tokens,
                           set(msg.finished_req_ids), num_steps=msg.num_steps)


class StepPublisher:
    """Rank 0's end: bound to a free loopback port (`address`)."""

    def __init__(self, ctx: zmq.Context) -> None:
        self.sock = ctx.socket(zmq.XPUB)
        self.sock.setsockopt(zmq.XPUB_VERBOSE, 1)  # every rank's subscription, not only the first of a topic
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind("tcp://127.0.0.1:*")
        self.address: str = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)

    def wait_for_subscribers(self, num: int, deadline: float, check: Callable[[], None]) -> None:
        """Until `num` ranks subscribed; `check` raises when a rank died meanwhile; TimeoutError after deadline."""
        while num > 0:
            check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{num} tensor-parallel rank(s) did not subscribe to the step broadcast")
            if self.sock.poll(100) and self.sock.recv()[:1] == b"\x01":
                num -= 1

    def execute(self, sched_out: SchedulerOutput) -> None:
        self.sock.send_multipart([bytes((StepKind.EXECUTE,)), _ENCODER.encode(step_message(sched_out))])

    def drop(self, req_ids: set[str]) -> None:
        self.sock.send_multipart([bytes((StepKind.DROP,)), _ENCODER.encode(list(req_ids))])

    def shutdown(self) -> None:
        self.sock.send_multipart([bytes((StepKind.SHUTDOWN,)), _ENCODER.encode(None)])

    def read_adapter(self, lora: LoRARequest) -> None:
        self.sock.send_multipart([bytes((StepKind.READ_ADAPTER,)), _ENCODER.encode(lora)])

    def close(self) -> None:
        self.sock.close(linger=0)


class StepSubscriber:
    """A rank's end: the next message, or SHUTDOWN when the engine process (its parent) is gone."""

    def __init__(self, ctx: zmq.Context, address: str, parent_pid: int) -> None:
        self.sock = ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.RCVHWM, 0)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.connect(address)
        self.parent_pid = parent_pid

    def receive(self) -> tuple[StepKind, object]:
        while not self.sock.poll(POLL_MS):
            if os.getppid() != self.parent_pid:
                return StepKind.SHUTDOWN, None
        kind_frame, payload = self.sock.recv_multipart()
        kind = StepKind(kind_frame[0])
        return kind, _DECODERS[kind].decode(payload)

    def close(self) -> None:
        self.sock.close(linger=0)
