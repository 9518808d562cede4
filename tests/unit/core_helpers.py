"""Builders for core tests: requests and a scripted 'model' that samples fixed tokens."""

from __future__ import annotations

from llmserve.config import CacheConfig, SchedulerConfig
from llmserve.core.request import Request
from llmserve.core.sched_output import ModelRunnerOutput, SchedulerOutput
from llmserve.core.scheduler import Scheduler
from llmserve.sampling_params import SamplingParams

EOS = 0


def make_request(req_id: str, prompt: list[int], max_tokens: int = 4, priority: int = 0, arrival: float = 0.0,
                 parent_id: str | None = None, **params) -> Request:
    sp = SamplingParams(max_tokens=max_tokens, **params)
    return Request(req_id, prompt, sp, [EOS], arrival, max_tokens, priority, parent_id)


def make_scheduler(num_blocks: int = 64, block_size: int = 4, budget: int = 32, max_num_seqs: int = 16,
                   caching: bool = True, policy: str = "fcfs", max_model_len: int = 256,
                   group_windows: tuple[int, ...] = (0,)) -> Scheduler:
    return Scheduler(SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy),
                     CacheConfig(block_size=block_size, enable_prefix_caching=caching), num_blocks, max_model_len,
                     group_windows=group_windows)


def fake_runner_output(sched: Scheduler, out: SchedulerOutput, token: int = 7) -> ModelRunnerOutput:
    """Sample `token` for every request whose computed tokens caught up with its tokens."""
    req_ids = list(out.num_scheduled_tokens)
    sampled = []
    for req_id in req_ids:
        request = sched.requests[req_id]
        sampled.append([token] if request.num_computed_tokens >= request.num_tokens else [])
    return ModelRunnerOutput(req_ids, sampled)


def step(sched: Scheduler, token: int = 7):
    out = sched.schedule()
    return out, sched.update_from_output(out, fake_runner_output(sched, out, token))


def ids(kv, request) -> list[int]:
    """A request's block ids in a KVCacheManager."""
    return kv.get_block_ids(request.request_id)


def advance(kv, request, num_tokens: int) -> None:
    """Computes `num_tokens` more; one that reaches the last known token samples the next (token 7)."""
    assert kv.allocate_slots(request, num_tokens) is not None
    request.num_computed_tokens += num_tokens
    if request.num_computed_tokens == request.num_tokens:
        request.append_output_token(7)


def run_with_an_abort(sched: Scheduler, requests: list, abort_at: int, abort_id: str) -> None:
    """Steps `requests` to their end, aborting `abort_id` after step `abort_at`, checking the bookkeeping after
    every step; then every block is free again and some request was preempted."""
    for request in requests:
        sched.add_request(request)
    num_steps = 0
    while sched.has_unfinished_requests():
        step(sched)
        num_steps += 1
        if num_steps == abort_at:
            sched.abort_requests([abort_id])
        sched.check_integrity()
        assert num_steps < 500
    assert sum(r.num_preemptions for r in requests) > 0
    assert sched.kv.pool.get_num_free_blocks() == sched.kv.pool.num_usable_blocks
    assert not sched.kv.req_to_blocks and not sched.kv.window_starts
