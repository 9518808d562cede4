"""tool_choice "required" and named on a random gpt-oss checkpoint whose harmony markers are special tokens
(llmserve.testing.harmony), served with --reasoning-parser gpt_oss and --tool-call-parser openai: the output is
held to a call in the commentary channel (thoughts first if the model opens the analysis channel), which comes
back as a tool call, on chat completions and the Responses API, whole and streamed.

A random model rarely closes a thought by itself, so <|end|> gets a large logit bias: where the grammar allows
it (in a thought) it comes at once. Argument schemas are bounded so the arguments end within max_tokens.
"""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from llmserve.testing.harmony import make_harmony_model
from llmserve.testing.servers import SMALL_ENGINE_ARGS, ServerProcess

WEATHER_PARAMS = {"type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]},
                                                   "days": {"type": "integer", "minimum": 1, "maximum": 7}},
                  "required": ["city", "days"]}
TIME_PARAMS = {"type": "object", "properties": {"zone": {"type": "string", "maxLength": 4}}, "required": ["zone"]}
PARAMS = {"get_weather": WEATHER_PARAMS, "get_time": TIME_PARAMS}
TOOLS = [{"type": "function", "function": {"name": name, "parameters": schema}} for name, schema in PARAMS.items()]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_time"}}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return make_harmony_model(str(tmp_path_factory.mktemp("gpt-oss-harmony")))


@pytest.fixture(scope="module")
def server(checkpoint):
    with ServerProcess(["--model", checkpoint, *SMALL_ENGINE_ARGS, "--served-model-name", "oss", "--max-model-len",
                        "1024", "--reasoning-parser", "gpt_oss", "--tool-call-parser", "openai"]) as server:
        yield server


@pytest.fixture(scope="module")
def client(server: ServerProcess):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def base(checkpoint) -> dict:
    """The request's common fields: the thought closed as soon as it may be (see the module's docstring)."""
    from transformers import AutoTokenizer

    end_id = AutoTokenizer.from_pretrained(checkpoint).convert_tokens_to_ids("<|end|>")
    return dict(model="oss", messages=MESSAGES, tools=TOOLS, max_tokens=200, logit_bias={str(end_id): 100})


def check_call(name: str, arguments: str, expected: str | None = None) -> None:
    assert name in PARAMS and (expected is None or name == expected)
    jsonschema.validate(json.loads(arguments), PARAMS[name])


def streamed_chat(client, **kwargs) -> tuple[str, list[list[str]], str | None]:
    """Content, calls ([name, arguments]) and finish reason put together from the stream."""
    content, calls, finish = "", {}, None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or ():
                entry = calls.setdefault(delta.index, ["", ""])
                entry[0] += delta.function.name or ""
                entry[1] += delta.function.arguments or ""
            finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("tool_choice, finish_reason", [("required", "tool_calls"), (NAMED, "stop")])
def test_chat_tool_choice_forces_a_commentary_call(client, base, tool_choice, finish_reason):
    """One call (harmony's <|call|> ends the turn), valid arguments, thoughts apart, no content; whole and
    streamed. Named: the named function, finish reason "stop" as OpenAI gives it."""
    named = tool_choice["function"]["name"] if isinstance(tool_choice, dict) else None
    for seed in range(3):
        choice = client.chat.completions.create(**base, tool_choice=tool_choice, seed=seed).choices[0]
        [call] = choice.message.tool_calls
        check_call(call.function.name, call.function.arguments, named)
        assert choice.finish_reason == finish_reason and not choice.message.content
        assert "<|" not in (choice.message.model_extra["reasoning_content"] or "")
        content, calls, finish = streamed_chat(client, **base, tool_choice=tool_choice, seed=seed)
        assert not content and finish == finish_reason and len(calls) == 1
        check_call(*calls[0], named)


def test_without_tool_choice_the_output_is_free(client, base):
    """The same request under "auto" is not held to a call: unconstrained, the bias makes the model write <|end|>
    over and over, which is no message at all."""
    choice = client.chat.completions.create(**base, seed=0).choices[0]
    assert not choice.message.tool_calls and choice.finish_reason == "length"


@pytest.mark.parametrize("tool_choice", ["required", {"type": "function", "name": "get_time"}])
def test_responses_tool_choice_forces_a_commentary_call(client, base, tool_choice):
    named = tool_choice["name"] if isinstance(tool_choice, dict) else None
    tools = [{"type": "function", "name": name, "parameters": schema} for name, schema in PARAMS.items()]
    kwargs = dict(model="oss", input="Weather in Paris?", tools=tools, tool_choice=tool_choice,
                  max_output_tokens=200, extra_body={"logit_bias": base["logit_bias"]})
    out = client.responses.create(**kwargs)
    calls = [item for item in out.output if item.type == "function_call"]
    assert len(calls) == 1 and out.status == "completed"
    assert {item.type for item in out.output} <= {"reasoning", "function_call"}
    check_call(calls[0].name, calls[0].arguments, named)
    with client.responses.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_response()
    [call] = [item for item in final.output if item.type == "function_call"]
    check_call(call.name, call.arguments, named)
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    assert deltas == call.arguments


def test_responses_reasoning_effort_reaches_the_template(client, checkpoint):
    """`reasoning.effort` is the template's reasoning_effort, as chat's field is (this template reads it)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(checkpoint)

    def rendered(**kwargs) -> int:
        text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True, **kwargs)
        return len(tokenizer(text, add_special_tokens=False).input_ids)

    effort = next(e for e in ("minimal", "low", "high") if rendered(reasoning_effort=e) != rendered())  # tells apart
    for reasoning, expected in (({"effort": effort}, rendered(reasoning_effort=effort)), (None, rendered())):
        out = client.responses.create(model="oss", input=MESSAGES[0]["content"], max_output_tokens=1,
                                      reasoning=reasoning)
        assert out.usage.input_tokens == expected
