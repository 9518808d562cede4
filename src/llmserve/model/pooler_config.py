"""The pooling an embedding checkpoint asks for, read as vLLM reads it.

1. A sentence-transformers folder (modules.json): its Pooling module's mode (1_Pooling/config.json) and
   whether a Normalize module follows; modules that change the vector otherwise (Dense, ...) are refused.
2. Otherwise a decoder used as an embedder (Qwen3-Embedding): the last token's hidden state, normalised.
3. `--pooler-config` (JSON: pooling_type, normalize) overrides either.
config.json's `is_matryoshka` / `matryoshka_dimensions` say whether requests may truncate (`dimensions`).
"""

from __future__ import annotations

import dataclasses
import json
import os

from llmserve.model.registry import BARE_DECODERS
from llmserve.pooling import POOLING_TYPES, PoolerConfig, parse_pooler_override

_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
_ST_TRANSFORMER = "sentence_transformers.models.Transformer"
# 1_Pooling/config.json's mode flags -> our pooling types; the other modes are refused by name
_ST_MODES = {"pooling_mode_cls_token": "CLS", "pooling_mode_mean_tokens": "MEAN", "pooling_mode_lasttoken": "LAST"}
_ST_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                         "pooling_mode_weightedmean_tokens")
def resolve_pooler_config(path: str, hf_config, override: str | None = None) -> PoolerConfig:
    """The checkpoint's pooling (sentence-transformers files, else last token normalised), then `override`."""
    config = _sentence_transformers_pooler(path) or PoolerConfig()
    config = dataclasses.replace(config, matryoshka_dimensions=_matryoshka_dimensions(hf_config),
                                 **parse_pooler_override(override))
    config.validate()
    return config


def _matryoshka_dimensions(hf_config) -> tuple[int, ...] | None:
    dimensions = getattr(hf_config, "matryoshka_dimensions", None)
    if dimensions:
        return tuple(int(d) for d in dimensions)
    return () if getattr(hf_config, "is_matryoshka", False) else None


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def is_sentence_transformers(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "modules.json"))


def is_embedding_checkpoint(path: str) -> bool:
    """What --runner auto serves as pooling: a sentence-transformers folder, or a bare decoder (transformers'
    AutoModel saved without an lm_head, e.g. Qwen3Model: config.json's own name, which load_hf_config renames),
    as vLLM's auto takes an architecture named *Model."""
    if is_sentence_transformers(path):
        return True
    architectures = _read_json(os.path.join(path, "config.json")).get("architectures") or [None]
    return architectures[0] in BARE_DECODERS


def _sentence_transformers_pooler(path: str) -> PoolerConfig | None:
    if not is_sentence_transformers(path):
        return None
    modules = _read_json(os.path.join(path, "modules.json"))
    types = [m.get("type") for m in modules]
    for kind in types:
        if kind not in (_ST_TRANSFORMER, _ST_POOLING, _ST_NORMALIZE):
            raise ValueError(f"modules.json: the sentence-transformers module {kind!r} is not supported "
                             f"(supported: Transformer, Pooling, Normalize)")
    pooling = [m for m in modules if m.get("type") == _ST_POOLING]
    if not pooling:
        return PoolerConfig(normalize=_ST_NORMALIZE in types)
    pooling_file = os.path.join(path, pooling[0].get("path", ""), "config.json")
    return PoolerConfig(pooling_type=_st_pooling_type(_read_json(pooling_file), pooling_file),
                        normalize=_ST_NORMALIZE in types)


def _st_pooling_type(settings: dict, where: str) -> str:
    for key in _ST_UNSUPPORTED_MODES:
        if settings.get(key):
            raise ValueError(f"{where}: {key} is not supported (supported: {', '.join(_ST_MODES)})")
    if settings.get("include_prompt") is False:
        raise ValueError(f"{where}: include_prompt false is not supported")
    modes = [kind for key, kind in _ST_MODES.items() if settings.get(key)]
    if len(modes) != 1:
        raise ValueError(f"{where}: exactly one pooling mode must be on, of {', '.join(_ST_MODES)}; got {modes}")
    assert modes[0] in POOLING_TYPES
    return modes[0]
