"""From a model name to a ready model: resolve the path (local dir or hub id), pick the dtype,
build the model on the meta device and stream its safetensors in, load the tokenizer (with its chat
template) and the generation defaults, and summarise the model in a ModelInfo record.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from llmserve.config import is_local_model
from llmserve.model import cpu_isa
from llmserve.model.huge_pages import move_to_huge_pages
from llmserve.model.linear import pack_linears
from llmserve.model.moe_cpu import pack_model_experts
from llmserve.model.parallel import TensorParallel, is_read, shard_of
from llmserve.model.pooler_config import resolve_pooler_config
from llmserve.model.registry import BARE_DECODERS, architecture_of, get_model_class
from llmserve.model.sliding_window import layer_windows
from llmserve.pooling import PoolerConfig

HUB_ALLOW_PATTERNS = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
                      "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                      "vocab.json", "merges.txt", "chat_template.jinja", "chat_template.json"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
UNLIMITED_TOKENS = int(1e30)  # transformers' own value for a tokenizer without a length limit
_GENERATION_KEYS = ("temperature", "top_p", "top_k", "repetition_penalty", "eos_token_id", "max_new_tokens")


def resolve_model_path(model: str, revision: str | None = None, allow_patterns: list[str] | None = None) -> str:
    """A local directory as is; otherwise download the hub id's config, weights and tokenizer files (or the files
    `allow_patterns` names).

    ValueError (naming the id) when the directory is missing or the hub cannot provide the model.
    """
    if is_local_model(model):
        path = os.path.expanduser(model)
        if not os.path.isdir(path):
            raise ValueError(f"model directory {model!r} does not exist")
        return path
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, HFValidationError, LocalEntryNotFoundError
    try:
        return snapshot_download(model, revision=revision, allow_patterns=allow_patterns or HUB_ALLOW_PATTERNS)
    except (HfHubHTTPError, HFValidationError, LocalEntryNotFoundError, OSError) as e:
        rev = f" at revision {revision!r}" if revision else ""
        raise ValueError(f"cannot get model {model!r}{rev} from the Hugging Face hub "
                         f"(not a local directory, and the hub failed: {type(e).__name__}: {e})") from e


def resolve_dtype(dtype: str, device: torch.device | str) -> torch.dtype:
    """'auto' -> bfloat16 on CUDA, bfloat16 on a CPU whose bf16 dot products oneDNN may use (AMX or
    AVX512-BF16, not capped below by ONEDNN_MAX_CPU_ISA: `cpu_isa.has_fast_bf16`), else float32."""
    if dtype in _DTYPES:
        return _DTYPES[dtype]
    if dtype != "auto":
        raise ValueError(f"unknown dtype {dtype!r}; choose one of auto, {', '.join(_DTYPES)}")
    if torch.device(device).type == "cuda":
        return torch.bfloat16
    return torch.bfloat16 if cpu_isa.has_fast_bf16() else torch.float32


def load_hf_config(path: str):
    """The checkpoint's transformers config; a bare decoder's architecture (BARE_DECODERS) named as its
    causal LM's, whose decoder reads it."""
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(path)
    archs = getattr(config, "architectures", None)
    if archs and archs[0] in BARE_DECODERS:
        config.architectures = [BARE_DECODERS[archs[0]], *archs[1:]]
    return config


def _safetensors_files(path: str) -> list[str]:
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path!r} (other weight formats are not supported; "
                         "--load-format dummy runs random weights)")
    return files


ShardOf = Callable[[str], "tuple[int, int, int] | None"]


