"""`llmserve bench roofline`: batch-1 decode against the memory-bandwidth roofline of the device.

A batch-1 decode step reads every weight once and the request's whole KV cache once, and does little
else, so its floor is (weight bytes + KV bytes) / memory bandwidth. This measures the device's copy
bandwidth (a large device-to-device copy: bytes read + bytes written per second), then the engine's
batch-1 decode speed (a prompt, then `output_len` tokens with ignore_eos, minus a prompt-only run of
the same request), and reports bytes moved per step over step time as a share of that bandwidth.
The engine is set by the engine's own flags, as `serve`'s; each timed run has a prompt of its own, so a
prefix cache gives the full run no head start over the prompt-only one.
"""

from __future__ import annotations

import dataclasses
import random
import statistics
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING

from llmserve.bench.command import add_bench_command
from llmserve.config import EngineConfig, engine_kwargs

if TYPE_CHECKING:  # torch loads when the benchmark runs, not when the CLI builds its parser
    import torch


@dataclass(frozen=True)
class RooflineBenchConfig:
    """The measurement; the engine's settings are the engine's own flags (`engine`), as `serve`'s (with
    --max-num-seqs 1 and --max-model-len the run's length where they are not given)."""

    engine: EngineConfig = field(default_factory=EngineConfig, metadata={"engine": True})
    arch: str = field(default="llama", metadata={"help": "architecture of the made checkpoint (without a model)"})
    shape: str = field(default="smollm2-135m", metadata={"help": "shape of the made checkpoint (without a model)"})
    prompt_len: int = field(default=128, metadata={"help": "prompt tokens"})
    output_len: int = field(default=256, metadata={"help": "decoded tokens per run"})
    repeats: int = field(default=3, metadata={"help": "timed runs (the median is reported)"})
    copy_mib: int = field(default=1024, metadata={"help": "size of the bandwidth probe's copy"})
    out: str | None = field(default=None, metadata={"help": "write the results JSON here"})

    def __post_init__(self) -> None:
        if self.output_len < 2:
            raise ValueError(f"--output-len must be at least 2 (a decode step after the first token), got "
                             f"{self.output_len}")
        max_model_len = self.engine.model.max_model_len
        if max_model_len is not None and max_model_len < self.num_tokens:
            raise ValueError(f"--max-model-len {max_model_len} is shorter than the run ({self.num_tokens} tokens: "
                             f"--prompt-len + --output-len)")

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + self.output_len


