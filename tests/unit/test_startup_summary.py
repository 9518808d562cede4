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
                  "prefix caching off",
                  "speculative ngram 1-4, k=3, up to batch 2 (always)",  # CPU, float32: 10 rows // (k + 1)
                  "async scheduling off", "CUDA graphs off", "threads 1 (--num-threads)", "max_model_len 64"):
        assert words in line, (words, line)
    assert "KV tiers" not in line


def test_the_ready_line_names_the_kv_tiers_and_the_role():
    from llmserve.config import KVTransferConfig
    from llmserve.engine.startup_summary import kv_tiers

    config = KVTransferConfig(kv_offload_memory="1GiB", kv_offload_disk="/nvme/kv", kv_offload_disk_bytes="4GiB",
                              disaggregation_mode="decode", disaggregation_kv_port=9000)
    assert kv_tiers(config) == "KV tiers: host 1.00 GiB, disk 4.00 GiB in /nvme/kv, decode server (KV port 9000)"
    assert kv_tiers(KVTransferConfig()) is None
