"""LoRA's flags (parsed, validated before loading), the scheduler's cap on adapters running at once, and the
block hashes keyed by adapter."""

from __future__ import annotations

import pytest
from core_helpers import make_request, step
from lora_helpers import make_adapter

from llmserve.config import (CacheConfig, CommandLineParser, EngineConfig, LoRAConfig,
                             SchedulerConfig, add_engine_args, engine_config_from_args)
from llmserve.core.request import Request
from llmserve.core import lora_slots
from llmserve.core.scheduler import Scheduler
from llmserve.lora_request import LoRARequest
from llmserve.testing.maker import make_model
from llmserve.preflight import check_before_loading
from llmserve.sampling_params import SamplingParams


def _parse(*argv: str) -> EngineConfig:
    parser = CommandLineParser(prog="llmserve")
    add_engine_args(parser)
    return engine_config_from_args(parser.parse_args(list(argv)))


def test_the_flags_build_the_lora_config():
    config = _parse("--enable-lora", "--lora-modules", "sql=/a/sql", "chat=/b", "--max-loras", "4",
                    "--max-lora-rank", "64", "--max-cpu-loras", "8")
    assert config.lora == LoRAConfig(True, ("sql=/a/sql", "chat=/b"), 4, 64, 8)
    assert config.lora.modules() == {"sql": "/a/sql", "chat": "/b"}
    assert _parse().lora == LoRAConfig() and LoRAConfig().num_cpu_loras == 1


@pytest.mark.parametrize("lora, flag", [
    (LoRAConfig(lora_modules=("a=/x",)), "--lora-modules: only with --enable-lora"),
    (LoRAConfig(True, ("a",)), "--lora-modules: expected NAME=PATH, got 'a'"),
    (LoRAConfig(True, ("a=/x", "a=/y")), "--lora-modules: an adapter name is given twice"),
    (LoRAConfig(True, max_loras=0), "--max-loras: must be >= 1"),
    (LoRAConfig(True, max_lora_rank=0), "--max-lora-rank: must be >= 1"),
    (LoRAConfig(True, max_loras=4, max_cpu_loras=2), "--max-cpu-loras: must be >= 4"),
])
def test_a_bad_lora_value_names_its_flag(lora, flag):
    with pytest.raises(ValueError, match=flag):
        EngineConfig(lora=lora).validate()


def test_a_bad_adapter_is_refused_before_loading(tmp_path):
    base = make_model("llama", "tiny", str(tmp_path / "base"), seed=1)
    wide = make_adapter(base, str(tmp_path / "wide"), seed=1, rank=32, targets=["q_proj"])
    check_before_loading(_parse(base, "--enable-lora", "--lora-modules", f"ok={wide}", "--max-lora-rank", "64"))
    with pytest.raises(ValueError, match=r"--lora-modules: bad: .* rank r=32 is over --max-lora-rank 16"):
        check_before_loading(_parse(base, "--enable-lora", "--lora-modules", f"bad={wide}"))
    with pytest.raises(ValueError, match="--lora-modules: gone: .* no adapter_config.json"):
        check_before_loading(_parse(base, "--enable-lora", "--lora-modules", f"gone={tmp_path / 'none'}"))


def _lora(i: int) -> LoRARequest:
    return LoRARequest(f"a{i}", i, f"/adapters/{i}")


def test_the_scheduler_runs_at_most_max_loras_adapters_at_once():
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), CacheConfig(block_size=4), 64, 256,
                      max_loras=2)
    loras = [_lora(1), None, _lora(2), _lora(1), _lora(3), None]
    for i, lora in enumerate(loras):
        request = make_request(f"r{i}", [1, 2, 3, 4, 5], max_tokens=2)
        request.lora = lora
        sched.add_request(request)
    out, _ = step(sched)
    # r4 (a third adapter) waits at the head of the queue; r5 (the base model) goes past it
    assert [r.req_id for r in out.new_reqs] == ["r0", "r1", "r2", "r3", "r5"]
    assert [r.lora for r in out.new_reqs] == [*loras[:4], None]
    assert [r.request_id for r in sched.waiting] == ["r4"]
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        if out.new_reqs:
            assert [r.req_id for r in out.new_reqs] == ["r4"]
            assert not any(r.lora and r.lora.lora_int_id in (1, 2) for r in sched.running)
    sched.check_integrity()


def test_a_request_waiting_for_a_slot_is_passed_at_most_the_limit_then_the_running_adapter_drains(monkeypatch):
    monkeypatch.setattr(lora_slots, "LORA_PASS_LIMIT", 2)
    sched = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64), CacheConfig(block_size=4), 64, 256,
                      max_loras=1)

    def add(name: str, lora: LoRARequest | None) -> None:
        request = make_request(name, [1, 2, 3, 4, 5], max_tokens=3)
        request.lora = lora
        sched.add_request(request)

    add("r0", _lora(1))
    add("wait", _lora(2))  # needs the one slot, which a1 holds
    passed, num_steps = [], 0
    while "wait" not in [r.request_id for r in sched.running]:  # steady traffic to a1 (and the base model)
        add(f"a1-{num_steps}", _lora(1))
        add(f"base-{num_steps}", None)
        out, _ = step(sched)
        passed += [r.req_id for r in out.new_reqs if r.lora is not None and r.req_id != "wait"]
        num_steps += 1
        assert num_steps < 20, "the request waiting for a slot starved"
    assert passed == ["r0", "a1-0", "a1-1"]  # r0 took the slot before it; then two went past it
    assert all(r.lora is None or r.lora.lora_int_id == 2 for r in sched.running)
    while sched.has_unfinished_requests():
        step(sched)
    sched.check_integrity()


def test_block_hashes_start_from_the_adapter():
    def hashes(lora):
        request = Request("r", list(range(8)), SamplingParams(max_tokens=4), [0], 0.0, 4, lora=lora)
        return [h.value for h in request.update_block_hashes(4)]

    assert hashes(None) != hashes(_lora(1)) != hashes(_lora(2))
    assert hashes(_lora(1)) == hashes(_lora(1))
