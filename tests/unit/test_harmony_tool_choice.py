"""gpt-oss's tool_choice required / named: the plan picks harmony's commentary call over the JSON forms, the
structural tag it builds accepts exactly such calls (with or without one analysis message first), and outputs
sampled under it, with random logits and the harmony tokenizer, become valid calls whole and streamed."""

from __future__ import annotations

import json

import jsonschema
import pytest

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.server.protocol import ChatCompletionRequest, decode_json
from llmserve.server.reasoning import reasoning_stream, split_reasoning
from llmserve.server.tool_calls import ChoiceStream, plan_tools, response_message
from llmserve.structured.grammar import build_grammar, validate
from llmserve.testing.harmony import HARMONY_EOS, HARMONY_TEMPLATE, make_harmony_model
from llmserve.testing.toy_tokenizer import CHATML_TEMPLATE

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"enum": ["Paris", "Rome"]}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string", "maxLength": 4},
                                     "days": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["zone"]}}}
SCHEMAS = {tool["function"]["name"]: tool["function"]["parameters"] for tool in (WEATHER, TIME)}
NAMED = {"type": "function", "function": {"name": "get_time"}}
CALL = "<|channel|>commentary to=functions.{} <|constrain|>json<|message|>{}<|call|>"
THOUGHT = "<|channel|>analysis<|message|>{}<|end|><|start|>assistant"


def plan(parser: str | None = "openai", template: str = CHATML_TEMPLATE, **body):
    body.setdefault("messages", [{"role": "user", "content": "hi"}])
    body.setdefault("tools", [WEATHER, TIME])
    return plan_tools(decode_json(json.dumps(body).encode(), ChatCompletionRequest), parser, template)


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_harmony_model(str(tmp_path_factory.mktemp("harmony"))))


@pytest.fixture(scope="module")
def compiler(tokenizer):
    import xgrammar as xgr

    stop_ids = tokenizer.convert_tokens_to_ids(list(HARMONY_EOS))
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=stop_ids)
    return xgr.GrammarCompiler(info)


def test_the_openai_parser_turns_required_and_named_into_a_harmony_call():
    for choice in ("required", NAMED):
        for parser, template in (("openai", CHATML_TEMPLATE), (None, HARMONY_TEMPLATE)):  # flag, or template
            p = plan(parser, template, tool_choice=choice)
            constraint = p.structured_outputs()
            assert p.is_harmony_call and p.is_parsed and constraint.kind == "structural_tag"
            validate(constraint)
            overrides: dict = {}
            p.apply(overrides)
            assert overrides == {"structured_outputs": constraint, "skip_special_tokens": False}
    assert not plan("hermes", tool_choice="required").is_harmony_call  # others keep the JSON array
    assert plan("hermes", tool_choice="required").structured_outputs().kind == "json"
    assert not plan(tool_choice="auto").is_harmony_call and not plan(tool_choice="none").is_harmony_call


def _accepts(compiler, tokenizer, constraint: StructuredOutputsParams, text: str) -> bool:
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.compile_grammar(build_grammar(constraint)))
    ids = tokenizer(text, add_special_tokens=False).input_ids
    return all(matcher.accept_token(i) for i in ids) and matcher.is_terminated()


@pytest.mark.parametrize("text, is_required_ok, is_named_ok", [
    (CALL.format("get_time", '{"zone": "UTC"}'), True, True),
    (THOUGHT.format("let me see") + CALL.format("get_time", '{"zone": "UTC", "days": 3}'), True, True),
    (CALL.format("get_weather", '{"city": "Rome"}'), True, False),
    (CALL.format("get_weather", '{"city": "Oslo"}'), False, False),  # outside the enum
    (CALL.format("get_time", '{"zone":"UTC"}'), False, False),  # compact JSON is ", " and ": " separated
    (CALL.format("get_time", '{"zone": "UTC+10"}'), False, False),  # past maxLength
    (CALL.format("get_time", '{"zone": "UTC", "x": 1}'), False, False),  # strict: only the named properties
    (THOUGHT.format("a<|channel|>b") + CALL.format("get_time", '{"zone": "UTC"}'), False, False),
    ("<|channel|>final<|message|>hi<|return|>", False, False),
    (THOUGHT.format("hmm"), False, False),
])
def test_the_grammar_accepts_exactly_a_call(compiler, tokenizer, text, is_required_ok, is_named_ok):
    assert _accepts(compiler, tokenizer, plan(tool_choice="required").structured_outputs(), text) == is_required_ok
    assert _accepts(compiler, tokenizer, plan(tool_choice=NAMED).structured_outputs(), text) == is_named_ok


