"""Concurrent partial prefills: short prompts share the budget beside a long prompt's chunks, at most
max_long_partial_prefills long prompts prefill at once, and long chunks stop at the threshold (vLLM's flags)."""

from __future__ import annotations

import re

import pytest

from llmserve.cli import build_parser
from llmserve.config import CacheConfig, EngineConfig, SchedulerConfig, engine_config_from_args
from llmserve.core.partial_prefills import PartialPrefillLimits
from llmserve.core.scheduler import Scheduler

from core_helpers import make_request, step


def make_scheduler(budget: int = 32, max_num: int = 1, max_long: int = 1, threshold: int = 0,
                   max_model_len: int = 512) -> Scheduler:
    config = SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=budget, max_num_partial_prefills=max_num,
                             max_long_partial_prefills=max_long, long_prefill_token_threshold=threshold)
    config.validate()
    return Scheduler(config, CacheConfig(block_size=4), 256, max_model_len)


def prompt(length: int, first: int) -> list[int]:
    return list(range(first, first + length))


def start_long(sched: Scheduler, req_id: str = "long", length: int = 200) -> None:
    """A long prompt alone in the scheduler, past its first chunk."""
    sched.add_request(make_request(req_id, prompt(length, 1000), max_tokens=2))
    step(sched)


def test_off_by_default_a_running_long_prompt_takes_the_budget_and_a_short_one_waits():
    sched = make_scheduler()
    start_long(sched)
    sched.add_request(make_request("short", prompt(8, 1), max_tokens=2))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 32}
    sched.check_integrity()


def test_prompts_share_the_budget_beside_a_running_long_prompt():
    sched = make_scheduler(budget=32, max_num=2, threshold=100)
    start_long(sched)
    sched.add_request(make_request("short", prompt(24, 1), max_tokens=2))
    out, _ = step(sched)  # two prompts prefill: 32 // 2 tokens each at most
    assert out.num_scheduled_tokens == {"long": 16, "short": 16}
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 16, "short": 8}
    out, _ = step(sched)  # short has its first token; long, alone in prefill, takes the whole budget again
    assert out.num_scheduled_tokens == {"long": 32}
    sched.check_integrity()


def test_a_long_prompt_alone_takes_the_whole_budget_when_its_share_is_the_budget():
    sched = make_scheduler(budget=32, max_num=4, threshold=100)
    sched.add_request(make_request("long", prompt(200, 1000), max_tokens=2))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 32}


def test_the_threshold_caps_a_long_prompts_chunk_and_leaves_the_rest_to_others():
    sched = make_scheduler(budget=32, threshold=10)  # vLLM v1's cap, with one partial prefill
    start_long(sched)
    assert sched.requests["long"].num_computed_tokens == 10
    sched.add_request(make_request("short", prompt(8, 1), max_tokens=2))
    out, _ = step(sched)
    assert out.num_scheduled_tokens == {"long": 10, "short": 8}
    sched.check_integrity()


def test_a_waiting_long_prompt_is_passed_over_while_the_long_ones_run_and_keeps_its_place():
    sched = make_scheduler(budget=32, max_num=3, max_long=1, threshold=50)
    start_long(sched, "long1")
    sched.add_request(make_request("long2", prompt(100, 2000), max_tokens=2, arrival=1))
    sched.add_request(make_request("short", prompt(8, 1), max_tokens=2, arrival=2))
    out, _ = step(sched)  # long1 and short prefill (2 schedulable: long2 is not counted), long2 waits
    assert out.num_scheduled_tokens == {"long1": 16, "short": 8}
    assert [r.request_id for r in sched.waiting] == ["long2"]
    sched.check_integrity()


def test_a_second_long_prompt_starts_when_max_long_partial_prefills_allows():
    sched = make_scheduler(budget=32, max_num=3, max_long=2, threshold=50)
    start_long(sched, "long1")
    sched.add_request(make_request("long2", prompt(100, 2000), max_tokens=2, arrival=1))
    sched.add_request(make_request("short", prompt(8, 1), max_tokens=2, arrival=2))
    out, _ = step(sched)  # three share the budget: 10 tokens each at most
    assert out.num_scheduled_tokens == {"long1": 10, "long2": 10, "short": 8}
    sched.check_integrity()


