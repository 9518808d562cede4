"""AsyncLLM's output handling: a step's outputs are processed in chunks, with turns of the event loop
between them (other tasks run), and every request still gets all of its outputs in order."""

import asyncio
from types import SimpleNamespace

import pytest
from transformers import PreTrainedTokenizerFast

from llmserve.engine.async_llm import OUTPUT_CHUNK_SIZE, AsyncLLM, output_chunks
from llmserve.messages import EngineCoreOutput, EngineCoreOutputs, FinishReason, SchedulerStats
from llmserve.testing.toy_tokenizer import build_tokenizer
from llmserve.sampling_params import SamplingParams
from llmserve.testing.servers import until

NUM_REQUESTS = 2 * OUTPUT_CHUNK_SIZE + 44


class FakeClient:
    """Takes requests; the test plays the engine by calling `on_outputs`."""

    def __init__(self) -> None:
        self.model_info = SimpleNamespace(vocab_size=300, max_model_len=512, eos_token_ids=[1], pooler=None)
        self.added: list[str] = []
        self.is_dead = False
        self.dead_reason = None
        self.last_output_time = 0.0

    def add_request(self, request) -> None:
        self.added.append(request.request_id)

    def abort_requests(self, request_ids) -> None:
        pass


@pytest.fixture(scope="module")
def tokenizer():
    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(300))


def step(token: int, finish: FinishReason | None = None) -> EngineCoreOutputs:
    outputs = [EngineCoreOutput(f"r{i}", [token], finish_reason=finish) for i in range(NUM_REQUESTS)]
    return EngineCoreOutputs(outputs, SchedulerStats(num_running=NUM_REQUESTS))


def test_output_chunks_keep_order_and_stats_once():
    outputs = step(40)
    chunks = output_chunks(outputs, OUTPUT_CHUNK_SIZE)
    assert [len(c.outputs) for c in chunks] == [OUTPUT_CHUNK_SIZE, OUTPUT_CHUNK_SIZE, 44]
    assert [o for c in chunks for o in c.outputs] == outputs.outputs
    assert chunks[0].stats is outputs.stats and chunks[1].stats is None and chunks[2].stats is None
    assert output_chunks(EngineCoreOutputs([]), OUTPUT_CHUNK_SIZE)[0].outputs == []


def test_a_step_of_many_outputs_yields_to_the_loop_between_chunks(tokenizer):
    async def main():
        client = FakeClient()
        llm = AsyncLLM(client, tokenizer, {})
        params = SamplingParams(max_tokens=2, ignore_eos=True)

        async def collect(i: int) -> list[int]:
            return [t for out in [o async for o in llm.generate([5, 6], params, f"r{i}")]
                    for t in out.outputs[0].token_ids]

        readers = [asyncio.create_task(collect(i)) for i in range(NUM_REQUESTS)]
        await until(lambda: len(client.added) == NUM_REQUESTS, what="every request added")
        seen: list[int] = []  # requests still unfinished, once per turn of the loop
        watcher = asyncio.create_task(watch(lambda: len(llm.output_processor.requests), seen))
        await llm._on_outputs(step(40))
        await llm._on_outputs(step(41, FinishReason.LENGTH))
        tokens = await asyncio.gather(*readers)
        watcher.cancel()
        return seen, tokens

    seen, tokens = asyncio.run(main())
    assert all(t == [40, 41] for t in tokens)
    # The last step finished them all in three chunks, with other tasks running in between.
    assert NUM_REQUESTS - OUTPUT_CHUNK_SIZE in seen and 44 in seen and seen[-1] == 0


async def watch(value, seen: list[int]) -> None:
    while True:
        seen.append(value())
        await asyncio.sleep(0)  # record once per turn of the event loop
