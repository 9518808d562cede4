"""The front's output processor: how a streamed request's tokens are grouped into outputs."""

import pytest
from transformers import PreTrainedTokenizerFast

from llmserve.messages import EngineCoreOutput, FinishReason
from llmserve.engine.output_processor import OutputProcessor
from llmserve.testing.toy_tokenizer import build_tokenizer
from llmserve.sampling_params import SamplingParams


class Mailbox:
    def __init__(self) -> None:
        self.outputs = []

    def put(self, output) -> None:
        self.outputs.append(output)


@pytest.fixture(scope="module")
def tokenizer():
    return PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(300))


def stream(tokenizer, stream_interval: int, num_tokens: int, n: int = 1) -> list:
    """Feed one token per step to each of n sequences; the request's outputs, in order."""
    processor = OutputProcessor(tokenizer, stream_interval)
    mailbox = Mailbox()
    processor.add_request("r", None, [5, 6], SamplingParams(n=n, max_tokens=num_tokens), mailbox, is_delta=True)
    engine_ids = list(processor.requests["r"].sequences)
    for step in range(num_tokens):
        finish = FinishReason.LENGTH if step == num_tokens - 1 else None
        processor.process_outputs([EngineCoreOutput(eid, [40 + step], finish_reason=finish) for eid in engine_ids])
    assert not processor.has_unfinished_requests()
    return mailbox.outputs


@pytest.mark.parametrize(("stream_interval", "sizes"), [(1, [1] * 8), (3, [1, 3, 3, 1]), (8, [1, 7]), (20, [1, 7])])
def test_first_token_at_once_then_every_interval_tokens_then_the_end(tokenizer, stream_interval, sizes):
    outputs = stream(tokenizer, stream_interval, 8)
    assert [len(o.outputs[0].token_ids) for o in outputs] == sizes
    assert [t for o in outputs for t in o.outputs[0].token_ids] == list(range(40, 48))
    assert [o.finished for o in outputs] == [False] * (len(sizes) - 1) + [True]
    assert outputs[-1].outputs[0].finish_reason == "length"


def test_every_sequence_of_n_is_grouped_the_same_way(tokenizer):
    outputs = stream(tokenizer, 4, 6, n=2)
    assert [[len(c.token_ids) for c in o.outputs] for o in outputs] == [[1, 1], [4, 4], [1, 1]]


def test_offline_text_decoded_at_the_end_equals_the_streamed_text(tokenizer):
    """An offline request without stop strings decodes its text once, when it finishes: the same text
    as token-by-token decoding gives (random ids, byte tokens that split UTF-8 characters included)."""
    import random

    rng = random.Random(0)
    for trial in range(20):
        ids = [rng.randrange(3, 300) for _ in range(rng.randint(1, 40))]
        texts = []
        for collector in (Mailbox(), None):
            processor = OutputProcessor(tokenizer)
            processor.add_request("r", None, [5, 6], SamplingParams(max_tokens=len(ids)), collector)
            assert processor.requests["r"].is_text_deferred == (collector is None)
            results = []
            for i, token_id in enumerate(ids):
                finish = FinishReason.LENGTH if i == len(ids) - 1 else None
                results += processor.process_outputs([EngineCoreOutput("r", [token_id], finish_reason=finish)]).request_outputs
            final = collector.outputs[-1] if collector is not None else results[-1]
            assert final.finished and final.outputs[0].token_ids == ids
            texts.append(final.outputs[0].text)
        assert texts[0] == texts[1], trial


@pytest.mark.parametrize("include", [False, True])
@pytest.mark.parametrize("num_per_step", [1, 3])  # a step may bring the stop token with others (speculation)
def test_a_streamed_sequence_that_the_core_stopped_leaves_out_its_stop_tokens_text(tokenizer, include,
                                                                                   num_per_step):
    eos = tokenizer.convert_tokens_to_ids("<|im_end|>")
    ids = [40, 41, 1, 42, 43, eos]  # 1 is <|im_start|>: a special token the model wrote stays
    processor = OutputProcessor(tokenizer)
    mailbox = Mailbox()
    params = SamplingParams(max_tokens=20, skip_special_tokens=False, include_stop_str_in_output=include)
    processor.add_request("r", None, [5, 6], params, mailbox, is_delta=True)
    for start in range(0, len(ids), num_per_step):
        step = ids[start:start + num_per_step]
        finish = FinishReason.STOP if start + num_per_step >= len(ids) else None
        processor.process_outputs([EngineCoreOutput("r", step, finish_reason=finish)])
    text = "".join(o.outputs[0].text for o in mailbox.outputs)
    assert [t for o in mailbox.outputs for t in o.outputs[0].token_ids] == ids
    expected = tokenizer.decode(ids[:-1], skip_special_tokens=False)
    assert "<|im_start|>" in expected
    assert text == (expected + "<|im_end|>" if include else expected)
