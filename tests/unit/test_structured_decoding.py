"""Structured outputs in the engine: the step's bitmask equals a per-token reference, constrained outputs
hold on a random-weight model (greedy, sampled, with drafts, with overlap), unconstrained neighbours get
the tokens they get alone, and grammars compile off the loop (cached; a request waits aside)."""

from __future__ import annotations

import json
import re
from concurrent.futures import Future

import jsonschema
import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.model.loader import load_tokenizer
from llmserve.testing.maker import make_model
from llmserve.sampling_params import StructuredOutputsParams as Constraint
from llmserve.structured.bitmask import StepGrammar, apply_bitmask, unpack_bitmask
from llmserve.structured.compiler import GrammarCompiler
from llmserve.structured.matcher import RequestGrammar

from core_helpers import EOS, make_request, make_scheduler, step

PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 10},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 1, "maxItems": 3},
    "home": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/city"}]}},
    "required": ["name", "age", "tags"], "$defs": {"city": {"type": "string", "pattern": "^[A-Z][a-z]{1,6}$"}}}
EMAIL = r"[a-z]{3,8}@[a-z]{2,5}\.(com|org)"
CHOICES = ["yes", "no", "it depends"]
GRAMMAR = 'root ::= "(" num (" + " num){0,3} ")"\nnum ::= [1-9] [0-9]{0,2}'


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("tiny")), seed=4)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, dtype="float32", max_model_len=512, num_kv_blocks=1024)


@pytest.fixture(scope="module")
def compiler(tiny, llm):
    info = llm.engine.model_info
    return GrammarCompiler(lambda: load_tokenizer(tiny), info.vocab_size, info.eos_token_ids)


def _prompts(num: int) -> list[list[int]]:
    return [[(5 * i + 11 * j) % 300 + 3 for j in range(4 + (7 * i) % 20)] for i in range(num)]


def _check(text: str, constraint: Constraint) -> None:
    if constraint.json is not None:
        jsonschema.validate(json.loads(text), json.loads(constraint.json))
    elif constraint.regex is not None:
        assert re.fullmatch(constraint.regex, text), text
    elif constraint.choice is not None:
        assert text in constraint.choice
    elif constraint.json_object:
        assert isinstance(json.loads(text), dict)


