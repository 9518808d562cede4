"""--reasoning-parser qwen3 on a real server: thoughts apart from the answer (chat's reasoning_content, streamed
or not; the Responses API's reasoning item), and chat_template_kwargs / reasoning_effort reaching the template
or refused. The tiny random model's text is held to a thought-then-answer shape by a regex (structured
outputs, applied to the thoughts too), so what the parser sees is known. Without that setting a grammar waits
for the end of the thoughts."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from llmserve.testing.servers import ServerProcess, start_tiny_server

THOUGHT_THEN_ANSWER = {"structured_outputs": {"regex": "<think>[a-z]{1,8}</think>\n\n(yes|no)"}}
MESSAGES = [{"role": "user", "content": "Is it?"}]
# the regexes above script the whole output, thoughts included: the grammar must apply to the thoughts too
IN_REASONING = ("--structured-outputs-config", '{"enable_in_reasoning": true}')


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_tiny_server(str(tmp_path_factory.mktemp("thinking")), "--served-model-name", "tiny",
                               "--reasoning-parser", "qwen3", *IN_REASONING)
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def test_chat_returns_the_thought_apart_from_the_answer(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40,
                                         extra_body=THOUGHT_THEN_ANSWER)
    message = out.choices[0].message
    assert message.content in ("yes", "no") and out.choices[0].finish_reason == "stop"
    thought = message.model_extra["reasoning_content"]
    assert thought.isalpha() and thought.islower() and 1 <= len(thought) <= 8


def test_a_stream_sends_the_thought_then_the_answer(client):
    whole = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, seed=3,
                                           extra_body=THOUGHT_THEN_ANSWER)
    chunks = list(client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=40, seed=3,
                                                 stream=True, extra_body=THOUGHT_THEN_ANSWER))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    thought = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    answer = "".join(d.content or "" for d in deltas)
    assert (thought, answer) == (whole.choices[0].message.model_extra["reasoning_content"],
                                 whole.choices[0].message.content)
    first_answer = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not d.model_extra.get("reasoning_content") for d in deltas[first_answer:])


def test_an_answer_without_thoughts_has_no_reasoning(client):
    out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=8,
                                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert out.choices[0].message.content in ("yes", "no")
    assert out.choices[0].message.model_extra["reasoning_content"] is None


def test_chat_template_kwargs_reach_the_template(client):
    """The demo template's Qwen3 switch: enable_thinking false appends an empty thought to the prompt."""
    def prompt_tokens(**body) -> int:
        out = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=1, extra_body=body)
        return out.usage.prompt_tokens

    extra = prompt_tokens(chat_template_kwargs={"enable_thinking": False}) - prompt_tokens()
    assert 0 < extra <= len("<think>\n\n</think>\n\n")
    assert prompt_tokens(chat_template_kwargs={"enable_thinking": True}) == prompt_tokens()


@pytest.mark.parametrize("body, param", [({"chat_template_kwargs": {"thinking_budget": 3}},
                                          "chat_template_kwargs.thinking_budget"),
                                         ({"reasoning_effort": "low"}, "reasoning_effort"),
                                         ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools")])
def test_what_the_template_does_not_read_is_refused(server, body, param):
    response = httpx.post(f"{server.url}/v1/chat/completions", json={"messages": MESSAGES, **body}, timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_responses_give_a_reasoning_item_before_the_message(client):
    out = client.responses.create(model="tiny", input="Is it?", max_output_tokens=40,
                                  extra_body=THOUGHT_THEN_ANSWER)
    reasoning, message = out.output
    assert reasoning.type == "reasoning" and message.type == "message"
    assert reasoning.content[0].text.isalpha() and out.output_text in ("yes", "no")
    with client.responses.stream(model="tiny", input="Is it?", max_output_tokens=40,
                                 extra_body=THOUGHT_THEN_ANSWER) as stream:
        events = list(stream)
        final = stream.get_final_response()
    thought = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    assert [i.type for i in final.output] == ["reasoning", "message"] and thought == final.output[0].content[0].text


HARMONY = {"structured_outputs": {"regex": r"<\|channel\|>analysis<\|message\|>[a-z]{1,8}<\|end\|>"
                                           r"<\|start\|>assistant<\|channel\|>final<\|message\|>(yes|no)<\|return\|>"}}


@pytest.fixture(scope="module")
def harmony_client(tmp_path_factory):
    """--reasoning-parser gpt_oss (the tiny model's tokenizer has no harmony special tokens: its markers are
    plain text here, which the regex holds the output to, ending as gpt-oss's answers end, <|return|>)."""
    server = start_tiny_server(str(tmp_path_factory.mktemp("harmony")), "--served-model-name", "tiny",
                               "--reasoning-parser", "gpt_oss", "--tool-call-parser", "openai", *IN_REASONING,
                               "--max-model-len", "1024")  # the tools in the prompt, the markers spelt out
    yield openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    assert server.stop() == 0


def test_gpt_oss_returns_the_analysis_channel_apart_from_the_final_one(harmony_client):
    out = harmony_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120, extra_body=HARMONY)
    message = out.choices[0].message
    assert message.content in ("yes", "no")
    thought = message.model_extra["reasoning_content"]
    assert thought.isalpha() and thought.islower() and 1 <= len(thought) <= 8
    chunks = list(harmony_client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=120,
                                                         stream=True, extra_body=HARMONY))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) in ("yes", "no")
    assert "".join(d.model_extra.get("reasoning_content") or "" for d in deltas).isalpha()


