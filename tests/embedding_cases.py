"""Embedding checkpoints for the pooling tests, made as embedding models are saved (transformers' AutoModel:
a bare decoder, no lm_head), and transformers' own pooled vectors to compare ours with."""

from __future__ import annotations

import json
import os

import torch

from llmserve.testing import toy_tokenizer
from llmserve.testing.maker import build_config
from llmserve.model.shapes import SHAPES

ATOL = 1e-4  # float32 on both sides


def embedding_checkpoint(arch: str, out_dir: str, seed: int = 1, **config_fields) -> str:
    """A random-weight bare decoder of the tiny shape (Qwen3Model, LlamaModel) saved by transformers, with the
    toy tokenizer; `config_fields` go into config.json (e.g. is_matryoshka=True)."""
    from transformers import AutoModel

    shape = SHAPES["tiny"]
    config = build_config(arch, shape, "float32")
    for key, value in config_fields.items():
        setattr(config, key, value)
    torch.manual_seed(seed)
    model = AutoModel.from_config(config, dtype=torch.float32)
    model.save_pretrained(out_dir)
    toy_tokenizer.save_tokenizer(out_dir, shape.vocab_size, shape.max_position)
    return out_dir


def write_sentence_transformers(path: str, mode: str, normalize: bool) -> None:
    """modules.json and 1_Pooling/config.json as sentence-transformers writes them (`mode`: its flag's suffix,
    e.g. mean_tokens, cls_token, lasttoken, max_tokens)."""
    modules = [{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
               {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}]
    if normalize:
        modules.append({"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"})
    with open(os.path.join(path, "modules.json"), "w") as f:
        json.dump(modules, f)
    os.makedirs(os.path.join(path, "1_Pooling"), exist_ok=True)
    modes = ("cls_token", "mean_tokens", "max_tokens", "mean_sqrt_len_tokens", "weightedmean_tokens", "lasttoken")
    pooling = {"word_embedding_dimension": SHAPES["tiny"].hidden_size, "include_prompt": True,
               **{f"pooling_mode_{m}": m == mode for m in modes}}
    with open(os.path.join(path, "1_Pooling", "config.json"), "w") as f:
        json.dump(pooling, f)


def hf_embedding(hf, prompt: list[int], pooling: str, normalize: bool) -> torch.Tensor:
    """transformers' last hidden states of one prompt [H], pooled: LAST, MEAN or CLS."""
    with torch.no_grad():
        hidden = hf(torch.tensor([prompt])).last_hidden_state[0]  # [T, H]
    vector = {"LAST": hidden[-1], "MEAN": hidden.mean(dim=0), "CLS": hidden[0]}[pooling]
    return torch.nn.functional.normalize(vector, dim=-1) if normalize else vector


def load_hf(path: str):
    from transformers import AutoModel

    return AutoModel.from_pretrained(path, dtype=torch.float32).eval()
