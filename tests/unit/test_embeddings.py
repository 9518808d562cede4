"""--runner pooling: our embeddings equal transformers' hidden states pooled the same way, for prompts of
several lengths in one batch, one longer than a step's token budget (its prefill chunked); the pooling the
checkpoint asks for (sentence-transformers files) or --pooler-config names; what a pooling engine refuses."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from embedding_cases import ATOL, embedding_checkpoint, hf_embedding, load_hf, write_sentence_transformers
from llmserve import LLM, SamplingParams
from llmserve.config import EngineConfig, ModelConfig, SpeculativeConfig
from llmserve.engine.startup_summary import startup_line
from llmserve.testing.maker import make_model
from llmserve.model.pooler_config import resolve_pooler_config
from llmserve.model.loader import load_hf_config
from llmserve.pooling import PoolerConfig, parse_pooler_override
from llmserve.server.serving_embeddings import embedding_vector
from llmserve.worker.pooler import Pooler

BUDGET = 16  # tokens a step: the 40-token prompt runs in three chunks
MAX_MODEL_LEN = 128
# the last one fills the whole context (an embedding's prompt may: nothing follows it)
PROMPTS = [[7], [5, 6, 7, 8, 9], list(range(20, 33)), list(range(3, 43)), list(range(100, 100 + MAX_MODEL_LEN))]
ENGINE = dict(runner="pooling", dtype="float32", max_num_batched_tokens=BUDGET, num_kv_blocks=64,
              max_model_len=MAX_MODEL_LEN)


def embed(llm: LLM, prompts: list[list[int]]) -> list[torch.Tensor]:
    outputs = llm.embed(prompts)
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.num_blocks - 1, "a pooling request kept KV blocks"
    return [torch.tensor(out.embedding) for out in outputs]


def assert_matches(ours: list[torch.Tensor], hf, pooling: str, normalize: bool) -> None:
    for vector, prompt in zip(ours, PROMPTS, strict=True):
        expected = hf_embedding(hf, prompt, pooling, normalize)
        torch.testing.assert_close(vector, expected, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", ["qwen3", "llama"])
def test_default_pooling_is_the_last_token_normalized(arch, tmp_path):
    """A decoder embedder without sentence-transformers files: Qwen3-Embedding's pooling (vLLM's default)."""
    path = embedding_checkpoint(arch, str(tmp_path))
    llm = LLM(path, **ENGINE)
    assert llm.engine.model_info.pooler == PoolerConfig("LAST", True)
    assert_matches(embed(llm, PROMPTS), load_hf(path), "LAST", True)
    # and again, now that the prefix cache (on for last-token pooling) holds the prompts' blocks
    assert_matches(embed(llm, PROMPTS), load_hf(path), "LAST", True)


def test_sentence_transformers_mean_pooling_is_honoured(tmp_path):
    path = embedding_checkpoint("qwen3", str(tmp_path))
    write_sentence_transformers(path, "mean_tokens", normalize=False)
    llm = LLM(path, **ENGINE)
    assert llm.engine.model_info.pooler == PoolerConfig("MEAN", False)
    assert not llm.engine.config.cache.enable_prefix_caching, "mean pooling needs every token's hidden state"
    line = startup_line(llm.engine)
    assert "runner pooling (MEAN pooling, not normalized)" in line and "prefix caching off" in line, line
    assert_matches(embed(llm, PROMPTS), load_hf(path), "MEAN", False)


def test_pooler_config_overrides_the_checkpoint(tmp_path):
    path = embedding_checkpoint("llama", str(tmp_path))
    write_sentence_transformers(path, "mean_tokens", normalize=True)
    llm = LLM(path, **ENGINE, pooler_config='{"pooling_type": "cls", "normalize": false}')
    assert llm.engine.model_info.pooler == PoolerConfig("CLS", False)
    assert_matches(embed(llm, PROMPTS), load_hf(path), "CLS", False)


def test_a_pooling_engine_generates_nothing_and_a_generating_one_embeds_nothing(tmp_path):
    path = embedding_checkpoint("qwen3", str(tmp_path))
    llm = LLM(path, **ENGINE)
    with pytest.raises(ValueError, match="use embed"):
        llm.generate([[5, 6]], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="no lm_head.*--runner pooling"):  # a bare decoder has no head to generate with
        LLM(path, runner="generate", dtype="float32", num_kv_blocks=64, max_model_len=128)


AUTO = dict(dtype="float32", num_kv_blocks=64, max_model_len=MAX_MODEL_LEN)  # --runner auto, the default


def test_runner_auto_serves_a_bare_decoder_as_an_embedding_model(tmp_path):
    path = embedding_checkpoint("qwen3", str(tmp_path))  # Qwen3Model: no sentence-transformers files
    llm = LLM(path, **AUTO)
    assert llm.engine.config.model.runner == "pooling" and llm.engine.model_info.pooler == PoolerConfig("LAST", True)
    assert_matches(embed(llm, PROMPTS), load_hf(path), "LAST", True)


def test_runner_auto_serves_a_sentence_transformers_folder_as_an_embedding_model(tmp_path):
    """A causal LM's checkpoint (Qwen3ForCausalLM, head and all, as Qwen3-Embedding ships) with modules.json: its
    decoder pooled as 1_Pooling/config.json says."""
    path = make_model("qwen3", "tiny", str(tmp_path))
    write_sentence_transformers(path, "mean_tokens", normalize=True)
    llm = LLM(path, **AUTO)
    assert llm.engine.config.model.runner == "pooling" and llm.engine.model_info.pooler == PoolerConfig("MEAN", True)
    assert_matches(embed(llm, PROMPTS), load_hf(path), "MEAN", True)


def test_runner_auto_serves_a_causal_lm_to_generate(tmp_path, caplog):
    path = make_model("qwen3", "tiny", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="llmserve.engine.engine_core"):
        llm = LLM(path, **AUTO)
    assert llm.engine.config.model.runner == "generate" and llm.engine.model_info.pooler is None
    assert len(llm.generate([[5, 6]], SamplingParams(max_tokens=3, ignore_eos=True))[0].outputs[0].token_ids) == 3
    assert not any("embedding" in r.getMessage() for r in caplog.records)


def test_a_sentence_transformers_model_served_to_generate_is_told_of_the_pooling_runner(tmp_path, caplog):
    path = make_model("qwen3", "tiny", str(tmp_path))  # a causal LM, head and all
    write_sentence_transformers(path, "lasttoken", normalize=True)
    with caplog.at_level(logging.WARNING, logger="llmserve.engine.engine_core"):
        LLM(path, runner="generate", **AUTO)
    assert any("drop --runner generate" in r.getMessage() for r in caplog.records)


def test_pooling_engine_flags_are_validated():
    pooling = ModelConfig(runner="pooling")
    with pytest.raises(ValueError, match="--speculative"):
        EngineConfig(model=pooling, speculative=SpeculativeConfig(speculative="ngram")).validate()
    with pytest.raises(ValueError, match="--pooler-config: only for an embedding model"):
        ModelConfig(runner="generate", pooler_config='{"normalize": false}').validate()
    assert ModelConfig().runner == "auto"
    ModelConfig(pooler_config='{"normalize": false}').validate()  # auto: the checkpoint decides
    with pytest.raises(ValueError, match="--pooler-config: unsupported key 'softmax'"):
        ModelConfig(runner="pooling", pooler_config='{"softmax": true}').validate()
    with pytest.raises(ValueError, match="--pooler-config: pooling_type must be one of"):
        ModelConfig(runner="pooling", pooler_config='{"pooling_type": "MAX"}').validate()
    with pytest.raises(ValueError, match="--runner"):
        ModelConfig(runner="embed").validate()
    assert parse_pooler_override('{"pooling_type": "mean"}') == {"pooling_type": "MEAN"}


def test_unsupported_sentence_transformers_modes_are_refused(tmp_path):
    path = embedding_checkpoint("qwen3", str(tmp_path))
    write_sentence_transformers(path, "max_tokens", normalize=True)
    with pytest.raises(ValueError, match="pooling_mode_max_tokens is not supported"):
        resolve_pooler_config(path, load_hf_config(path))


def test_matryoshka_dimensions_come_from_config_json(tmp_path):
    path = embedding_checkpoint("qwen3", str(tmp_path / "any"), is_matryoshka=True)
    assert resolve_pooler_config(path, load_hf_config(path)).matryoshka_dimensions == ()
    path = embedding_checkpoint("qwen3", str(tmp_path / "listed"), matryoshka_dimensions=[16, 32])
    pooler = resolve_pooler_config(path, load_hf_config(path))
    pooler.check_dimensions(32, 64)
    with pytest.raises(ValueError, match="one of 16, 32"):
        pooler.check_dimensions(8, 64)
    with pytest.raises(ValueError, match="does not support Matryoshka"):
        PoolerConfig().check_dimensions(8, 64)
    with pytest.raises(ValueError, match=r"1\.\.64"):
        PoolerConfig(matryoshka_dimensions=()).check_dimensions(65, 64)


def test_truncated_vectors_are_normalized_again():
    vector = np.array([3.0, 4.0, 12.0], dtype="<f4")
    pooled = (vector / np.linalg.norm(vector)).astype("<f4").tobytes()
    np.testing.assert_allclose(embedding_vector(pooled, PoolerConfig(), 2), [0.6, 0.8], rtol=1e-6)
    raw = vector.tobytes()
    np.testing.assert_array_equal(embedding_vector(raw, PoolerConfig(normalize=False), 2), [3.0, 4.0])
    np.testing.assert_array_equal(embedding_vector(raw, PoolerConfig(normalize=False), None), vector)


@pytest.mark.parametrize("pooling", ["LAST", "MEAN", "CLS"])
def test_pooler_over_chunks_equals_pooling_at_once_and_forgets_a_preempted_request(pooling):
    hidden = torch.randn(10, 4, generator=torch.Generator().manual_seed(0))  # [T, H] one prompt of 10
    pooler = Pooler(PoolerConfig(pooling, normalize=False))
    whole = pooler.pool(hidden, ["a"], np.array([0]), np.array([10]), np.array([10]))[0]
    assert pooler.pool(hidden[:4], ["a"], np.array([0]), np.array([4]), np.array([10])) == [None]
    pooler.forget({"a"})  # preempted: it starts again from its first token
    assert not pooler.partial
    assert pooler.pool(hidden[:6], ["a"], np.array([0]), np.array([6]), np.array([10])) == [None]
    chunked = pooler.pool(hidden[6:], ["a"], np.array([6]), np.array([4]), np.array([10]))[0]
    np.testing.assert_allclose(np.frombuffer(chunked, "<f4"), np.frombuffer(whole, "<f4"), rtol=1e-6)
    expected = {"LAST": hidden[-1], "MEAN": hidden.mean(0), "CLS": hidden[0]}[pooling]
    np.testing.assert_allclose(np.frombuffer(whole, "<f4"), expected.numpy(), rtol=1e-5)
    pooler.check_integrity(set())


@pytest.mark.parametrize("mode", ["lasttoken", "mean_tokens"])
def test_two_ranks_pool_what_one_rank_pools(mode, tmp_path):
    """--tensor-parallel-size 2 (2 gloo ranks on CPU): every rank runs the forward, rank 0 pools its hidden
    states (whole after each layer's all-reduce); chunked prompts, and a MEAN pooler's partial sums."""
    path = embedding_checkpoint("qwen3", str(tmp_path))
    write_sentence_transformers(path, mode, normalize=True)
    pooling = "LAST" if mode == "lasttoken" else "MEAN"
    with LLM(path, tensor_parallel_size=2, **ENGINE) as llm:
        assert llm.engine.tp_executor is not None and llm.engine.model_info.pooler.pooling_type == pooling
        assert_matches(embed(llm, PROMPTS), load_hf(path), pooling, True)
