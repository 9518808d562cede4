"""OpenAI's Responses API (POST /v1/responses, GET /v1/responses/{id}) with the real `openai` client: text and
items, instructions, a stored conversation continued by previous_response_id, function tools, text.format,
the typed stream events in order, and refusals naming the field."""

from __future__ import annotations

import json
from typing import Literal

import httpx
import openai
import pydantic
import pytest

NAME = "tiny"
WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"enum": ["Paris", "Oslo"]}},
                          "required": ["city"], "additionalProperties": False}}
NAMED = {"type": "function", "name": "get_weather"}


class Verdict(pydantic.BaseModel):
    answer: Literal["yes", "no"]
    sure: bool


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=60) as http:
        yield http


def prompt_tokens(http: httpx.Client, messages: list[dict]) -> int:
    return len(http.post("/tokenize", json={"messages": messages}).json()["tokens"])


def test_text_in_text_out_with_usage_and_retrieve(client, http):
    out = client.responses.create(model=NAME, input="Hello", instructions="Be brief", max_output_tokens=6)
    assert out.object == "response" and out.status in ("completed", "incomplete") and out.model == NAME
    assert out.output[0].type == "message" and isinstance(out.output_text, str)
    messages = [{"role": "system", "content": "Be brief"}, {"role": "user", "content": "Hello"}]
    assert out.usage.input_tokens == prompt_tokens(http, messages) and 1 <= out.usage.output_tokens <= 6
    if out.status == "incomplete":
        assert out.incomplete_details.reason == "max_output_tokens" and out.usage.output_tokens == 6
    assert client.responses.retrieve(out.id).output_text == out.output_text


def test_previous_response_id_continues_the_conversation_without_its_instructions(client, http):
    first = client.responses.create(model=NAME, input="Hi", instructions="Be brief", max_output_tokens=4)
    second = client.responses.create(model=NAME, input=[{"role": "user", "content": "More"}],
                                     previous_response_id=first.id, max_output_tokens=4)
    history = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": first.output_text},
               {"role": "user", "content": "More"}]
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens == prompt_tokens(http, history)


def test_text_format_parses_into_a_model(client):
    out = client.responses.parse(model=NAME, input="Is it?", text_format=Verdict, max_output_tokens=64)
    assert out.status == "completed" and isinstance(out.output_parsed, Verdict)


def test_a_named_function_call_then_its_output(client):
    call = client.responses.create(model=NAME, input="Weather in Paris?", tools=[WEATHER], tool_choice=NAMED,
                                   max_output_tokens=64)
    (item,) = [i for i in call.output if i.type == "function_call"]
    assert item.name == "get_weather" and json.loads(item.arguments)["city"] in ("Paris", "Oslo")
    assert item.call_id.startswith("call_")
    answer = client.responses.create(model=NAME, previous_response_id=call.id, tools=[WEATHER],
                                     input=[{"type": "function_call_output", "call_id": item.call_id,
                                             "output": "sunny"}], max_output_tokens=4)
    assert answer.output[0].type == "message" and answer.usage.input_tokens > call.usage.input_tokens


def test_items_sent_back_by_the_client_make_the_same_prompt_as_previous_response_id(client):
    call = client.responses.create(model=NAME, input="Weather?", tools=[WEATHER], tool_choice=NAMED,
                                   max_output_tokens=64, store=False)
    (item,) = call.output
    items = [{"role": "user", "content": "Weather?"}, item.model_dump(exclude_none=True),
             {"type": "function_call_output", "call_id": item.call_id, "output": "sunny"}]
    answer = client.responses.create(model=NAME, input=items, tools=[WEATHER], max_output_tokens=2)
    assert answer.status in ("completed", "incomplete")
    with pytest.raises(openai.NotFoundError):  # store false: nothing kept
        client.responses.retrieve(call.id)