HARMONY_CALL = {"structured_outputs": {"regex": (
    r"<\|channel\|>analysis<\|message\|>[a-z]{1,8}<\|end\|>"
    r"<\|start\|>assistant<\|channel\|>commentary to=functions\.get_weather "
    r"<\|constrain\|>json<\|message\|>\{\"city\": \"(Paris|Rome)\"\}<\|call\|>")}}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def test_gpt_oss_calls_a_function_through_the_commentary_channel(harmony_client):
    """--tool-call-parser openai beside --reasoning-parser gpt_oss: a message to functions.get_weather is a tool
    call (the analysis channel the reasoning), whole and streamed."""
    kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=300, tools=[WEATHER_TOOL], extra_body=HARMONY_CALL)
    out = harmony_client.chat.completions.create(**kwargs)
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments)["city"] in ("Paris", "Rome")
    assert choice.message.model_extra["reasoning_content"].isalpha()
    chunks = list(harmony_client.chat.completions.create(stream=True, **kwargs))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert calls[0].function.name == "get_weather" and calls[0].id
    assert json.loads("".join(tc.function.arguments or "" for tc in calls))["city"] in ("Paris", "Rome")
    assert not "".join(d.content or "" for d in deltas)
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["tool_calls"]


ANSWER_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}}}


def test_a_grammar_waits_for_the_end_of_the_thoughts(tmp_path_factory):
    """vLLM's rule: with a reasoning parser the grammar starts after </think>. Thinking on, the random model never
    closes its thought, so its text stays free (no JSON); enable_thinking false closes the thought in the prompt,
    so the grammar holds from the first token."""
    server = start_tiny_server(str(tmp_path_factory.mktemp("gated")), "--served-model-name", "tiny",
                               "--reasoning-parser", "qwen3")
    try:
        client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
        kwargs = dict(model="tiny", messages=MESSAGES, max_tokens=24, temperature=0, response_format=ANSWER_SCHEMA)
        free = client.chat.completions.create(**kwargs).choices[0]
        assert free.finish_reason == "length"
        with pytest.raises(ValueError):
            json.loads(free.message.content)
        off = {"chat_template_kwargs": {"enable_thinking": False}}
        answer = client.chat.completions.create(**kwargs, extra_body=off).choices[0]
        assert answer.finish_reason == "stop" and json.loads(answer.message.content)["answer"] in ("yes", "no")
    finally:
        assert server.stop() == 0


def test_gpt_oss_function_calls_reach_the_responses_api(harmony_client):
    tool = {"type": "function", "name": "get_weather", "parameters": WEATHER_TOOL["function"]["parameters"]}
    kwargs = dict(model="tiny", input="Weather?", max_output_tokens=300, tools=[tool], extra_body=HARMONY_CALL)
    out = harmony_client.responses.create(**kwargs)
    reasoning, call = out.output
    assert reasoning.type == "reasoning" and call.type == "function_call" and call.name == "get_weather"
    assert json.loads(call.arguments)["city"] in ("Paris", "Rome")
    with harmony_client.responses.stream(**kwargs) as stream:
        list(stream)
        final = stream.get_final_response()
    assert [item.type for item in final.output] == ["reasoning", "function_call"]
