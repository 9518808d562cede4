"""The step broadcast: a SchedulerOutput crosses the XPUB/SUB sockets as msgpack and comes back equal
(row order kept, the grammar left on rank 0), after every subscriber is seen."""

import os
import time

import zmq

from llmserve.core.sched_output import CachedRequestData, NewRequestData, SchedulerOutput
from llmserve.lora_request import LoRARequest
from llmserve.sampling_params import SamplingParams
from llmserve.worker.tp_broadcast import StepKind, StepPublisher, StepSubscriber


def test_a_step_crosses_to_every_subscriber_unchanged():
    ctx = zmq.Context()
    publisher = StepPublisher(ctx)
    subscribers = [StepSubscriber(ctx, publisher.address, os.getppid()) for _ in range(3)]
    try:
        publisher.wait_for_subscribers(3, time.monotonic() + 10, lambda: None)
        new = NewRequestData("b", [1, 2, 3], [], SamplingParams(temperature=0.5, seed=3, logprobs=2), [4, 5], 0, [9])
        step = SchedulerOutput([new], [CachedRequestData("a", [7], 20, 2)], {"b": 3, "a": 1}, 4, {"gone"},
                               grammar=object())
        publisher.execute(step)
        publisher.drop({"x"})
        publisher.read_adapter(LoRARequest("sql", 3, "/adapters/sql"))
        publisher.shutdown()
        for sub in subscribers:
            kind, msg = sub.receive()
            assert kind == StepKind.EXECUTE
            assert msg.new_reqs == [new] and msg.cached_reqs == step.cached_reqs
            assert list(msg.num_scheduled_tokens.items()) == [("b", 3), ("a", 1)]
            assert (msg.total_num_scheduled_tokens, msg.finished_req_ids) == (4, ["gone"])
            assert sub.receive() == (StepKind.DROP, ["x"])
            assert sub.receive() == (StepKind.READ_ADAPTER, LoRARequest("sql", 3, "/adapters/sql"))
            assert sub.receive()[0] == StepKind.SHUTDOWN
    finally:
        for sub in subscribers:
            sub.close()
        publisher.close()
        ctx.term()
