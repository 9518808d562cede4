"""Real-world schemas (tests/data/schemas: SchemaStore and JSONSchemaBench) through the server's grammar
path, model-free: every schema compiles or is refused naming a keyword, and random walks that finish give
documents that validate. The full run with more walks: scripts/schema_corpus.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from llmserve.model.loader import load_tokenizer
from llmserve.testing.maker import make_model
from llmserve.structured.compiler import GrammarCompiler

from schema_walk import CorpusStats, is_named_refusal, run_schema

SCHEMAS = sorted((Path(__file__).parents[1] / "data" / "schemas").glob("*.json"))


@pytest.fixture(scope="module")
def compiler_and_tokenizer(tmp_path_factory):
    tokenizer = load_tokenizer(make_model("llama", "tiny", str(tmp_path_factory.mktemp("tiny")), seed=4))
    return GrammarCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id]), tokenizer


def test_corpus_size():
    assert len(SCHEMAS) >= 200


def test_corpus_compiles_or_refuses_by_name_and_walks_validate(compiler_and_tokenizer):
    compiler, tokenizer = compiler_and_tokenizer
    stats, rng = CorpusStats(), random.Random(0)
    for path in SCHEMAS:
        run_schema(compiler, tokenizer, json.loads(path.read_text()), stats, rng, num_walks=2, max_tokens=300,
                   is_named_refusal=is_named_refusal)
    print(stats.summary())
    assert not stats.failed, stats.failed[:5]
    assert stats.num_walks_valid >= 0.995 * stats.num_walks_finished, stats.invalid[:5]
    assert stats.num_walks_finished >= 100