def _sync(device: torch.device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def copy_bandwidth(device: torch.device, num_bytes: int, repeats: int = 10) -> float:
    """Bytes read + written per second by one large on-device copy (median of `repeats`)."""
    import torch

    src = torch.ones(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    return 2 * num_bytes / statistics.median(times)


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Weight bytes a decode step reads: every multiplied weight once, at its own element size (a
    quantized layer keeps 1-byte weights and small float scales in buffers); of a Mixture-of-Experts
    layer's stacked experts only the top_k of E that one token runs (the router and dense parts in full)."""
    total = _tensor_bytes(model) - inactive_expert_bytes(model)
    if getattr(model, "lm_head", None) is None:  # tied: the table is also the lm_head
        return total
    embed = model.model.embed_tokens.weight
    return total - embed.numel() * embed.element_size()


def _tensor_bytes(module: torch.nn.Module) -> int:
    tensors = list(module.parameters()) + list(module.buffers())
    return sum(t.numel() * t.element_size() for t in tensors)


def inactive_expert_bytes(model: torch.nn.Module) -> int:
    """Bytes of the experts a decode token skips: (E - top_k) / E of each MoE layer's stacked experts."""
    from llmserve.model.moe import SparseMoeBlock

    blocks = [m for m in model.modules() if isinstance(m, SparseMoeBlock)]
    return round(sum(_tensor_bytes(b.experts) * (1 - b.spec.top_k / b.spec.num_experts) for b in blocks))


def bytes_per_decode_step(weight_bytes: int, kv_bytes_per_token: int, context_len: float) -> float:
    """Weights once (an MoE layer's active experts only) plus the request's KV once (the new token's K/V write is negligible)."""
    return weight_bytes + kv_bytes_per_token * context_len


def device_name(device: torch.device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    with open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "cpu")
    return f"{model}, {torch.get_num_threads()} threads"


def _timed_generate(llm, prompt: list[int], max_tokens: int) -> float:
    from llmserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    _sync(llm.engine.device)
    start = time.perf_counter()
    out = llm.generate([prompt], params)
    _sync(llm.engine.device)
    assert len(out[0].outputs[0].token_ids) == max_tokens
    return time.perf_counter() - start


def decode_seconds_per_token(llm, prompts: Iterator[list[int]], output_len: int, repeats: int) -> float:
    """Median over runs of (time for prompt + output_len tokens - time for another prompt + 1 token) /
    (output_len - 1); every run has a prompt of its own (a cached prefix would shorten the full run's prefill)."""
    _timed_generate(llm, next(prompts), 4)  # warm-up
    samples = []
    for _ in range(repeats):
        prefill = _timed_generate(llm, next(prompts), 1)
        full = _timed_generate(llm, next(prompts), output_len)
        samples.append((full - prefill) / (output_len - 1))
    return statistics.median(samples)


def random_prompts(prompt_len: int, vocab_size: int, seed: int = 0) -> Iterator[list[int]]:
    rng = random.Random(seed)
    while True:
        yield [rng.randrange(10, vocab_size) for _ in range(prompt_len)]


def run(cfg: RooflineBenchConfig) -> dict:
    with tempfile.TemporaryDirectory(prefix="llmserve-bench-") as scratch:  # the model it makes, removed after
        return _run(cfg, scratch)


def _run(cfg: RooflineBenchConfig, scratch: str) -> dict:
    from llmserve import LLM
    from llmserve.testing.maker import make_model
    from llmserve.worker.kv_cache import kv_bytes_per_token

    path = cfg.engine.model.model or make_model(cfg.arch, cfg.shape, scratch, seed=0)
    llm = LLM(**engine_kwargs(_engine(cfg, path)))
    engine, info = llm.engine, llm.engine.model_info
    weight_bytes = weight_bytes_read(engine.runner.model)
    kv_per_token = kv_bytes_per_token(engine.runner.kv_caches)  # the cache's layout: K/V per head, or MLA latents
    bandwidth = copy_bandwidth(engine.device, cfg.copy_mib * 2**20)
    prompts = random_prompts(cfg.prompt_len, info.vocab_size)
    step_s = decode_seconds_per_token(llm, prompts, cfg.output_len, cfg.repeats)
    step_bytes = bytes_per_decode_step(weight_bytes, kv_per_token, cfg.prompt_len + cfg.output_len / 2)
    results = {"config": asdict(cfg), "model_path": path, "device": device_name(engine.device),
               "dtype": str(engine.dtype).removeprefix("torch."), "weight_bytes": weight_bytes,
               "kv_bytes_per_token": kv_per_token,
               "copy_bandwidth_gb_s": bandwidth / 1e9, "decode_tok_s": 1 / step_s, "step_ms": 1e3 * step_s,
               "bytes_per_step": step_bytes, "achieved_gb_s": step_bytes / step_s / 1e9,
               "bandwidth_utilization": step_bytes / step_s / bandwidth, "roofline_tok_s": bandwidth / step_bytes,
               "cuda_graphs": engine.runner.graphs is not None}
    _print(results)
    return results


def _engine(cfg: RooflineBenchConfig, path: str) -> EngineConfig:
    """The engine flags given, with one sequence at a time and the run's length where they left them unset."""
    e = cfg.engine
    max_model_len = cfg.num_tokens + 16 if e.model.max_model_len is None else e.model.max_model_len
    max_num_seqs = 1 if e.scheduler.max_num_seqs is None else e.scheduler.max_num_seqs
    return dataclasses.replace(e, model=dataclasses.replace(e.model, model=path, max_model_len=max_model_len),
                               scheduler=dataclasses.replace(e.scheduler, max_num_seqs=max_num_seqs))


def _print(r: dict) -> None:
    print(f"device: {r['device']} ({r['dtype']}), weights read per step {r['weight_bytes'] / 1e9:.2f} GB "
          f"(active: router and top-k experts of MoE layers), "
          f"CUDA graphs {'on' if r['cuda_graphs'] else 'off'}; KV cache {r['kv_bytes_per_token']:,} bytes a token")
    print(f"copy bandwidth {r['copy_bandwidth_gb_s']:.1f} GB/s -> roofline {r['roofline_tok_s']:.1f} tok/s")
    print(f"batch-1 decode {r['decode_tok_s']:.1f} tok/s ({r['step_ms']:.2f} ms/step), "
          f"{r['achieved_gb_s']:.1f} GB/s = {100 * r['bandwidth_utilization']:.1f}% of copy bandwidth")


def add_bench_roofline_parser(subparsers):
    return add_bench_command(subparsers, "roofline", "batch-1 decode vs the device's memory bandwidth",
                             RooflineBenchConfig, run)
