"""Random add / abort / finish / preempt sequences never leak or double-own a block."""

from hypothesis import given, settings
from hypothesis import strategies as st

from llmserve.core.kv_cache_groups import kv_cache_layout

from core_helpers import EOS, make_request, make_scheduler, step

actions = st.lists(
    st.one_of(
        st.tuples(st.just("add"), st.integers(1, 40), st.integers(1, 12), st.integers(0, 3)),
        st.tuples(st.just("abort"), st.integers(0, 30)),
        st.tuples(st.just("step"), st.sampled_from([7, EOS])),
    ),
    max_size=60,
)


# each KV cache group's window: full attention, a sliding-only model, and full and sliding groups mixed
GROUP_WINDOWS = [(0,), (0,), (5,), (9,), (0, 5), (5, 0, 5)]


@settings(max_examples=150, deadline=None)
# 13 blocks = the null block + 12 x 4 tokens: one max_model_len sequence always fits, as the engine ensures.
@given(actions=actions, caching=st.booleans(), policy=st.sampled_from(["fcfs", "priority"]),
       num_blocks=st.integers(13, 40), n=st.integers(1, 3), windows=st.sampled_from(GROUP_WINDOWS))
def test_blocks_all_free_after_everything_ends(actions, caching, policy, num_blocks, n, windows):
    # from the fewest the engine takes (one max_model_len sequence in every group: a sliding one holds its window
    # and a chunk) up, by block positions of every group
    num_fewest = kv_cache_layout(windows).blocks_per_sequence(48, 4, 24) + 1
    num_blocks = num_fewest + (num_blocks - 13) * len(windows)
    sched = make_scheduler(num_blocks=num_blocks, block_size=4, budget=24, max_num_seqs=6, caching=caching,
                           policy=policy, max_model_len=48, group_windows=windows)
    num_added = 0
    for action in actions:
        if action[0] == "add":
            _, prompt_len, max_tokens, priority = action
            prompt = [1 + (num_added * 7 + i) % 5 for i in range(prompt_len)]  # shared prefixes happen
            for i in range(n):
                sched.add_request(make_request(f"r{num_added}#{i}", prompt, max_tokens=max_tokens, priority=priority,
                                               arrival=num_added, parent_id=f"r{num_added}" if n > 1 else None))
            num_added += 1
        elif action[0] == "abort":
            sched.abort_requests([f"r{action[1]}#{i}" for i in range(n)])
        else:
            step(sched, token=action[1])
        sched.check_integrity()
    for _ in range(500):
        if not sched.has_unfinished_requests():
            break
        step(sched)
        sched.check_integrity()
    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.get_num_free_blocks() == sched.kv.pool.num_usable_blocks
    assert not sched.kv.req_to_blocks


@settings(max_examples=100, deadline=None)
@given(actions=actions, kind=st.sampled_from(["ngram", "draft"]), num_blocks=st.integers(16, 40),
       cap=st.sampled_from([None, 3]), seed=st.integers(0, 1000), windows=st.sampled_from(GROUP_WINDOWS))
def test_blocks_all_free_with_speculation_rejections_and_prefill_cap(actions, kind, num_blocks, cap, seed, windows):
    """Drafts of random length, accepted up to a random point, with aborts and preemptions (and a sliding
    window: rejected drafts never need a block given back)."""
    import random

    from llmserve.config import CacheConfig, SchedulerConfig, SpeculativeConfig
    from llmserve.core.scheduler import Scheduler

    rng = random.Random(seed)
    spec = SpeculativeConfig(speculative=kind, num_speculative_tokens=3, speculative_max_batch=3,
                             draft_model="d" if kind == "draft" else None)
    num_blocks = (num_blocks - 1) * len(windows) + 1  # as many block positions in every KV cache group
    sched = Scheduler(SchedulerConfig(max_num_batched_tokens=24, max_num_seqs=6, max_prefill_tokens_while_decoding=cap),
                      CacheConfig(block_size=4), num_blocks, 48, spec, group_windows=windows)
    num_added = 0
    for action in [*actions, *[("step", 7)] * 300]:
        if action[0] == "add":
            prompt = [1 + (num_added * 7 + i) % 5 for i in range(min(action[1], 40))]
            sched.add_request(make_request(f"r{num_added}#0", prompt, max_tokens=action[2], arrival=num_added))
            num_added += 1
        elif action[0] == "abort":
            sched.abort_requests([f"r{action[1]}#0"])
        elif sched.has_unfinished_requests():
            _spec_step(sched, rng, action[1])
        sched.check_integrity()
    assert not sched.has_unfinished_requests()
    assert sched.kv.pool.get_num_free_blocks() == sched.kv.pool.num_usable_blocks


def _spec_step(sched, rng, token: int) -> None:
    from llmserve.core.sched_output import ModelRunnerOutput

    out = sched.schedule()
    req_ids = list(out.num_scheduled_tokens)
    sampled, proposals, accepted = [], [], []
    for req_id in req_ids:
        request = sched.requests[req_id]
        drafts = out.scheduled_spec_tokens.get(req_id, [])
        is_caught_up = request.num_computed_tokens >= request.num_tokens + len(drafts)
        num_accepted = rng.randint(0, len(drafts))
        sampled.append(drafts[:num_accepted] + [token] if is_caught_up else [])
        proposals.append([7] * rng.randint(0, 3) if is_caught_up else [])
        accepted.append(num_accepted if is_caught_up else 0)
    sched.update_from_output(out, ModelRunnerOutput(req_ids, sampled, spec_token_ids=proposals, num_accepted=accepted))
