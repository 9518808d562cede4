"""SSE decoding and parsing of OpenAI completions and chat chunks."""

import json

import pytest

from llmserve.bench.sse import ProtocolError, SSEDecoder, parse_chunk


def _feed_all(decoder, parts):
    return [event for part in parts for event in decoder.feed(part)] + decoder.close()


def test_events_split_anywhere():
    stream = b'data: {"a": 1}\n\n: ping\n\nevent: x\nid: 3\ndata: {"b": 2}\n\ndata: [DONE]\n\n'
    whole = _feed_all(SSEDecoder(), [stream])
    assert whole == ['{"a": 1}', '{"b": 2}', "[DONE]"]
    for size in (1, 2, 3, 7):
        parts = [stream[i:i + size] for i in range(0, len(stream), size)]
        assert _feed_all(SSEDecoder(), parts) == whole


def test_line_endings_and_multiline_data():
    assert _feed_all(SSEDecoder(), [b"data: a\r\ndata: b\r\n\r\ndata:c\r\rdata: d\n\n"]) == ["a\nb", "c", "d"]
    # a CRLF split between two reads is one line end, not two
    assert _feed_all(SSEDecoder(), [b"data: x\r", b"\n", b"data: y\r\n\r\n"]) == ["x\ny"]


def test_utf8_split_and_unterminated_last_event():
    raw = 'data: {"text": "héllo"}'.encode()
    cut = raw.index("é".encode()) + 1
    assert _feed_all(SSEDecoder(), [raw[:cut], raw[cut:]]) == ['{"text": "héllo"}']


def test_unicode_line_separators_inside_the_json_are_not_line_ends():
    """JSON may carry U+2028, U+2029 and U+0085 raw (vLLM sends them so); only CR and LF end SSE lines."""
    raw = 'data: {"text": "a\u2028b\u2029c\x85d"}'.encode()
    assert _feed_all(SSEDecoder(), [raw + b"\n\n"]) == [raw[len(b"data: "):].decode()]
    assert _feed_all(SSEDecoder(), [raw]) == [raw[len(b"data: "):].decode()]  # the last event, unterminated


def test_completions_chunk():
    chunk = parse_chunk(json.dumps({"object": "text_completion",
                                    "choices": [{"index": 0, "text": " the", "finish_reason": None}]}))
    assert chunk.text == " the" and chunk.usage is None and chunk.error is None


def test_chat_chunks():
    role = parse_chunk('{"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]}')
    assert role.text == ""
    content = parse_chunk('{"object": "chat.completion.chunk", "choices": [{"delta": {"content": "Hi"}}]}')
    assert content.text == "Hi"
    reasoning = parse_chunk('{"choices": [{"delta": {"reasoning_content": "hmm"}}]}')
    assert reasoning.text == "hmm"
    whole = parse_chunk('{"choices": [{"message": {"role": "assistant", "content": "full"}}], '
                        '"usage": {"prompt_tokens": 3, "completion_tokens": 2}}')
    assert whole.text == "full" and whole.usage.num_completion_tokens == 2


def test_usage_chunk_and_error_object():
    usage = parse_chunk('{"choices": [], "usage": {"prompt_tokens": 7, "completion_tokens": 9, "total_tokens": 16}}')
    assert usage.text == "" and (usage.usage.num_prompt_tokens, usage.usage.num_completion_tokens) == (7, 9)
    err = parse_chunk('{"error": {"message": "out of memory", "code": 500}}')
    assert err.error == "out of memory"


@pytest.mark.parametrize("data", ["not json", "[1, 2]", '{"id": "x"}'])
def test_protocol_errors(data):
    with pytest.raises(ProtocolError):
        parse_chunk(data)
