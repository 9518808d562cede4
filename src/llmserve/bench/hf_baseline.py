"""The naive reference for `llmserve bench offline --baseline hf`: transformers' generate() in static batches.

Requests run in their given order, `batch_size` at a time, left-padded; every row of a batch generates
the batch's longest output length (min_new_tokens = max_new_tokens, so EOS cannot end it early), as
static batching does. Throughput counts the tokens the requests asked for, over the wall time.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}


@dataclass(frozen=True)
class HFBaselineResult:
    num_requests: int
    num_batches: int
    batch_size: int
    elapsed_s: float
    num_prompt_tokens: int
    num_output_tokens: int  # what the requests asked for
    num_generated_tokens: int  # what the static batches computed (rows x the batch's longest output)
    request_throughput: float  # requests / s
    output_throughput: float  # num_output_tokens / s
    total_token_throughput: float  # (num_prompt_tokens + num_output_tokens) / s
    dtype: str  # the model's, e.g. float32


def run_hf_baseline(model: str, requests: Sequence[tuple[list[int], int]], batch_size: int = 8,
                    device: str = "auto", dtype: str = "auto", is_warmup: bool = True) -> HFBaselineResult:
    """Run (prompt_token_ids, output_len) pairs through AutoModelForCausalLM.generate() in static batches."""
    _validate(requests, batch_size)
    import torch

    hf_model, device_ = _load(model, device, dtype)
    pad_id = _pad_id(hf_model)
    batches = [list(requests[i:i + batch_size]) for i in range(0, len(requests), batch_size)]
    if is_warmup:
        _generate(hf_model, [(requests[0][0], 1)], pad_id, device_)
    _sync(torch, device_)
    start = time.perf_counter()
    num_generated = sum(_generate(hf_model, batch, pad_id, device_) for batch in batches)
    _sync(torch, device_)
    return _result(requests, len(batches), batch_size, time.perf_counter() - start, num_generated,
                   str(hf_model.dtype).removeprefix("torch."))


def _validate(requests: Sequence[tuple[list[int], int]], batch_size: int) -> None:
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if not requests:
        raise ValueError("no requests to run")
    for i, (prompt, output_len) in enumerate(requests):
        if not prompt or output_len < 1:
            raise ValueError(f"request {i}: needs a non-empty prompt and output_len >= 1, got {len(prompt)}, {output_len}")


def _load(model: str, device: str, dtype: str):
    import torch
    import transformers

    device_ = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    if dtype == "auto":  # the engine's own choice, so both sides of a comparison run one dtype
        from llmserve.model.loader import resolve_dtype

        torch_dtype = resolve_dtype("auto", device_)
    elif dtype in _DTYPES:
        torch_dtype = getattr(torch, _DTYPES[dtype])
    else:
        raise ValueError(f"dtype must be auto or one of {list(_DTYPES)}, got {dtype!r}")
    major, minor = (int(p) for p in transformers.__version__.split(".")[:2])
    dtype_key = "dtype" if (major, minor) >= (4, 56) else "torch_dtype"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model, **{dtype_key: torch_dtype})
    return hf_model.to(device_).eval(), device_


def _pad_id(hf_model) -> int:
    config = hf_model.generation_config
    for candidate in (config.pad_token_id, config.eos_token_id, 0):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if candidate is not None:
            return int(candidate)
    return 0


def _generate(hf_model, batch: list[tuple[list[int], int]], pad_id: int, device: str) -> int:
    """One static batch, left-padded; returns the tokens it generated (rows x longest output)."""
    import torch

    width = max(len(p) for p, _ in batch)
    num_new = max(n for _, n in batch)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p, _ in batch], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=device)
    with torch.inference_mode():
        out = hf_model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=num_new, min_new_tokens=num_new,
                                do_sample=False, pad_token_id=pad_id)
    return int(out.shape[0] * (out.shape[1] - width))


def _sync(torch, device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _result(requests: Sequence[tuple[list[int], int]], num_batches: int, batch_size: int, elapsed_s: float,
            num_generated: int, dtype: str) -> HFBaselineResult:
    num_prompt = sum(len(p) for p, _ in requests)
    num_output = sum(n for _, n in requests)
    return HFBaselineResult(
        num_requests=len(requests), num_batches=num_batches, batch_size=batch_size, elapsed_s=elapsed_s,
        num_prompt_tokens=num_prompt, num_output_tokens=num_output, num_generated_tokens=num_generated,
        request_throughput=len(requests) / elapsed_s, output_throughput=num_output / elapsed_s,
        total_token_throughput=(num_prompt + num_output) / elapsed_s, dtype=dtype,
    )
