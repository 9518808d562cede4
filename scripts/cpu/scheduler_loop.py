"""The scheduler alone, no model: `schedule` + `update_from_output` over 256 decoding requests (issue 15).

Times the two calls per step with warm caches (inside the engine the forward evicts them first, so the
same calls cost 1.5-2x there: docs/benchmarks.md, issue 15 round 5). Prints the best of five runs.

usage: python scripts/cpu/scheduler_loop.py [--rows 256] [--no-caching]
"""

from __future__ import annotations

import argparse
import random
import time

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.request import Request
from llmserve.core.sched_output import ModelRunnerOutput
from llmserve.core.scheduler import Scheduler
from llmserve.sampling_params import SamplingParams


def run(num_rows: int, is_caching: bool) -> tuple[float, float, int]:
    """Mean microseconds of schedule and of update_from_output per step, and the number of steps."""
    rng = random.Random(0)
    sched = Scheduler(SchedulerConfig(max_num_seqs=num_rows, max_num_batched_tokens=512, async_scheduling=False),
                      CacheConfig(block_size=16, enable_prefix_caching=is_caching), num_rows * 20, 2048)
    for i in range(num_rows):
        max_tokens = rng.randint(128, 256)
        prompt = [rng.randrange(1000) for _ in range(rng.randint(16, 64))]
        sched.add_request(Request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), [0], 0.0,
                                  max_tokens, is_final_only=True))
    schedule_s = update_s = 0.0
    num_steps = 0
    while sched.has_unfinished_requests():
        t0 = time.perf_counter()
        out = sched.schedule()
        t1 = time.perf_counter()
        req_ids = list(out.num_scheduled_tokens)
        sampled = [[7] if sched.requests[r].num_computed_tokens >= sched.requests[r].num_tokens else []
                   for r in req_ids]
        runner_out = ModelRunnerOutput(req_ids, sampled)
        t2 = time.perf_counter()
        sched.update_from_output(out, runner_out)
        update_s += time.perf_counter() - t2
        schedule_s += t1 - t0
        num_steps += 1
    sched.check_integrity()
    return 1e6 * schedule_s / num_steps, 1e6 * update_s / num_steps, num_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--no-caching", action="store_true")
    args = parser.parse_args()
    schedule_us, update_us, num_steps = min(run(args.rows, not args.no_caching) for _ in range(5))
    print(f"schedule {schedule_us:.1f} us  update_from_output {update_us:.1f} us  ({num_steps} steps)")


if __name__ == "__main__":
    main()
