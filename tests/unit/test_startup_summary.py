"""The engine's start-up line names what is on, with its sizes."""

import logging

from llmserve.engine.engine_core import EngineCore
from llmserve.engine.llm import build_engine_config
from llmserve.testing.maker import make_model


def test_the_ready_line_lists_the_features_and_their_sizes(tmp_path, caplog):
    path = make_model("llama", "tiny", str(tmp_path), seed=0)
    config = build_engine_config(model=path, dtype="float32", device="cpu", max_model_len=64, num_kv_blocks=20,
                                 speculative="ngram", num_speculative_tokens=3, enable_prefix_caching=False,
                                 num_threads=1)
    with caplog.at_level(logging.INFO, logger="llmserve.engine.engine_core"):
        EngineCore(config)
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready:")]
    assert len(lines) == 1
    line = lines[0]
    for words in ("on cpu, float32", "runner generate", "linears ", "KV cache float32, 20 blocks of 16 tokens (320 tokens, ",
                  "prefix caching off", "speculative ngram 1-4, k=3, up to batch 8 (always)",
                  "async scheduling off", "CUDA graphs off", "threads 1 (--num-threads)", "max_model_len 64"):
        assert words in line, (words, line)
