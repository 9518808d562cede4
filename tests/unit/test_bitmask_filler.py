"""The runner's bitmask filler: rows that follow plain decoding fill in one threaded xgrammar call, the others
(drafts, a completed grammar) row by row, into two reused buffers; every constrained row equals the row the
one-by-one fill gives, step after step, as the batch grows and shrinks."""

from __future__ import annotations

import pytest
import torch

from llmserve.model.loader import load_tokenizer
from llmserve.sampling_params import StructuredOutputsParams as Constraint
from llmserve.structured.bitmask import BitmaskFiller, StepGrammar, apply_bitmask, unpack_bitmask
from llmserve.structured.compiler import GrammarCompiler
from llmserve.structured.matcher import RequestGrammar
from llmserve.testing.maker import make_model

SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 12}, "n": {"type": "integer"}},
          "required": ["title", "n"]}
# (text so far, a valid continuation: the first tokens of it are drafts), the last one completed with its stop
TEXTS = [('{"title": "ab', 'c", "n": 1}'), ('{"ti', 'tle": "q", "n": 2}'), ('{"title": "x", "n": 1', '0}'),
         ("", '{"title": "", "n": 3}'), ('{"title": "", "n": 42}', None)]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    path = make_model("llama", "tiny", str(tmp_path_factory.mktemp("tiny")), seed=4)
    tokenizer = load_tokenizer(path)
    vocab_size = 512
    compiler = GrammarCompiler(lambda: tokenizer, vocab_size, [tokenizer.eos_token_id])
    return tokenizer, vocab_size, compiler.submit(Constraint.from_json_schema(SCHEMA))


def _grammar(compiled, tokenizer, text: str, is_complete: bool) -> RequestGrammar:
    grammar = RequestGrammar(compiled)
    grammar.compiled.result()
    grammar.start()
    ids = tokenizer.encode(text, add_special_tokens=False) + ([tokenizer.eos_token_id] if is_complete else [])
    for token_id in ids:
        assert grammar.accept(token_id), text
    return grammar


def test_batch_fill_equals_the_one_by_one_fill_across_steps(setup):
    tokenizer, vocab_size, compiled = setup
    filler = BitmaskFiller(vocab_size, torch.device("cpu"), num_threads=2)
    num_terminated = 0
    for step, num_requests in enumerate([3, 9, 2, 90, 5]):  # the buffers grow and are reused; 90: 2 threads
        step_grammar, ids = StepGrammar(), []
        for i in range(num_requests):
            ids.append(f"r{i}")
            if i % 3 == 2:
                continue  # unconstrained
            text, continuation = TEXTS[(i + step) % len(TEXTS)]
            grammar = _grammar(compiled, tokenizer, text, is_complete=continuation is None)
            step_grammar.add(f"r{i}", grammar)
            num_terminated += grammar.is_terminated
            if i % 4 == 1 and continuation:  # drafts: the next tokens of a valid continuation
                step_grammar.drafts[f"r{i}"] = tokenizer.encode(continuation, add_special_tokens=False)[:2]
        if step == 1:
            step_grammar.drafts["r2"] = [5, 6, 7]  # an unconstrained request's drafts move the rows after it
        got, indices = filler.fill(step_grammar, ids)
        want, want_indices = step_grammar.fill(ids, vocab_size)
        assert indices == want_indices and got.shape == want.shape
        assert torch.equal(got[indices], want[indices]), step
        logits = torch.randn(got.shape[0], vocab_size)
        masked = logits.clone()
        filler.apply(masked, got, indices)
        allowed = unpack_bitmask(want[indices], vocab_size)
        assert torch.equal(masked[indices], logits[indices].masked_fill(~allowed, float("-inf")))
        free = sorted(set(range(got.shape[0])) - set(indices))
        assert torch.equal(masked[free], logits[free])
    assert num_terminated > 0


def test_the_torch_path_masks_as_the_xgrammar_kernel_does(setup):
    tokenizer, vocab_size, compiled = setup
    step_grammar = StepGrammar()
    for i, (text, continuation) in enumerate(TEXTS):
        step_grammar.add(f"r{i}", _grammar(compiled, tokenizer, text, is_complete=continuation is None))
    bitmask, indices = step_grammar.fill([f"r{i}" for i in range(len(TEXTS))], vocab_size)
    logits = torch.randn(len(TEXTS), vocab_size, dtype=torch.float64)  # not float32: the torch path
    kernel = logits.float().clone()
    apply_bitmask(kernel, bitmask, indices[1:])
    masked = logits.clone()
    apply_bitmask(masked, bitmask, indices[1:])
    assert torch.equal(masked.float(), kernel)
    assert torch.equal(masked[0], logits[0])
