"""Protocol decoding, request -> SamplingParams, error shapes, delta merging and stream plumbing (no server)."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from llmserve.engine.async_llm import RequestOutputCollector, merge_outputs
from llmserve.http.errors import APIError
from llmserve.outputs import CompletionOutput, RequestOutput
from llmserve.sampling_params import SamplingParams
from llmserve.server.errors import error_payload, to_api_error
from llmserve.server.params import chat_overrides, completion_overrides
from llmserve.server.protocol import (IGNORED_FIELDS, ChatCompletionRequest, CompletionRequest, TokenizeRequest,
                                      decode_json)
from llmserve.server.serving_common import chat_conversation
from llmserve.server.serving_tgi import TGIParameters, tgi_finish_reason, tgi_overrides
from llmserve.server.streams import logged_stream, merge_async_iterators, sse_event, with_error_event


def completion(body: dict) -> CompletionRequest:
    return decode_json(json.dumps(body).encode(), CompletionRequest)


def chat(body: dict) -> ChatCompletionRequest:
    return decode_json(json.dumps({"messages": [{"role": "user", "content": "x"}], **body}).encode(),
                       ChatCompletionRequest)


@pytest.mark.parametrize("raw", [b"", b"{", b"[]", b'"x"', b'{"prompt": NaN}', b'{"temperature": 1e999}',
                                 b'{"max_tokens": "3"}', b'{"n": true}', b'{"max_tokens": 1.5}'])
def test_bad_bodies_are_400(raw):
    with pytest.raises(ValueError) as e:
        decode_json(raw, CompletionRequest)
    assert to_api_error(e.value).status == 400


def test_validation_error_names_the_field():
    with pytest.raises(msgspec.ValidationError) as e:
        decode_json(b'{"max_tokens": "3"}', CompletionRequest)
    err = to_api_error(e.value)
    assert err.param == "max_tokens" and "max_tokens" in err.message


UNIMPLEMENTED = ["use_beam_search", "allowed_token_ids", "bad_words", "prompt_embeds", "truncate_prompt_tokens",
                 "guided_json_object", "no_such_field"]


@pytest.mark.parametrize("cls", [CompletionRequest, ChatCompletionRequest, TokenizeRequest])
@pytest.mark.parametrize("name", UNIMPLEMENTED)
def test_unknown_fields_are_refused_by_name(cls, name):
    with pytest.raises(msgspec.ValidationError) as e:
        decode_json(json.dumps({name: 1}).encode(), cls)
    err = to_api_error(e.value)
    assert (err.status, err.param, err.code) == (400, name, "unsupported_parameter")
    assert f"`{name}`" in err.message


def test_nested_unknown_field_names_its_path():
    with pytest.raises(msgspec.ValidationError) as e:
        decode_json(b'{"stream_options": {"include_usage": true, "extra": 1}}', CompletionRequest)
    assert to_api_error(e.value).param == "stream_options.extra"


def test_ignored_fields_are_accepted():
    body = {"user": "u1", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
            "prompt_cache_key": "c", "safety_identifier": "s"}
    assert set(body) == set(IGNORED_FIELDS)
    assert completion({"prompt": "x", **body}).user == "u1"
    assert chat(body).metadata == {"k": "v"}


def test_prompt_forms():
    assert completion({"prompt": "a"}).prompt == "a"
    assert completion({"prompt": ["a", "b"]}).prompt == ["a", "b"]
    assert completion({"prompt": [1, 2]}).prompt == [1, 2]
    assert completion({"prompt": [[1], [2, 3]]}).prompt == [[1], [2, 3]]


def test_completion_overrides():
    o = completion_overrides(completion({"prompt": "x", "stop": "END", "logit_bias": {"5": 1.5}, "top_k": 3}))
    assert o["stop"] == ["END"] and o["logit_bias"] == {5: 1.5} and o["top_k"] == 3 and o["max_tokens"] == 16
    assert "temperature" not in o  # unset fields leave the model's defaults in place
    SamplingParams(**o)  # a valid set


def test_echo_with_logprobs_scores_the_prompt():
    assert completion_overrides(completion({"prompt": "x", "echo": True, "logprobs": 3}))["prompt_logprobs"] == 3
    assert completion_overrides(completion({"prompt": "x", "prompt_logprobs": 2}))["prompt_logprobs"] == 2
    assert "prompt_logprobs" not in completion_overrides(completion({"prompt": "x", "logprobs": 3}))
    # echo without logprobs beside prompt_logprobs (found by the fuzz test: it raised, a 500)
    assert completion_overrides(completion({"prompt": "x", "echo": True, "prompt_logprobs": 0}))["prompt_logprobs"] == 0
    with pytest.raises(msgspec.ValidationError):
        decode_json(b'{"prompt_logprobs": 1, "messages": []}', ChatCompletionRequest)  # completions only


@pytest.mark.parametrize("body, word", [({"suffix": "y"}, "suffix"),
                                        ({"best_of": 3}, "best_of"), ({"logit_bias": {"a": 1}}, "logit_bias"),
                                        ({"stream_options": {"include_usage": True}}, "stream_options")])
def test_completion_rejects(body, word):
    with pytest.raises(ValueError, match=word):
        completion_overrides(completion({"prompt": "x", **body}))


def test_chat_overrides():
    o = chat_overrides(chat({"max_completion_tokens": 7, "max_tokens": 3, "logprobs": True, "top_logprobs": 2}))
    assert o["max_tokens"] == 7 and o["logprobs"] == 2
    assert chat_overrides(chat({}))["max_tokens"] is None and chat_overrides(chat({}))["logprobs"] is None
    assert chat_overrides(chat({"response_format": {"type": "text"}, "tool_choice": "none"}))


@pytest.mark.parametrize("body, word", [({"top_logprobs": 2}, "logprobs"),
                                        ({"response_format": {"type": "json_schema", "json_schema": {
                                            "name": "x", "schema": {"type": "nope"}}}}, "response_format"),
                                        ({"logprobs": True, "top_logprobs": 99}, "top_logprobs"),
                                        ({"function_call": "auto"}, "function")])
def test_chat_rejects(body, word):
    with pytest.raises(ValueError, match=word):
        chat_overrides(chat(body))


def test_chat_conversation():
    req = decode_json(json.dumps({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None}]}).encode(), ChatCompletionRequest)
    assert chat_conversation(req.messages) == [{"role": "system", "content": "be brief"},
                                               {"role": "user", "content": "ab"},
                                               {"role": "assistant", "content": ""}]
    with pytest.raises(ValueError, match="non-empty"):
        chat_conversation([])


def test_tgi_overrides_greedy_unless_sampling():
    assert tgi_overrides(TGIParameters())["temperature"] == 0.0
    assert tgi_overrides(TGIParameters(max_new_tokens=5))["max_tokens"] == 5
    assert "temperature" not in tgi_overrides(TGIParameters(do_sample=True))
    assert tgi_overrides(TGIParameters(temperature=0.5))["temperature"] == 0.5
    with pytest.raises(ValueError, match="grammar"):
        tgi_overrides(msgspec.convert({"grammar": {"type": "regex", "value": "a("}}, TGIParameters))


def test_tgi_finish_reason():
    assert tgi_finish_reason(CompletionOutput(0, finish_reason="length"), [2]) == "length"
    assert tgi_finish_reason(CompletionOutput(0, finish_reason="stop", stop_reason=2), [2]) == "eos_token"
    assert tgi_finish_reason(CompletionOutput(0, finish_reason="stop", stop_reason="END"), [2]) == "stop_sequence"


def test_error_payload_shape():
    body = json.loads(error_payload(APIError(404, "no such model", param="model", code="model_not_found")))
    assert body == {"error": {"message": "no such model", "type": "invalid_request_error", "param": "model",
                              "code": "model_not_found"}}
    internal = json.loads(error_payload(KeyError("secret internals")))["error"]
    assert internal["code"] == "internal_error" and "secret" not in internal["message"]


def out(text: str, ids: list[int], finish: str | None = None, index: int = 0, done: bool = False) -> RequestOutput:
    return RequestOutput("r", None, [1], [CompletionOutput(index, text, ids, None, finish)], done)


def test_merge_outputs():
    merged = merge_outputs(out("a", [1]), out("b", [2], "length", done=True))
    assert merged.outputs[0].text == "ab" and merged.outputs[0].token_ids == [1, 2]
    assert merged.finished and merged.outputs[0].finish_reason == "length"
    two = merge_outputs(out("a", [1], index=1), out("b", [2], index=0))
    assert [c.index for c in two.outputs] == [0, 1]


def test_collector_merges_while_reader_is_slow():
    async def main():
        collector = RequestOutputCollector()
        collector.put(out("a", [1]))
        collector.put(out("b", [2], done=True))
        first = await collector.get()
        collector.fail(RuntimeError("dead"))
        with pytest.raises(RuntimeError):
            await collector.get()
        return first

    first = asyncio.run(main())
    assert first.outputs[0].text == "ab" and first.finished


def test_sse_framing_and_error_event(caplog):
    assert sse_event({"a": 1}) == b'data: {"a":1}\n\n'
    text = "x\u2028y\x85z\u2029\u00e9\u20ac"  # str.splitlines (httpx's aiter_lines) breaks at the first three
    line = sse_event({"text": text}).decode()
    assert len(line.strip().splitlines()) == 1 and json.loads(line[len("data: "):]) == {"text": text}

    async def failing():
        yield b"data: 1\n\n"
        raise ValueError("bad thing")

    async def main():
        return [e async for e in with_error_event(failing(), "r1")]

    events = asyncio.run(main())
    assert events[0] == b"data: 1\n\n" and events[-1] == b"data: [DONE]\n\n"
    assert json.loads(events[1][6:])["error"]["message"] == "bad thing"
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        ("WARNING", "stream r1 ended early with an error event: bad thing")]


@pytest.mark.parametrize(("is_shutting_down", "level", "reason"),
                         [(False, "INFO", "the client disconnected"), (True, "WARNING", "the server is shutting down")])
def test_a_stream_cut_short_is_logged_with_its_request_id_and_why(caplog, is_shutting_down, level, reason):
    caplog.set_level("INFO", logger="llmserve.server")

    async def endless():
        while True:
            yield b"data: x\n\n"

    async def main():
        stream = logged_stream(endless(), "cmpl-7", lambda: is_shutting_down)
        assert [await stream.__anext__() for _ in range(3)] == [b"data: x\n\n"] * 3
        await stream.aclose()  # what Starlette's cancellation or the generator's finalizer does

    asyncio.run(main())
    assert [(r.levelname, r.getMessage()) for r in caplog.records] == [
        (level, f"stream cmpl-7 cut short after 3 events: {reason}")]


def test_merge_async_iterators_closes_inputs():
    closed = []

    async def numbers(tag: str, n: int):
        try:
            for i in range(n):
                yield f"{tag}{i}"
                await asyncio.sleep(0)
        finally:
            closed.append(tag)

    async def main():
        items = [item async for item in merge_async_iterators([numbers("a", 3), numbers("b", 2)])]
        merged = merge_async_iterators([numbers("c", 100), numbers("d", 100)])
        await merged.__anext__()
        await merged.aclose()
        return items

    items = asyncio.run(main())
    assert sorted(items) == [(0, "a0"), (0, "a1"), (0, "a2"), (1, "b0"), (1, "b1")]
    assert sorted(closed) == ["a", "b", "c", "d"]
