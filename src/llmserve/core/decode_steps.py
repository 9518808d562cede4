"""Multi-step decoding: one engine step that runs several decode forwards back to back.

Where no request watches its tokens one by one (each reports only its final output), the host work of a
step (scheduling, the bookkeeping of its sampled ids, outputs) need not run after every forward: the
scheduler gives each running request up to `num_scheduler_steps` tokens at once, the runner runs that
many forwards of one token a row (a row drops out after its own count), and `update_from_output` takes
each row's ids in one go. vLLM's V0 engine called this multi-step scheduling. A row that samples a token
it stops on (EOS, a stop id) runs no further forward of the window (worker/multi_step.py). While requests
wait for a free seat a window ends when its first row does; in the engine-core process a request (or an
abort) that arrives meanwhile ends the window after the forward it arrives in.
"""

from __future__ import annotations

from llmserve.core.kv_cache_manager import KVCacheManager, cdiv
from llmserve.core.request import Request


def decode_step_counts(running: list[Request], num_steps: int, kv: KVCacheManager,
                       is_even: bool = False) -> list[int] | None:
    """Per running request the forwards it runs in a multi-step (`num_steps`, or fewer where its
    max_tokens or the context ends sooner; with `is_even` all run as many as the shortest), or None when
    no such step can run now: a row that is not in plain decode (a prompt chunk to go, a token in flight),
    too few free blocks for all of them, or no row with two tokens to go. The caller checks the rest (no
    drafts, grammars or streamed requests)."""
    counts: list[int] = []
    for request in running:
        num_known = len(request.all_token_ids)
        if num_known != request.num_computed_tokens + 1:
            return None
        counts.append(min(num_steps, request.max_num_tokens - num_known))
    if is_even and counts:
        counts = [min(counts)] * len(counts)
    if not counts or max(counts) < 2:
        return None
    num_free = kv.pool.get_num_free_blocks()
    if num_free < len(running) * cdiv(num_steps, kv.block_size) * kv.num_groups:  # the bound does not settle it
        num_free -= sum(kv.num_blocks_to_grow(request, request.num_computed_tokens + num)
                        for request, num in zip(running, counts))
    return counts if num_free >= 0 else None
