"""Benchmark datasets: lengths, seeds, shared prefixes, file formats, text prompts of exact token counts."""

import json

import numpy as np
import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from llmserve.bench.config import DatasetConfig
from llmserve.bench.datasets import make_sampler, sample_lengths
from llmserve.bench.tokens import load_tokenizer

CORPUS = ["the quick brown fox jumps over the lazy dog", "serving large language models with paged attention",
          "a benchmark measures time to first token and inter token latency", "hello world " * 5] * 20


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    path = tmp_path_factory.mktemp("tok")
    tok.save(str(path / "tokenizer.json"))
    return str(path)


def _rng(seed=0):
    return np.random.default_rng(seed)


def test_random_ids_lengths_and_vocab():
    cfg = DatasetConfig(input_len=20, output_len=7, vocab_size=50)
    reqs = make_sampler(cfg, "completions", None)(30, _rng())
    assert len(reqs) == 30
    for r in reqs:
        assert isinstance(r.prompt, list) and len(r.prompt) == r.prompt_len == 20 and r.output_len == 7
        assert all(0 <= t < 50 for t in r.prompt) and r.is_prompt_len_exact


def test_range_ratio_bounds():
    lens = sample_lengths(100, 0.5, 2000, _rng())
    assert min(lens) >= 50 and max(lens) <= 150 and min(lens) < 60 and max(lens) > 140
    assert sample_lengths(10, 0.0, 5, _rng()) == [10] * 5
    assert min(sample_lengths(1, 0.9, 100, _rng())) >= 1


def test_seeded():
    cfg = DatasetConfig(input_len=16, output_len=4, range_ratio=0.5)
    sample = make_sampler(cfg, "completions", None)
    assert sample(10, _rng(1)) == sample(10, _rng(1))
    assert sample(10, _rng(1)) != sample(10, _rng(2))


def test_shared_prefix_ids():
    cfg = DatasetConfig(dataset="shared-prefix", num_prefixes=3, prefix_len=32, input_len=8, output_len=5)
    reqs = make_sampler(cfg, "completions", None)(12, _rng())
    prefixes = [tuple(r.prompt[:32]) for r in reqs]
    assert len(set(prefixes)) == 3
    assert sorted(prefixes.count(p) for p in set(prefixes)) == [4, 4, 4]  # spread evenly
    assert len({tuple(r.prompt[32:]) for r in reqs}) == 12  # unique suffixes
    assert all(r.prompt_len == len(r.prompt) == 40 and r.output_len == 5 for r in reqs)


def test_shared_prefix_chat_uses_system_message(tokenizer_dir):
    cfg = DatasetConfig(dataset="shared-prefix", num_prefixes=2, prefix_len=24, input_len=6, tokenizer=tokenizer_dir)
    reqs = make_sampler(cfg, "chat", load_tokenizer(tokenizer_dir))(6, _rng())
    assert len({r.system for r in reqs}) == 2
    assert all(isinstance(r.prompt, str) and r.system for r in reqs)


def test_text_prompts_have_exact_token_counts(tokenizer_dir):
    tok = load_tokenizer(tokenizer_dir)
    cfg = DatasetConfig(input_len=50, output_len=4, tokenizer=tokenizer_dir)
    reqs = make_sampler(cfg, "completions", tok)(20, _rng())
    assert all(isinstance(r.prompt, str) and r.is_prompt_len_exact for r in reqs)
    assert [len(tok.encode(r.prompt)) for r in reqs] == [50] * 20
    assert all(r.prompt_len == 50 for r in reqs)
    special = {0, 1}  # <s>, </s>
    ids = make_sampler(DatasetConfig(prompt_format="ids", input_len=64), "completions", tok)(5, _rng())
    assert all(len(r.prompt) == 64 and not special & set(r.prompt) for r in ids)


def test_text_without_tokenizer_is_an_estimate():
    reqs = make_sampler(DatasetConfig(input_len=30), "chat", None)(3, _rng())
    assert all(isinstance(r.prompt, str) and len(r.prompt) == 30 and not r.is_prompt_len_exact for r in reqs)


def test_sharegpt(tmp_path, tokenizer_dir):
    convs = [
        {"id": "a", "conversations": [{"from": "human", "value": "the quick brown fox jumps over the lazy dog"},
                                      {"from": "gpt", "value": "hello world hello world hello world hello"}]},
        {"id": "too short", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
        {"id": "no reply", "conversations": [{"from": "human", "value": "the quick brown fox jumps"}]},
        {"id": "b", "conversations": [{"from": "system", "value": "x"}, {"from": "human", "value": "y"}]},
    ]
    path = tmp_path / "sg.json"
    path.write_text(json.dumps(convs))
    tok = load_tokenizer(tokenizer_dir)
    cfg = DatasetConfig(dataset="sharegpt", dataset_path=str(path), tokenizer=tokenizer_dir)
    reqs = make_sampler(cfg, "completions", tok)(5, _rng())
    assert len(reqs) == 5 and {r.prompt for r in reqs} == {convs[0]["conversations"][0]["value"]}
    assert reqs[0].output_len == len(tok.encode(convs[0]["conversations"][1]["value"]))
    ids = make_sampler(DatasetConfig(dataset="sharegpt", dataset_path=str(path), prompt_format="ids"), "completions", tok)
    assert ids(1, _rng())[0].prompt == tok.encode(convs[0]["conversations"][0]["value"])
    path.write_text(json.dumps(convs[1:]))
    with pytest.raises(ValueError, match="no usable conversation"):
        make_sampler(cfg, "completions", tok)


def test_jsonl(tmp_path):
    path = tmp_path / "reqs.jsonl"
    path.write_text('{"prompt": "hello there", "output_len": 3}\n\n{"prompt": [1, 2, 3], "max_tokens": 5}\n'
                    '{"prompt": "no length"}\n')
    cfg = DatasetConfig(dataset="jsonl", dataset_path=str(path), output_len=9, prompt_format="ids")
    with pytest.raises(ValueError, match="needs --tokenizer"):
        make_sampler(cfg, "completions", None)
    cfg = DatasetConfig(dataset="jsonl", dataset_path=str(path), output_len=9, prompt_format="text")
    with pytest.raises(ValueError, match="needs --tokenizer"):  # line 3's token ids cannot become text
        make_sampler(cfg, "completions", None)
    path.write_text('{"prompt": "hello there", "output_len": 3}\n{"prompt": "no length"}\n')
    reqs = make_sampler(DatasetConfig(dataset="jsonl", dataset_path=str(path), output_len=9), "chat", None)(3, _rng())
    assert [(r.prompt, r.output_len) for r in reqs] == [("hello there", 3), ("no length", 9), ("hello there", 3)]
    path.write_text('{"prompt": [1, 2, 3], "max_tokens": 5}\n')
    reqs = make_sampler(DatasetConfig(dataset="jsonl", dataset_path=str(path)), "completions", None)(1, _rng())
    assert (reqs[0].prompt, reqs[0].prompt_len, reqs[0].output_len) == ([1, 2, 3], 3, 5)
    path.write_text('{"prompt": "x", "output_len": 0}\n')
    with pytest.raises(ValueError, match=":1: output_len"):
        make_sampler(DatasetConfig(dataset="jsonl", dataset_path=str(path)), "completions", None)