def test_a_structural_tag_holds_its_json_parts_as_json_constraints_do():
    def tag(schema) -> StructuredOutputsParams:
        part = {"type": "json_schema", "json_schema": schema}
        return StructuredOutputsParams(structural_tag=json.dumps({"type": "structural_tag", "format": part}))

    with pytest.raises(ValueError, match="JSON schema: .*not"):
        build_grammar(tag({"type": "object", "not": {"required": ["a"]}}))
    assert build_grammar(StructuredOutputsParams(structural_tag=tag({"not": {}}).structural_tag, best_effort=True))
    with pytest.raises(ValueError, match="invalid structural tag"):
        validate(StructuredOutputsParams(structural_tag="{not json"))
    with pytest.raises(ValueError, match="exactly one of"):
        StructuredOutputsParams(structural_tag="{}", regex="a").validate()


def _sample(compiler, tokenizer, constraint: StructuredOutputsParams, seed: int, max_tokens: int = 300) -> str:
    """What the engine writes under the grammar with random logits: <|end|> favoured, so that a thought ends
    (as the server tests' logit_bias does); the EOS that ends it is not in the text, as the engine's."""
    import torch
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiler.compile_grammar(build_grammar(constraint)))
    stop_ids = set(tokenizer.convert_tokens_to_ids(list(HARMONY_EOS)))
    end_id = tokenizer.convert_tokens_to_ids("<|end|>")
    bitmask, generator, ids = xgr.allocate_token_bitmask(1, len(tokenizer)), torch.Generator().manual_seed(seed), []
    for _ in range(max_tokens):
        matcher.fill_next_token_bitmask(bitmask)
        logits = torch.randn(1, len(tokenizer), generator=generator)  # [1, vocab]
        logits[0, end_id] += 4.0
        xgr.apply_token_bitmask_inplace(logits, bitmask)
        token_id = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=generator))
        if token_id in stop_ids:
            return tokenizer.decode(ids, skip_special_tokens=False)
        assert matcher.accept_token(token_id)
        ids.append(token_id)
    raise AssertionError("the output did not end within max_tokens")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("choice", ["required", NAMED])
def test_sampled_outputs_become_one_valid_call(compiler, tokenizer, choice, seed):
    p = plan(tool_choice=choice)
    text = _sample(compiler, tokenizer, p.structured_outputs(), seed)
    split = split_reasoning("gpt_oss", text)
    message, finish = response_message(p, split.content, "stop")
    [call] = message.tool_calls
    assert call.function.name == "get_time" or (choice == "required" and call.function.name == "get_weather")
    jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])
    assert not message.content and finish == ("tool_calls" if choice == "required" else "stop")
    assert "<|" not in (split.reasoning or "")
    thoughts, stream, streamed = reasoning_stream("gpt_oss"), ChoiceStream(p), ["", ""]
    for i in range(0, len(text) + 1, 5):
        is_final = i + 5 > len(text)
        _, content = thoughts.feed(text[i:i + 5], is_final)
        for delta in stream.feed(content, is_final):
            assert not delta.content
            for piece in delta.tool_calls or ():
                streamed[0] += piece.function.name or ""
                streamed[1] += piece.function.arguments or ""
    assert streamed == [call.function.name, call.function.arguments]
    assert stream.finish_reason("stop") == finish
