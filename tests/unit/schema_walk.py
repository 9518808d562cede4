"""Model-free random walks through the server's grammar path (a test helper, also used by
scripts/schema_corpus.py): compile a schema as the server does, then at each step draw a token uniformly
among those the grammar allows, and validate each finished document with `jsonschema`."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field

import torch

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured.bitmask import bitmask_words, unpack_bitmask
from llmserve.structured.compiler import GrammarCompiler


@dataclass
class CorpusStats:
    """Counts over a corpus: schemas compiled, refused naming a keyword, failed otherwise (their errors);
    walks finished, valid, stopped by the token cap (the invalid ones' first errors)."""

    num_schemas: int = 0
    num_compiled: int = 0
    num_refused_named: int = 0
    failed: list[str] = field(default_factory=list)
    num_walks_finished: int = 0
    num_walks_valid: int = 0
    num_walks_capped: int = 0
    invalid: list[str] = field(default_factory=list)

    def summary(self) -> str:
        ok = self.num_compiled + self.num_refused_named
        valid = self.num_walks_valid / max(self.num_walks_finished, 1)
        return (f"{self.num_schemas} schemas: {self.num_compiled} compiled, {self.num_refused_named} refused naming "
                f"a keyword, {len(self.failed)} other errors ({100 * ok / max(self.num_schemas, 1):.1f}% "
                f"compiled or refused by name); walks: {self.num_walks_finished} finished, {self.num_walks_valid} "
                f"valid ({100 * valid:.2f}%), {self.num_walks_capped} hit the cap")


def is_named_refusal(error: ValueError) -> bool:
    """A 400 that names the keyword (and JSON pointer) the grammar cannot enforce."""
    return "keyword '" in str(error) and " at /" in str(error)


def walk(compiled, tokenizer, vocab_size: int, rng: random.Random, max_tokens: int) -> str | None:
    """One walk's text; None when it hit `max_tokens` before the grammar finished."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = torch.empty(1, bitmask_words(vocab_size), dtype=torch.int32)
    tokens: list[int] = []
    for _ in range(max_tokens):
        matcher.fill_next_token_bitmask(bitmask, 0)
        allowed = unpack_bitmask(bitmask, vocab_size)[0].nonzero().flatten().tolist()
        token = rng.choice(allowed)
        assert matcher.accept_token(token)
        if matcher.is_terminated():
            return tokenizer.decode(tokens)
        tokens.append(token)
    return None


def run_schema(compiler: GrammarCompiler, tokenizer, schema: dict, stats: CorpusStats, rng: random.Random,
               num_walks: int, max_tokens: int, is_named_refusal) -> None:
    """Compile (as the server does), then walk and validate; counts go to `stats`."""
    import jsonschema

    stats.num_schemas += 1
    params = StructuredOutputsParams.from_json_schema(schema)
    try:
        compiled = compiler.submit(params).result()
    except ValueError as e:
        if is_named_refusal(e):
            stats.num_refused_named += 1
        else:
            stats.failed.append(str(e)[:200])
        return
    stats.num_compiled += 1
    validator = jsonschema.validators.validator_for(schema)(schema)
    for _ in range(num_walks):
        text = walk(compiled, tokenizer, compiler.vocab_size, rng, max_tokens)
        if text is None:
            stats.num_walks_capped += 1
            continue
        stats.num_walks_finished += 1
        try:
            errors = list(validator.iter_errors(json.loads(text)))
        except json.JSONDecodeError as e:
            errors = [f"not JSON: {e}"]
        if errors:
            error = errors[0]
            message = getattr(error, "message", error)
            where = "/".join(map(str, getattr(error, "schema_path", [])))
            stats.invalid.append(f"{str(message)[:150]} @ {where} <- {text[:150]!r}")
        else:
            stats.num_walks_valid += 1
