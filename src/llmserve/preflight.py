"""Checks of an engine config against the model's files and the machine, cheap enough to run before torch
and the model load: a wrong path or flag fails in a second with one line naming the flag, not after a minute
of loading. The engine checks the same things again while it loads (for configs that do not come through
the command line)."""

from __future__ import annotations

import json
import os

from llmserve.config import EngineConfig, check, is_local_model
from llmserve.model import cpu_isa
from llmserve.model.lora_adapter import AdapterError, base_shapes, check_adapter
from llmserve.model.shapes import SHAPES

DEMO_SHAPE = "demo"  # the shape of the embedded demo model (model/demo.py), served when --model is unset
CPU_ONLY_KV_DTYPES = ("fp16", "int8")  # read by the CPU attention kernel only, from float32 models


def read_model_config(model: str | None, flag: str, revision: str | None = None) -> dict | None:
    """The checkpoint's config.json as a dict: from a local directory, or from the hub cache for a hub id
    already downloaded (None: not downloaded yet, or the demo model). A missing directory is an error."""
    if model is None:
        return None
    if not is_local_model(model):
        return _cached_hub_config(model, revision)
    path = os.path.expanduser(model)
    check(os.path.isdir(path), flag, f"directory {model!r} does not exist")
    config_path = os.path.join(path, "config.json")
    check(os.path.isfile(config_path), flag, f"{model!r} has no config.json (not a Hugging Face checkpoint)")
    return _read_json(config_path, flag)


def _cached_hub_config(model: str, revision: str | None) -> dict | None:
    try:
        from huggingface_hub import try_to_load_from_cache

        path = try_to_load_from_cache(model, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - an id the hub would refuse: the loader says why, with the hub's answer
        return None
    return _read_json(path, "model") if isinstance(path, str) else None


def _read_json(path: str, flag: str) -> dict:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"--{flag}: cannot read {path}: {e}") from None


def model_length_limit(config: EngineConfig) -> int | None:
    """The model's max_position_embeddings (the demo model's from its shape), None where unknown."""
    if config.model.model is None:
        return SHAPES[DEMO_SHAPE].max_position
    hf_config = read_model_config(config.model.model, "model", config.model.revision)
    return None if hf_config is None else hf_config.get("max_position_embeddings")


def check_before_loading(config: EngineConfig) -> None:
    """Every check that needs no torch: the config's own values, the model's and draft's directories, the
    context length against the model's limit, the KV cache dtype against the dtype the engine would run."""
    limit = model_length_limit(config)
    max_model_len = config.model.max_model_len
    check(max_model_len is None or limit is None or max_model_len <= limit, "max-model-len",
          f"{max_model_len} is past this model's limit of {limit} tokens (max_position_embeddings)")
    config.validate(max_model_len or limit)  # the KV blocks must hold one whole sequence of that length
    if config.model.tokenizer is not None and is_local_model(config.model.tokenizer):
        check(os.path.isdir(os.path.expanduser(config.model.tokenizer)), "tokenizer",
              f"directory {config.model.tokenizer!r} does not exist")
    read_model_config(config.speculative.draft_model, "draft-model")
    check_kv_cache_dtype(config)
    check_lora_modules(config)


def check_lora_modules(config: EngineConfig) -> None:
    """Each --lora-modules adapter is a PEFT LoRA that fits the model (its config and tensor shapes; the shapes
    only where the model's config.json is at hand)."""
    if not config.lora.lora_modules:
        return
    hf_config = read_model_config(config.model.model, "model", config.model.revision)
    shapes = None if hf_config is None else base_shapes(hf_config)
    for name, path in config.lora.modules().items():
        try:
            check_adapter(os.path.expanduser(path), shapes, config.lora.max_lora_rank)
        except AdapterError as e:
            raise ValueError(f"--lora-modules: {name}: {e}") from None


def check_kv_cache_dtype(config: EngineConfig) -> None:
    """fp16 and int8 KV caches are read by the CPU attention kernel, from float32 models only: refuse them
    where the device or dtype is known without torch (`--dtype auto` is bfloat16 on CUDA and on CPUs with
    fast bf16; which device `--device auto` picks needs torch, so the engine checks that case)."""
    kv_dtype, model = config.cache.kv_cache_dtype, config.model
    if kv_dtype not in CPU_ONLY_KV_DTYPES:
        return
    check(not model.device.startswith("cuda"), "kv-cache-dtype",
          f"{kv_dtype} is read by the CPU attention kernel only, not on --device {model.device}: use auto"
          + (" or fp8" if kv_dtype == "fp16" else ""))
    is_auto_bf16 = model.dtype == "auto" and cpu_isa.has_fast_bf16()
    dtype = "bfloat16" if is_auto_bf16 else model.dtype
    how = " (--dtype auto on this CPU, which has fast bf16)" if is_auto_bf16 else ""
    check(dtype in ("auto", "float32"), "kv-cache-dtype",
          f"{kv_dtype} needs a float32 model; this one would run {dtype}{how}: add --dtype float32, "
          "or use --kv-cache-dtype auto")
