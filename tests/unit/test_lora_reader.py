"""An adapter read from disk on the reader thread: its request waits aside while the other requests keep
stepping, then gives transformers + peft's greedy tokens."""

from __future__ import annotations

import threading

import pytest
from hf_parity import random_prompt
from lora_helpers import make_adapter, peft_greedy

from llmserve import LLM, LoRARequest, SamplingParams
from llmserve.core.request import RequestStatus
from llmserve.testing.maker import make_model

NUM_OUT = 6
PARAMS = SamplingParams(temperature=0, max_tokens=NUM_OUT, ignore_eos=True)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-reader")
    base = make_model("llama", "tiny", str(root / "base"), seed=1)
    lora = LoRARequest("held", 1, make_adapter(base, str(root / "a"), seed=5, rank=8))
    prompts = [random_prompt(14, seed=i, vocab_size=512) for i in range(2)]
    return base, lora, prompts


def _gate_reads(llm: LLM) -> tuple[threading.Event, threading.Event]:
    """(started, release): the reader thread sets `started` when an adapter's read begins, then waits for
    the test to set `release`."""
    reader = llm.engine.runner.lora.reader
    started, release, read = threading.Event(), threading.Event(), reader.read

    def held_read(lora):
        started.set()
        assert release.wait(timeout=60), "the test never released the read"
        return read(lora)

    reader.read = held_read
    return started, release


def _step(llm: LLM, tokens: dict[str, list[int]]) -> list[str] | None:
    """One engine step; the adapters resident in slots that its stats report."""
    outputs = llm.engine.step()
    for out in outputs.outputs:
        tokens[out.request_id] += out.new_token_ids
    return None if outputs.stats is None else outputs.stats.resident_loras


@pytest.mark.parametrize("engine_args", [dict(), dict(async_scheduling=True, num_scheduler_steps=1)],
                         ids=["sync", "async-scheduling"])
def test_a_request_waits_for_its_adapters_read_while_others_step(setup, engine_args):
    base, lora, prompts = setup
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4, **engine_args)
    started, release = _gate_reads(llm)
    base_id = llm._add(prompts[0], PARAMS, 0)
    lora_id = llm._add(prompts[1], PARAMS, 0, lora=lora)
    tokens: dict[str, list[int]] = {base_id: [], lora_id: []}
    _step(llm, tokens)  # schedules the base request and starts the adapter's read
    assert started.wait(timeout=60)
    while len(tokens[base_id]) < NUM_OUT:  # the base request runs to its end while the read is held
        assert _step(llm, tokens) in ([], None)
    scheduler = llm.engine.scheduler
    assert tokens[lora_id] == [] and scheduler.requests[lora_id].status == RequestStatus.WAITING
    assert llm.engine.runner.lora.num_loads == 0 and llm.engine.runner.lora.reader.num_reading == 1
    release.set()
    resident = set()
    while llm.engine.has_unfinished_requests():
        resident.update(_step(llm, tokens) or ())
    assert resident == {"held"}  # what the front's metrics and the routers learn
    assert tokens[base_id] == peft_greedy(base, None, prompts[0], NUM_OUT)
    assert tokens[lora_id] == peft_greedy(base, lora.lora_path, prompts[1], NUM_OUT)
    assert llm.engine.runner.lora.reader.reads == {}  # taken into a slot
    llm.engine.check_integrity()


def test_a_failed_read_raises_where_the_slot_is_filled(setup, tmp_path):
    """A read that fails (the adapter's files gone since the front checked them) raises its error as a
    read on the step loop did."""
    base, lora, prompts = setup
    llm = LLM(base, dtype="float32", enable_lora=True, max_lora_rank=8, block_size=4)
    gone = LoRARequest("gone", 2, str(tmp_path / "missing"))
    with pytest.raises(Exception, match="adapter_config.json"):
        llm.generate([prompts[0]], PARAMS, lora_request=gone)


def test_the_reader_tells_of_each_read_it_starts_once():
    """What rank 0's reader tells the other tensor-parallel ranks (worker/tp_executor.py): one word per read
    started, none for an adapter already read or under way."""
    from llmserve.worker.lora_reader import LoRAReader

    release = threading.Event()
    reader = LoRAReader(lambda lora: release.wait(timeout=60) and lora.lora_name, max_kept=4)
    told: list[str] = []
    reader.on_start = lambda lora: told.append(lora.lora_name)
    a, b = LoRARequest("a", 1, "/a"), LoRARequest("b", 2, "/b")
    assert not reader.has_read(a) and not reader.has_read(a) and told == ["a"]
    release.set()
    assert reader.take(a) == "a"
    reader.has_read(b)  # starts b's read
    reader.wait(timeout=60)
    assert reader.has_read(b) and told == ["a", "b"] and reader.take(b) == "b"