def iter_safetensors(path: str, shard_of: ShardOf | None = None,
                     is_wanted: Callable[[str], bool] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) of every *.safetensors file of a directory, one tensor at a time.

    shard_of(name) -> (dim, start, length): only that slice is read from the file (a tensor-parallel
    rank's share, model/parallel.py); None: the whole tensor. is_wanted(name) False: not read at all
    (another rank's experts)."""
    from safetensors import safe_open
    for file in _safetensors_files(path):
        with safe_open(file, framework="pt", device="cpu") as f:
            for name in f.keys():
                if is_wanted is not None and not is_wanted(name):
                    continue
                spec = shard_of(name) if shard_of is not None else None
                if spec is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, length = spec
                part = f.get_slice(name)
                yield name, part[start:start + length] if dim == 0 else part[:, start:start + length]


def load_model(path: str, dtype: torch.dtype, device: torch.device | str,
               max_model_len: int | None = None, tp: TensorParallel | None = None,
               quantization: str | None = None, pack_head: bool = True, has_lm_head: bool = True,
               load_format: str = "auto"):
    """Build the config's architecture on `device` in `dtype` and load its safetensors weights
    (with tensor parallelism, this rank's slices of them).

    An FP8 checkpoint (and gpt-oss's MXFP4 experts) is dequantized as it streams in; `quantization` (int8 |
    fp8 | None, see resolve_quantization) then swaps the Linear layers for quantized ones (model/quant).
    pack_head=False keeps the lm_head's weight plain (a draft whose reduced head takes some of its rows:
    spec/draft_head); has_lm_head=False: an embedding model's decoder only (--runner pooling);
    load_format="dummy": no weights read, random ones made on the device (`fill_dummy_weights`)."""
    from llmserve.model import quant

    config = load_hf_config(path)
    cls = get_model_class(architecture_of(config))
    with torch.device("meta"), _no_initial_values():
        model = cls(config, max_model_len=max_model_len, tp=tp, has_lm_head=has_lm_head)
    model = model.to(dtype=dtype).to_empty(device=device)
    for module in model.modules():  # a router transformers keeps float32 (DeepSeek's): its choice would move
        if getattr(module, "is_float32", False):
            module.float()
    if load_format == "dummy":
        fill_dummy_weights(model)
    else:
        _load_checkpoint(model, path, config)
    if quantization is not None:
        quant.quantize_model(model, quantization)
    model = model.eval().requires_grad_(False)
    pack_linears(model, pack_head)  # float32 on CPU: weights laid out once (model/linear.py)
    pack_model_experts(model)  # float32 experts on CPU: each laid out as a dense layer (model/moe_cpu.py)
    if torch.device(device).type == "cpu":
        move_to_huge_pages(model)  # what a decode step streams, on 2 MiB pages (model/huge_pages.py)
    return model


def fill_dummy_weights(model: torch.nn.Module, seed: int = 0) -> None:
    """Every parameter uniform in [-1e-3, 1e-3] (vLLM's dummy weights), drawn on its device: what a benchmark of
    speed needs, in the time of a few kernels (an 8B checkpoint takes minutes to write and read)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point():
                param.uniform_(-1e-3, 1e-3, generator=gen)


def _load_checkpoint(model: torch.nn.Module, path: str, config) -> None:
    """The checkpoint's safetensors into the model (with tensor parallelism, this rank's slices)."""
    from llmserve.model import quant
    from llmserve.model.quant import mxfp4
    from llmserve.model.quant.parallel import rank_slices
    from llmserve.model.quant.checkpoint import weight_block_size

    layout = model.layout
    rank_slice = None if layout is None else lambda name: shard_of(name, layout)
    is_fp8_checkpoint = quant.checkpoint_method(config) is not None
    # an FP8 checkpoint's block scales do not cut like its weights: a rank reads both whole and cuts the
    # dequantized weight (model/quant/parallel.py)
    weights = iter_safetensors(path, None if is_fp8_checkpoint else rank_slice,
                               None if layout is None else lambda name: is_read(name, layout))
    weights = _with_model_prefix(weights)
    if is_fp8_checkpoint:
        weights = quant.dequantize_weights(weights, weight_block_size(config))
        if rank_slice is not None:
            weights = rank_slices(weights, rank_slice)
    if mxfp4.is_mxfp4(config):
        weights = mxfp4.dequantize_experts(weights)
    model.load_weights(weights)


_BARE_DECODER_PARTS = ("embed_tokens.", "layers.", "norm.")  # a decoder's own modules, saved without `model.`


def _with_model_prefix(weights: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """A bare decoder's tensors (`layers.0...`, saved from AutoModel) under the causal LM's `model.` names."""
    for name, tensor in weights:
        yield (f"model.{name}" if name.startswith(_BARE_DECODER_PARTS) else name), tensor


_INIT_FUNCTIONS = ("normal_", "uniform_", "kaiming_uniform_", "kaiming_normal_", "trunc_normal_", "xavier_uniform_",
                   "xavier_normal_", "ones_", "zeros_", "constant_")


@contextlib.contextmanager
def _no_initial_values():
    """torch.nn.init's functions as no-ops while a model is built on the meta device, whose tensors hold no
    values: on meta tensors they run through torch's reference ops, which import torch._dynamo (0.9 s of
    every engine process's start, measured on the tiny model). The checkpoint sets every weight after."""
    saved = {name: getattr(torch.nn.init, name) for name in _INIT_FUNCTIONS}
    try:
        for name in _INIT_FUNCTIONS:
            setattr(torch.nn.init, name, _keep)
        yield
    finally:
        for name, function in saved.items():
            setattr(torch.nn.init, name, function)


def _keep(tensor: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    return tensor


def resolve_quantization(requested: str | None, path: str) -> str | None:
    """--quantization against the checkpoint: unset = the checkpoint's own method, 'none' = None.

    ValueError when the checkpoint's quantization_config is one llmserve cannot load."""
    from llmserve.model import quant

    own = quant.checkpoint_method(load_hf_config(path))
    if requested is None:
        return own
    return None if requested == "none" else requested


def _read_json(path: str) -> dict:
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def _read_chat_template(path: str) -> str | None:
    jinja = os.path.join(path, "chat_template.jinja")
    if os.path.isfile(jinja):
        with open(jinja) as f:
            return f.read()
    return _read_json(os.path.join(path, "tokenizer_config.json")).get("chat_template")


def load_tokenizer(path: str):
    """The transformers tokenizer of a directory, with its chat template when it has one. Its own length
    limit is lifted: the engine refuses a prompt past max_model_len itself (a 400 on the server), and
    transformers would only log a warning about indexing errors for it."""
    from transformers import AutoTokenizer
    tokenizer = AutoTokenizer.from_pretrained(path)
    tokenizer.model_max_length = UNLIMITED_TOKENS
    if not getattr(tokenizer, "chat_template", None):
        template = _read_chat_template(path)
        if template:
            tokenizer.chat_template = template
    return tokenizer


def load_generation_defaults(path: str) -> dict:
    """The sampling defaults of generation_config.json (only the keys it sets); {} without one."""
    config = _read_json(os.path.join(path, "generation_config.json"))
    return {k: config[k] for k in _GENERATION_KEYS if config.get(k) is not None}


@dataclass(frozen=True)
class ModelInfo:
    name: str
    path: str
    architecture: str
    vocab_size: int
    max_model_len: int
    eos_token_ids: list[int]
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    dtype: str  # "float32" | "bfloat16" | "float16"
    quantization: str | None = None  # "int8" | "fp8" | None (resolved: see resolve_quantization)
    layer_windows: tuple[int, ...] = ()  # [num_layers] each layer's sliding window at max_model_len (0: full)
    pooler: PoolerConfig | None = None  # --runner pooling: how prompts become vectors; None: a generate runner


def _as_id_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


def eos_token_ids(config, path: str) -> list[int]:
    """The config's eos ids, then generation_config.json's, without repeats."""
    ids = _as_id_list(getattr(config, "eos_token_id", None))
    ids += _as_id_list(load_generation_defaults(path).get("eos_token_id"))
    return list(dict.fromkeys(ids))


def load_model_info(name: str, path: str, dtype: torch.dtype, max_model_len: int | None = None,
                    quantization: str | None = None, disable_sliding_window: bool = False,
                    is_pooling: bool = False, pooler_override: str | None = None) -> ModelInfo:
    """Summarise a checkpoint directory; max_model_len defaults to max_position_embeddings (to the smallest
    sliding window under disable_sliding_window); quantization: --quantization (unset: the checkpoint's);
    is_pooling: --runner pooling, whose pooling the checkpoint and `pooler_override` (--pooler-config) say."""
    config = load_hf_config(path)
    limit = config.max_position_embeddings
    if max_model_len is not None and not 0 < max_model_len <= limit:
        raise ValueError(f"max_model_len {max_model_len} must be in 1..{limit} (max_position_embeddings)")
    if disable_sliding_window:
        limit = _full_attention_limit(config, max_model_len, limit)
    architecture = architecture_of(config)
    return ModelInfo(
        name=name, path=path, architecture=architecture, vocab_size=config.vocab_size,
        max_model_len=max_model_len or limit, eos_token_ids=eos_token_ids(config, path),
        num_layers=config.num_hidden_layers, num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        hidden_size=config.hidden_size, dtype=str(dtype).removeprefix("torch."),
        quantization=resolve_quantization(quantization, path),
        layer_windows=tuple(layer_windows(config, architecture, max_model_len or limit)),
        pooler=resolve_pooler_config(path, config, pooler_override) if is_pooling else None)


def _full_attention_limit(config, max_model_len: int | None, limit: int) -> int:
    """The longest context under --disable-sliding-window (vLLM's meaning): at most the smallest window, where
    full attention equals the model's own; ValueError when max_model_len asks for more."""
    windows = [w for w in layer_windows(config, architecture_of(config), limit) if w > 0]
    if not windows:
        return limit
    if max_model_len is not None and max_model_len > min(windows):
        raise ValueError(f"max_model_len {max_model_len} exceeds the sliding window {min(windows)}: "
                         "--disable-sliding-window caps the context to it")
    return min(windows)
