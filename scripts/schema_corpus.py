"""Random walks through the server's grammar path on the schema corpus (tests/data/schemas), with more
walks than CI: prints % of schemas compiled or refused naming a keyword and % of finished walks valid.

    PYTHONPATH=src python scripts/schema_corpus.py [--walks 10] [--max-tokens 400] [--seed 0]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit"))

from schema_walk import CorpusStats, is_named_refusal, run_schema  # noqa: E402

from llmserve.model.loader import load_tokenizer  # noqa: E402
from llmserve.testing.maker import make_model  # noqa: E402
from llmserve.structured.compiler import GrammarCompiler  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--walks", type=int, default=10)
    parser.add_argument("--max-tokens", type=int, default=400)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    tokenizer = load_tokenizer(make_model("llama", "tiny", tempfile.mkdtemp(), seed=4))
    compiler = GrammarCompiler(lambda: tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    stats, rng, start = CorpusStats(), random.Random(args.seed), time.perf_counter()
    for path in sorted((ROOT / "tests" / "data" / "schemas").glob("*.json")):
        run_schema(compiler, tokenizer, json.loads(path.read_text()), stats, rng, args.walks, args.max_tokens,
                   is_named_refusal)
    print(f"{stats.summary()} in {time.perf_counter() - start:.0f} s")
    for line in stats.failed + stats.invalid:
        print("  ", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