CONSTRAINTS = [Constraint.from_json_schema(PERSON), Constraint.from_json_schema(PERSON, disable_any_whitespace=True),
               Constraint(regex=EMAIL), Constraint(choice=CHOICES), Constraint(grammar=GRAMMAR)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_constrained_outputs_hold_on_a_random_model(llm, temperature):
    prompts = _prompts(10)
    params = [SamplingParams(temperature=temperature, seed=i, max_tokens=400,
                             structured_outputs=CONSTRAINTS[i % len(CONSTRAINTS)]) for i in range(len(prompts))]
    for i, out in enumerate(llm.generate(prompts, params)):
        assert out.outputs[0].finish_reason == "stop", out.outputs[0].text
        _check(out.outputs[0].text, CONSTRAINTS[i % len(CONSTRAINTS)])
    if temperature == 0.0:
        assert re.fullmatch(r"\((\d+)( \+ \d+)*\)", llm.generate(prompts[4], params[4])[0].outputs[0].text)
    llm.engine.check_integrity()


def test_free_requests_get_the_same_tokens_beside_constrained_ones(llm):
    prompts = _prompts(8)
    free = [SamplingParams(temperature=t, seed=i, max_tokens=24, ignore_eos=True) for i, t in enumerate([0.0, 0.8] * 4)]
    alone = llm.generate(prompts, free)
    constrained = [SamplingParams(temperature=1.0, seed=i, max_tokens=60, structured_outputs=CONSTRAINTS[i % 5])
                   for i in range(8)]
    mixed = llm.generate(prompts + prompts, free + constrained)
    assert [o.outputs[0].token_ids for o in mixed[:8]] == [o.outputs[0].token_ids for o in alone]


def _reference_allowed(grammar: RequestGrammar, vocab_size: int) -> torch.Tensor:
    """Per token: does the matcher accept it now? (tried one by one, rolled back)"""
    allowed = torch.zeros(vocab_size, dtype=torch.bool)
    for token_id in range(vocab_size):
        if grammar.matcher.accept_token(token_id):
            allowed[token_id] = True
            grammar.matcher.rollback(1)
    return allowed


def test_bitmask_equals_a_per_token_reference_on_random_logits(compiler, llm):
    vocab_size = llm.engine.model_info.vocab_size
    tokenizer = llm.tokenizer
    gen = torch.Generator().manual_seed(0)
    for constraint, text in [(Constraint.from_json_schema(PERSON), '{"name": "Al'), (Constraint(regex=EMAIL), "abc@x"),
                             (Constraint(choice=CHOICES), "it")]:
        grammar = RequestGrammar(compiler.submit(constraint))
        grammar.compiled.result()
        grammar.start()
        prefix = tokenizer.encode(text, add_special_tokens=False)
        drafts = prefix[1:]  # filled as drafts after the first token: rows 1.. see the drafts' states
        assert grammar.accept(prefix[0])
        bitmask, indices = StepGrammar({"a": grammar}, {"a": drafts}).fill(["free", "a"], vocab_size)
        assert indices == list(range(1, len(drafts) + 2))
        for j, row in enumerate(indices):
            want = _reference_allowed(grammar, vocab_size)
            assert torch.equal(unpack_bitmask(bitmask[row:row + 1], vocab_size)[0], want), (text, j)
            for dtype in (torch.float32, torch.float64):  # xgrammar's CPU kernel and the torch path
                logits = torch.randn(len(indices) + 1, vocab_size, generator=gen, dtype=dtype)
                masked = logits.clone()
                apply_bitmask(masked, bitmask, [row])
                assert torch.equal(masked[row], logits[row].masked_fill(~want, float("-inf")))
                assert torch.equal(masked[0], logits[0])  # the free row is untouched
            if j < len(drafts):
                assert grammar.accept(drafts[j])


@pytest.mark.parametrize("kind", ["ngram", "draft"])
def test_drafts_the_grammar_forbids_are_rejected(tiny, llm, kind):
    """Constrained requests between unconstrained ones with drafts: their bitmask rows sit after the
    others' draft rows."""
    extra = {"draft_model": tiny} if kind == "draft" else {}  # the target as its own draft: proposes freely
    spec = LLM(tiny, dtype="float32", max_model_len=512, speculative=kind, num_speculative_tokens=3,
               speculative_dynamic=False, num_kv_blocks=1024, speculative_max_batch=8, **extra)
    prompts = _prompts(12)
    free = SamplingParams(temperature=0.0, max_tokens=120, ignore_eos=True)
    params = [p for i in range(6)
              for p in (SamplingParams(temperature=0.0, max_tokens=300, structured_outputs=CONSTRAINTS[i % 5]), free)]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    got = spec.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == plain
    for out, p in zip(got, params):
        if p.structured_outputs is not None:
            _check(out.outputs[0].text, p.structured_outputs)
    spec.engine.check_integrity()
    assert spec.engine.num_free_blocks() == spec.engine.scheduler.kv.pool.num_usable_blocks


def test_overlapped_steps_give_the_in_order_outputs(tiny, llm):
    prompts = _prompts(8)
    params = [SamplingParams(temperature=0.7, seed=i, max_tokens=80, ignore_eos=i % 2 == 0,
                             structured_outputs=CONSTRAINTS[i % 5] if i % 2 else None) for i in range(8)]
    want = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    overlapped = LLM(tiny, dtype="float32", max_model_len=512, async_scheduling=True, num_kv_blocks=1024)
    assert [o.outputs[0].token_ids for o in overlapped.generate(prompts, params)] == want
    overlapped.engine.check_integrity()


def test_steps_with_grammars_overlap_and_end_where_the_in_order_engine_ends(tiny):
    """Every request structured, four seats: step N+1 is launched before step N's tokens reach the host (its
    grammars take them before N+1's bitmask is filled), and every output, grammars completed while a step was in
    flight included, is the in-order engine's."""
    prompts = _prompts(10)
    params = [SamplingParams(temperature=0.8, seed=i, max_tokens=60, structured_outputs=CONSTRAINTS[i % 5])
              for i in range(10)]
    runs = []
    for is_async in (False, True):
        engine = LLM(tiny, dtype="float32", max_model_len=512, num_kv_blocks=1024, max_num_seqs=4,
                     async_scheduling=is_async)
        runs.append(engine.generate(prompts, params))
        assert (engine.engine.runner.times.num_device_inputs > 0) == is_async  # inputs fed from the device
        engine.engine.check_integrity()
    in_order, overlapped = runs
    assert [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in overlapped] == \
        [(o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in in_order]
    assert sum(o.outputs[0].finish_reason == "stop" for o in overlapped) >= 5
    for out, p in zip(overlapped, params):
        if out.outputs[0].finish_reason == "stop":
            _check(out.outputs[0].text, p.structured_outputs)


def test_the_fast_lane_takes_a_token_only_where_the_grammar_stays_open(compiler, llm):
    tokenizer = llm.tokenizer
    grammar = RequestGrammar(compiler.submit(Constraint(choice=["yes", "no"])))
    grammar.compiled.result()
    grammar.start()
    eos = llm.engine.model_info.eos_token_ids[0]
    yes = tokenizer.encode("yes", add_special_tokens=False)
    assert not grammar.accept_if_open(tokenizer.encode("x", add_special_tokens=False)[0])  # forbidden: unchanged
    for token_id in yes:
        assert grammar.accept_if_open(token_id)
    assert not grammar.accept_if_open(eos) and not grammar.is_terminated  # it would close the grammar: unchanged
    assert grammar.accept(eos) and grammar.is_terminated


def test_compiles_are_cached_by_constraint(compiler):
    compiler.take_stats()
    first = compiler.submit(Constraint(regex="[0-9]{4}"))
    first.result()
    assert compiler.submit(Constraint(regex="[0-9]{4}")) is first
    compiler.submit(Constraint(regex="[0-9]{5}")).result()
    stats = compiler.take_stats()
    assert (stats.num_queries, stats.num_hits, len(stats.compile_seconds)) == (3, 1, 2)


def _structured_request(req_id: str, future: Future):
    request = make_request(req_id, [1, 2, 3], max_tokens=4, structured_outputs=Constraint(regex="a"))
    request.grammar = RequestGrammar(future)
    return request


def test_a_request_waits_aside_while_its_grammar_compiles():
    sched = make_scheduler()
    pending = Future()
    sched.add_request(_structured_request("s", pending))
    sched.add_request(make_request("free", [4, 5, 6], max_tokens=3))
    for _ in range(2):
        out, outputs = step(sched)
        assert list(out.num_scheduled_tokens) == ["free"] and out.grammar is None
        assert outputs.stats.num_waiting == 1
    sched.abort_requests(["s"])
    assert [o.finish_reason for o in step(sched)[1].outputs if o.request_id == "s"] == [2]  # FinishReason.ABORT
    failed = Future()
    failed.set_exception(RuntimeError("no"))
    sched.add_request(_structured_request("f", failed))
    assert [(o.request_id, int(o.finish_reason)) for o in step(sched)[1].outputs if o.request_id == "f"] == [("f", 2)]
    sched.check_integrity()
    assert sched.num_structured == 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_idle_engine_waits_for_a_compile_instead_of_spinning(tiny, monkeypatch, async_scheduling):
    llm = LLM(tiny, dtype="float32", max_model_len=512, num_kv_blocks=256, async_scheduling=async_scheduling)
    pending = Future()
    monkeypatch.setattr(llm.engine.grammars, "submit", lambda constraint: pending)
    waits = []
    monkeypatch.setattr(llm.engine.scheduler.compiling, "wait", waits.append)
    params = SamplingParams(max_tokens=4, structured_outputs=CONSTRAINTS[2])
    for request in llm.processor.process("s", [4, 5, 6], params):
        llm.engine.add_request(request)
    for _ in range(3):
        llm.engine.step()
    assert len(waits) == 3 and llm.engine.has_unfinished_requests()
    llm.engine.abort_requests(["s"])
    llm.engine.step()
    assert not llm.engine.has_unfinished_requests()


def test_min_tokens_and_bad_constraints_are_refused(llm):
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs=Constraint(regex="a+"))
    with pytest.raises(ValueError, match="invalid regex"):
        llm.generate([[1, 2, 3]], SamplingParams(structured_outputs=Constraint(regex="a(b")))
    with pytest.raises(ValueError, match="exactly one"):
        SamplingParams(structured_outputs=Constraint(regex="a", choice=["b"]))


def test_logprobs_of_forbidden_tokens_are_finite(llm):
    out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, logprobs=5, max_tokens=10,
                                                   structured_outputs=Constraint(choice=["yes"])))[0].outputs[0]
    assert out.text == "yes" and out.logprobs
    values = [v for lp in out.logprobs for _, v in lp.top] + [lp.logprob for lp in out.logprobs]
    assert all(-9999.0 <= v <= 0.0 for v in values) and min(values) == -9999.0


def test_siblings_and_preempted_requests_keep_their_grammar(tiny):
    small = LLM(tiny, dtype="float32", max_model_len=160, num_kv_blocks=12, max_num_batched_tokens=64)
    prompts = _prompts(6)
    params = [SamplingParams(n=2, temperature=1.0, seed=i, max_tokens=120, structured_outputs=CONSTRAINTS[i % 5])
              for i in range(6)]
    outs = small.generate(prompts, params)
    assert small.num_preemptions > 0, "the small pool was meant to force preemption"
    for i, out in enumerate(outs):
        assert len(out.outputs) == 2
        for choice in out.outputs:
            if choice.finish_reason == "stop":
                _check(choice.text, CONSTRAINTS[i % 5])
    assert sum(c.finish_reason == "stop" for o in outs for c in o.outputs) >= 8
    small.engine.check_integrity()
    assert small.engine.num_free_blocks() == small.engine.scheduler.kv.pool.num_usable_blocks
