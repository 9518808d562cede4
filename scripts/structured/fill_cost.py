"""What a structured row's bitmask fill costs on the host: per grammar state, and one step's rows filled one by one
against xgrammar's threaded batch call.

Compiles a JSON schema against a checkpoint's tokenizer (make one with `llmserve make-model --shape llama-3.1-8b
--no-weights --out DIR` for Llama 3's 128,256 ids), then (1) walks a matcher through a sample JSON text and times
the fill before each token, and (2) fills N rows all in one state with 1, 2, 4 ... threads (the best of 5).

    python scripts/structured/fill_cost.py TOKENIZER_DIR [--schema scripts/gpu/schema.json] [--rows 16,64,256]
"""

from __future__ import annotations

import argparse
import os
import time

import xgrammar as xgr
from transformers import AutoTokenizer

from llmserve.sampling_params import StructuredOutputsParams
from llmserve.structured.grammar import build_grammar

TEXT = '{"year": 1987, "title": "A short title here", "text": "Some free text goes here and on'
STATES = {"inside title (maxLength)": '{"year": 1987, "title": "A sh',
          "inside text (free string)": '{"year": 1987, "title": "A short", "text": "Some fr'}


def _matcher(compiled, tokenizer, text: str) -> xgr.GrammarMatcher:
    matcher = xgr.GrammarMatcher(compiled)
    for token_id in tokenizer.encode(text, add_special_tokens=False):
        assert matcher.accept_token(token_id), text
    return matcher


def per_state(compiled, tokenizer, vocab_size: int) -> None:
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    ids = tokenizer.encode(TEXT, add_special_tokens=False)
    for i, token_id in enumerate(ids):
        start = time.perf_counter()
        for _ in range(5):
            matcher.fill_next_token_bitmask(bitmask, 0)
        print(f"  {(time.perf_counter() - start) / 5 * 1e6:8.1f} us  before {tokenizer.decode(ids[i:i + 1])!r}")
        assert matcher.accept_token(token_id)


def batched(compiled, tokenizer, vocab_size: int, rows: list[int]) -> None:
    counts = sorted({1, 2, 4, 8} & set(range(1, len(os.sched_getaffinity(0)) + 1)))
    batches = {n: xgr.BatchGrammarMatcher(n) for n in counts}
    for state, text in STATES.items():
        for num in rows:
            matchers = [_matcher(compiled, tokenizer, text) for _ in range(num)]
            bitmask = xgr.allocate_token_bitmask(num, vocab_size)
            best = {}
            for _ in range(5):
                start = time.perf_counter()
                for row, matcher in enumerate(matchers):
                    matcher.fill_next_token_bitmask(bitmask, row)
                best["one by one"] = min(best.get("one by one", 1e9), time.perf_counter() - start)
                for n, batch in batches.items():
                    start = time.perf_counter()
                    batch.batch_fill_next_token_bitmask(matchers, bitmask)
                    best[f"{n} threads"] = min(best.get(f"{n} threads", 1e9), time.perf_counter() - start)
            print(f"  {state}, {num} rows: " + ", ".join(f"{k} {v * 1e3:.2f} ms" for k, v in best.items()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("tokenizer")
    parser.add_argument("--schema", default="scripts/gpu/schema.json")
    parser.add_argument("--rows", default="16,64,256")
    args = parser.parse_args()
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    vocab_size = len(tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size)
    with open(args.schema) as f:
        grammar = build_grammar(StructuredOutputsParams.from_json_schema(f.read()))
    for threads in (1, 2):
        start = time.perf_counter()
        compiled = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False).compile_grammar(grammar)
        print(f"compile on {threads} thread(s): {time.perf_counter() - start:.3f} s")
    print("one row's fill, per state:")
    per_state(compiled, tokenizer, vocab_size)
    print("a step's rows, all in one state:")
    batched(compiled, tokenizer, vocab_size, [int(n) for n in args.rows.split(",")])


if __name__ == "__main__":
    main()
