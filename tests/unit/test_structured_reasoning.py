"""A grammar that waits for the end of the thoughts (a reasoning parser's marker, as token ids): the thoughts
are free, the answer follows the grammar, drafts across the marker are checked on each side, and the server's
front gives the marker only when the prompt leaves thoughts to write."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.loader import load_tokenizer
from llmserve.sampling_params import StructuredOutputsParams as Constraint
from llmserve.server.reasoning_grammar import grammar_after_thinking, parse_structured_outputs_config
from llmserve.structured.bitmask import StepGrammar, unpack_bitmask
from llmserve.structured.compiler import GrammarCompiler
from llmserve.structured.matcher import RequestGrammar
from llmserve.testing.maker import make_model

ANSWER = {"type": "object", "properties": {"answer": {"enum": ["yes", "no"]}}, "required": ["answer"]}
THOUGHT = "so } not [json"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("tiny")), seed=4)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, dtype="float32", max_model_len=256, num_kv_blocks=256)


@pytest.fixture(scope="module")
def compiler(tiny, llm):
    info = llm.engine.model_info
    return GrammarCompiler(lambda: load_tokenizer(tiny), info.vocab_size, info.eos_token_ids)


def started(compiler, reasoning_end: list[int]) -> RequestGrammar:
    grammar = RequestGrammar(compiler.submit(Constraint.from_json_schema(ANSWER, disable_any_whitespace=True)),
                             reasoning_end)
    grammar.compiled.result()
    grammar.start()
    return grammar


def allowed_rows(grammar: RequestGrammar, drafts: list[int], vocab_size: int) -> torch.Tensor:
    bitmask, indices = StepGrammar({"a": grammar}, {"a": drafts}).fill(["a"], vocab_size)
    return unpack_bitmask(bitmask[indices[0]:indices[-1] + 1], vocab_size)  # [len(drafts) + 1, V]


def test_the_thoughts_are_free_and_the_grammar_starts_after_the_marker(compiler, llm):
    tokenizer, vocab_size = llm.tokenizer, llm.engine.model_info.vocab_size
    end = tokenizer.encode("</think>", add_special_tokens=False)
    assert len(end) > 1, "the marker spans tokens here: it is matched across them"
    grammar, fresh = started(compiler, end), started(compiler, None)
    for token_id in tokenizer.encode(THOUGHT, add_special_tokens=False) + end[:-1]:
        assert allowed_rows(grammar, [], vocab_size).all(), "a thought may hold any token"
        assert grammar.accept(token_id) and not grammar.is_terminated
    assert not fresh.matcher.accept_token(tokenizer.encode(THOUGHT, add_special_tokens=False)[0])
    assert grammar.accept(end[-1])  # the thoughts end: the grammar applies from the next token
    for _ in range(6):  # from here on it allows what a grammar that never waited allows
        rows = allowed_rows(grammar, [], vocab_size)
        assert torch.equal(rows, allowed_rows(fresh, [], vocab_size)) and not rows.all()
        token_id = int(rows[0].nonzero()[-1])
        assert grammar.accept(token_id) and fresh.accept(token_id)
    assert not grammar.accept(tokenizer.encode(THOUGHT, add_special_tokens=False)[0])


def test_drafts_across_the_marker_are_checked_on_each_side(compiler, llm):
    tokenizer, vocab_size = llm.tokenizer, llm.engine.model_info.vocab_size
    end = tokenizer.encode("</think>", add_special_tokens=False)
    thought = tokenizer.encode(THOUGHT, add_special_tokens=False)
    answer = tokenizer.encode('{"answer":"yes"}', add_special_tokens=False)
    grammar = started(compiler, end)
    assert grammar.accept(thought[0])
    drafts = thought[1:] + end + answer[:1] + thought[:1]  # the last one breaks the JSON: {"s
    assert grammar.num_valid_drafts(drafts) == len(drafts) - 1
    assert grammar.num_valid_drafts(thought[1:]) == len(thought) - 1  # still thinking after them all
    rows = allowed_rows(grammar, drafts[:-1], vocab_size)
    num_free = len(thought) - 1 + len(end)  # rows up to the marker's last token
    assert rows[:num_free].all()
    fresh = started(compiler, None)
    for j, token_id in enumerate(answer[:1]):
        assert torch.equal(rows[num_free + j], allowed_rows(fresh, [], vocab_size)[0]), j
        assert fresh.accept(token_id)
    assert grammar.is_thinking and grammar.recent == (thought[0],), "filling and checking drafts changes nothing"


def test_an_engine_request_thinks_freely_then_answers_in_json(llm):
    """The end of thought is one token here (`end`), which a logit bias makes the random model write after a few
    sampled tokens; the answer after it follows the schema."""
    tokenizer = llm.tokenizer
    [end] = tokenizer.encode("Z", add_special_tokens=False)
    constraint = Constraint.from_json_schema(ANSWER, disable_any_whitespace=True, reasoning_end=[end])
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=60, logit_bias={end: 2.0},
                            structured_outputs=constraint)
    out = llm.generate([[5, 6, 7]], params)[0].outputs[0]
    assert out.finish_reason == "stop"
    cut = out.token_ids.index(end)
    thought = out.token_ids[:cut]
    assert len(thought) >= 2
    check = RequestGrammar(llm.engine.grammars.submit(constraint))
    check.compiled.result()
    check.start()
    assert not all(check.accept(t) for t in thought), "the thought is no JSON: the grammar did not hold it"
    answer = tokenizer.decode(out.token_ids[cut + 1:], skip_special_tokens=True)
    jsonschema.validate(json.loads(answer), ANSWER)
    llm.engine.check_integrity()


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text]


@pytest.mark.parametrize("parser, prompt, end", [
    ("qwen3", "<|im_start|>assistant\n", "</think>"),
    ("deepseek_r1", "<|im_start|>assistant\n<think>\n", "</think>"),
    ("qwen3", "<|im_start|>assistant\n<think>\n\n</think>\n\n", None),  # enable_thinking false: nothing to wait for
    ("gpt_oss", "<|start|>assistant", "<|channel|>final<|message|>"),
    (None, "<|im_start|>assistant\n", None),
])
def test_the_front_makes_the_grammar_wait_only_for_thoughts_to_come(parser, prompt, end):
    params = SamplingParams(structured_outputs=Constraint(json_object=True))
    grammar_after_thinking(params, parser, _Tokenizer(), prompt)
    assert params.structured_outputs.reasoning_end == (None if end is None else [ord(c) for c in end])
    free = SamplingParams()
    grammar_after_thinking(free, parser, _Tokenizer(), prompt)
    assert free.structured_outputs is None


def test_structured_outputs_config_is_checked():
    assert parse_structured_outputs_config('{"enable_in_reasoning": true}') == {"enable_in_reasoning": True}
    with pytest.raises(ValueError, match="--structured-outputs-config: unsupported key 'backend'"):
        parse_structured_outputs_config('{"backend": "xgrammar"}')
    with pytest.raises(ValueError, match="enable_in_reasoning must be true or false"):
        parse_structured_outputs_config('{"enable_in_reasoning": 1}')
    with pytest.raises(ValueError, match="reasoning_end"):
        Constraint(json_object=True, reasoning_end=[]).validate()