def test_mixed_prompts_all_finish_with_every_token_and_the_blocks_come_back():
    sched = make_scheduler(budget=24, max_num=2, max_long=1, threshold=30)
    lengths = {"a": 120, "b": 90, "c": 5, "d": 12, "e": 70, "f": 3}
    for i, (req_id, length) in enumerate(lengths.items()):
        sched.add_request(make_request(req_id, prompt(length, 100 * i + 1), max_tokens=3, arrival=i))
    num_tokens: dict[str, int] = {}
    for _ in range(200):
        _, res = step(sched)
        for o in res.outputs:
            num_tokens[o.request_id] = num_tokens.get(o.request_id, 0) + len(o.new_token_ids)
        sched.check_integrity()
        if not sched.has_unfinished_requests():
            break
    assert num_tokens == dict.fromkeys(lengths, 3)
    assert sched.kv.pool.get_num_free_blocks() == sched.kv.pool.num_usable_blocks


def test_vllms_default_threshold_is_4_percent_of_the_context_with_partial_prefills_on():
    assert PartialPrefillLimits.resolve(2, 1, 0, 1000).long_prefill_token_threshold == 40
    assert PartialPrefillLimits.resolve(2, 1, 64, 1000).long_prefill_token_threshold == 64
    assert not PartialPrefillLimits.resolve(1, 1, 0, 1000).is_enabled


BAD_VALUES = [
    ({"max_num_partial_prefills": 0}, "max-num-partial-prefills"),
    ({"max_long_partial_prefills": 0}, "max-long-partial-prefills"),
    ({"max_num_partial_prefills": 2, "max_long_partial_prefills": 3}, "max-long-partial-prefills"),
    ({"long_prefill_token_threshold": -1}, "long-prefill-token-threshold"),
    ({"max_num_partial_prefills": 2, "enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
     "max-num-partial-prefills"),
    ({"long_prefill_token_threshold": 64, "enable_chunked_prefill": False, "max_num_batched_tokens": 4096},
     "long-prefill-token-threshold"),
]


@pytest.mark.parametrize("values, flag", BAD_VALUES, ids=[c[1] + str(c[0]) for c in BAD_VALUES])
def test_a_bad_value_is_refused_naming_its_flag(values, flag):
    with pytest.raises(ValueError, match="^" + re.escape(f"--{flag}:")):
        EngineConfig(scheduler=SchedulerConfig(**values)).validate()


def test_the_serve_flags_carry_vllms_names():
    args = build_parser().parse_args(["serve", "m", "--max-num-partial-prefills", "4", "--max-long-partial-prefills",
                                      "2", "--long-prefill-token-threshold", "1024"])
    sched = engine_config_from_args(args).scheduler
    assert (sched.max_num_partial_prefills, sched.max_long_partial_prefills, sched.long_prefill_token_threshold) \
        == (4, 2, 1024)


def test_an_engine_with_partial_prefills_gives_the_same_greedy_tokens(tmp_path):
    from llmserve import LLM, SamplingParams
    from llmserve.testing.maker import make_model

    path = make_model("qwen3", "tiny", str(tmp_path), seed=3)
    prompts = [[(7 * i + j) % 400 + 3 for j in range(n)] for i, n in enumerate([150, 9, 120, 14, 5, 60])]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outputs = []
    for flags in ({}, {"max_num_partial_prefills": 3, "max_long_partial_prefills": 1,
                       "long_prefill_token_threshold": 32}):
        llm = LLM(path, dtype="float32", max_model_len=512, num_kv_blocks=80, max_num_batched_tokens=64, **flags)
        outputs.append([o.outputs[0].token_ids for o in llm.generate(prompts, params)])
        llm.engine.check_integrity()
    assert outputs[0] == outputs[1] and all(len(ids) == 6 for ids in outputs[0])