def test_stream_events_in_order_and_the_final_response(client):
    with client.responses.stream(model=NAME, input="Is it?", text_format=Verdict, max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text and isinstance(final.output_parsed, Verdict)


def test_a_streamed_function_call(client):
    with client.responses.stream(model=NAME, input="Weather?", tools=[WEATHER], tool_choice=NAMED,
                                 max_output_tokens=64) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    (item,) = final.output
    assert item.type == "function_call" and deltas == done.arguments == item.arguments
    assert json.loads(item.arguments)["city"] in ("Paris", "Oslo")


@pytest.mark.parametrize("body, status, param", [
    ({"input": "x", "reasoning": {"effort": "low"}}, 400, "reasoning.effort"),  # the template reads none
    ({"input": "x", "reasoning": {"summary": "auto"}}, 400, "reasoning.summary"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, 400,
     "input[0].content[0].type"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, 400, "input[0].type"),
    ({"input": "x", "tools": [{"type": "web_search", "name": "w"}]}, 400, "tools[0].type"),
    ({"input": "x", "previous_response_id": "resp_nope"}, 404, "previous_response_id"),
    ({"input": "x", "background": True}, 400, "background"),
    ({"input": "x", "frequency": 1}, 400, "frequency"),
    # chat's checks, named by the Responses field that set them
    ({"input": []}, 400, "input"),
    ({"input": "x", "tool_choice": "required"}, 400, "tool_choice"),
    ({"input": "x", "tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "function", "name": "g"}},
     400, "tool_choice"),
    ({"input": "x", "logit_bias": {"x": 1}}, 400, "logit_bias"),
    ({"input": "x", "max_output_tokens": 10**7}, 400, "max_output_tokens"),  # past the context
])
def test_what_is_not_built_is_refused_naming_the_field(http, body, status, param):
    response = http.post("/v1/responses", json=body)
    assert response.status_code == status, response.text
    assert response.json()["error"]["param"] == param


def test_an_openai_agents_sdk_agent_runs_its_tool_through_the_server(server):
    """The OpenAI Agents SDK's default path (its Responses model) against our server: a one-tool agent whose
    model must call the tool; the agent runs it and stops on its output."""
    import asyncio

    from agents import Agent, ModelSettings, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)  # no export to OpenAI's tracing service

    @function_tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    client = openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    agent = Agent(name="weather", instructions="Answer with the tool.", tools=[get_weather],
                  model=OpenAIResponsesModel(model=NAME, openai_client=client),
                  model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=200),
                  tool_use_behavior="stop_on_first_tool")
    result = asyncio.run(Runner.run(agent, "Weather in Paris?"))
    assert result.final_output in ("sunny in Paris", "sunny in Oslo")


def test_langchain_chat_openai_on_the_responses_api_calls_a_tool_and_continues(server):
    """langchain-openai's ChatOpenAI(use_responses_api=True): a forced tool call, then the tool's result sent
    back as LangChain sends it (the call and its output as items) for the next turn."""
    from langchain_core.messages import HumanMessage, ToolMessage
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI

    @tool
    def get_weather(city: Literal["Paris", "Oslo"]) -> str:
        """The weather in a city."""
        return f"sunny in {city}"

    llm = ChatOpenAI(model=NAME, base_url=server.base_url, api_key="unused", use_responses_api=True,
                     max_tokens=64, max_retries=0, timeout=60)
    asked = HumanMessage("Weather in Paris?")
    called = llm.bind_tools([get_weather], tool_choice="get_weather", parallel_tool_calls=False).invoke([asked])
    (call,) = called.tool_calls
    assert call["name"] == "get_weather" and call["args"]["city"] in ("Paris", "Oslo")
    answer = llm.bind_tools([get_weather]).invoke([asked, called, ToolMessage(get_weather.invoke(call["args"]),
                                                                              tool_call_id=call["id"])])
    assert isinstance(answer.text, str) and answer.response_metadata["status"] in ("completed", "incomplete")
