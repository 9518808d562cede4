"""The engine on a CUDA device: Triton attention, CUDA graphs, KV sizing from a profiling forward.

Tolerance policy. float32: every greedy token is transformers' argmax (float32, same device), except
at a near-tie (top-2 logits within 1e-4), where the check stops. bfloat16: the same check against
transformers in float32, with near-ties widened to BF16_TIE_GAP: bf16 weights and activations move
logits by about 1e-2 on these random models, so a first divergence within that gap is rounding, one
beyond it is a bug. CUDA graphs and eager give identical tokens in float32, and in bfloat16 with decode graphs
(the same kernels); bfloat16 mixed steps, padded to a multiple of 32 tokens in graphs, keep the tie gap.
"""

from __future__ import annotations

import random
import warnings

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.testing.maker import make_model

from greedy_check import check_greedy_against_hf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

BF16_TIE_GAP = 5e-2
ENGINE = dict(device="cuda", max_model_len=256, num_kv_blocks=256, max_num_batched_tokens=128)
PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("gpu-tiny")), seed=5)


def _prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 120))] for _ in range(num)]


def _tokens(llm, prompts) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, PARAMS)]


def _hf(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to("cuda").eval()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("enforce_eager", [False, True])
def test_greedy_equals_transformers(checkpoint, dtype, enforce_eager):
    llm = LLM(checkpoint, dtype=dtype, enforce_eager=enforce_eager, **ENGINE)
    assert llm.engine.runner.attn_backend.name == "triton"
    assert (llm.engine.runner.graphs is None) == enforce_eager
    hf = _hf(checkpoint)
    prompts = _prompts(24, seed=1)
    tie_gap = 1e-4 if dtype == "float32" else BF16_TIE_GAP
    for prompt, out in zip(prompts, _tokens(llm, prompts)):
        note = check_greedy_against_hf(hf, prompt, out, tie_gap=tie_gap)
        if note:
            warnings.warn(note)
    llm.engine.check_integrity()


@pytest.mark.parametrize("dtype, mode", [("float32", "FULL"), ("bfloat16", "FULL"), ("bfloat16", "FULL_DECODE_ONLY")])
def test_cuda_graphs_equal_eager(checkpoint, dtype, mode):
    """Decode batches of many sizes (padded buckets 1..64) and, with FULL, mixed steps padded to 32..128 tokens:
    float32 tokens equal eager's. In bfloat16 a padded mixed step's GEMMs may take other cuBLAS kernels than the
    eager step's, which moves logits by rounding: FULL is checked against transformers with the tie gap there,
    decode graphs alone (the same shapes as eager) for equality."""
    prompts = _prompts(40, seed=2)
    llm = LLM(checkpoint, dtype=dtype, cudagraph_mode=mode, **ENGINE)
    graphed = _tokens(llm, prompts)
    if dtype == "bfloat16" and mode == "FULL":
        hf = _hf(checkpoint)
        for prompt, out in zip(prompts, graphed):
            note = check_greedy_against_hf(hf, prompt, out, tie_gap=BF16_TIE_GAP)
            if note:
                warnings.warn(note)
        return
    assert graphed == _tokens(LLM(checkpoint, dtype=dtype, enforce_eager=True, **ENGINE), prompts)


def test_mixed_steps_replay_their_graphs(checkpoint):
    """Prompt chunks beside decode rows replay the mixed-step graphs (ENGINE's 128-token budget: 32..128 tokens):
    the tokens of decode graphs alone (--cudagraph-mode FULL_DECODE_ONLY)."""
    llm = LLM(checkpoint, dtype="float32", **ENGINE)
    mixed = llm.engine.runner.mixed_graphs
    assert mixed is not None and mixed.sizes == [32, 64, 96, 128] and mixed.graphs
    replays, replay = [], mixed._replay
    mixed._replay = lambda key, num_tokens: replays.append((num_tokens, key[0])) or replay(key, num_tokens)
    prompts = _prompts(40, seed=3)
    tokens = _tokens(llm, prompts)
    assert len({size for _, size in replays}) > 1 and any(n < size for n, size in replays)
    decode_only = LLM(checkpoint, dtype="float32", cudagraph_mode="FULL_DECODE_ONLY", **ENGINE)
    assert decode_only.engine.runner.mixed_graphs is None and decode_only.engine.runner.graphs is not None
    assert tokens == _tokens(decode_only, prompts)
    llm.engine.check_integrity()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_the_triton_gemv_for_few_rows_keeps_greedy_tokens(checkpoint, monkeypatch, enforce_eager):
    """LLMSERVE_CUDA_GEMV_ROWS=16: bf16 linears of up to 16 rows through model/triton_gemv.py (the down
    projection's with SiLU-and-mul in its loads), in the decode graphs and eagerly; the tokens are transformers'
    within the bf16 tie gap."""
    from llmserve.model import fused_cuda, triton_gemv

    monkeypatch.setenv("LLMSERVE_CUDA_GEMV_ROWS", "16")
    fused_cuda.cuda_gemv_rows.cache_clear()
    calls, gemv = [], triton_gemv.gemv
    monkeypatch.setattr(triton_gemv, "gemv", lambda x, *args, **kw: calls.append(x.shape[0]) or gemv(x, *args, **kw))
    try:
        llm = LLM(checkpoint, dtype="bfloat16", enforce_eager=enforce_eager, **ENGINE)
        prompts = _prompts(6, seed=4)
        tokens = _tokens(llm, prompts)
    finally:
        fused_cuda.cuda_gemv_rows.cache_clear()
    assert calls and max(calls) <= 16
    hf = _hf(checkpoint)
    for prompt, out in zip(prompts, tokens):
        note = check_greedy_against_hf(hf, prompt, out, tie_gap=BF16_TIE_GAP)
        if note:
            warnings.warn(note)
    llm.engine.check_integrity()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_the_triton_gemv_through_prefix_hits_chunks_and_preemption(checkpoint, monkeypatch, enforce_eager):
    """The same switch with prompts sharing a cached prefix, chunked by a 32-token budget, in a KV cache small
    enough to preempt: transformers' greedy tokens within the bf16 tie gap."""
    from llmserve.model import fused_cuda

    monkeypatch.setenv("LLMSERVE_CUDA_GEMV_ROWS", "16")
    fused_cuda.cuda_gemv_rows.cache_clear()
    rng = random.Random(5)
    prefix = [rng.randrange(3, 500) for _ in range(16)]
    prompts = [prefix + [rng.randrange(3, 500) for _ in range(n)] for n in (5, 9, 3, 7)]
    try:
        llm = LLM(checkpoint, dtype="bfloat16", device="cuda", enforce_eager=enforce_eager, max_model_len=48,
                  block_size=4, num_kv_blocks=16, max_num_batched_tokens=32)
        outs = llm.generate(prompts[:1], PARAMS) + llm.generate(prompts[1:], PARAMS)
    finally:
        fused_cuda.cuda_gemv_rows.cache_clear()
    assert llm.num_preemptions > 0, "the small cache was meant to preempt"
    assert all(o.num_cached_tokens >= 16 for o in outs[1:])  # the first prompt's prefix, cached
    hf = _hf(checkpoint)
    for prompt, out in zip(prompts, outs):
        note = check_greedy_against_hf(hf, prompt, out.outputs[0].token_ids, tie_gap=BF16_TIE_GAP)
        if note:
            warnings.warn(note)
    llm.engine.check_integrity()


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_long_rows_split_their_keys(checkpoint, enforce_eager):
    """Decode rows past SPLIT_MIN_KEYS (1,024) split their keys (flash decoding), in the graphs that do and
    eagerly: float32 greedy tokens are transformers'."""
    llm = LLM(checkpoint, dtype="float32", device="cuda", max_model_len=1400, num_kv_blocks=256,
              max_num_batched_tokens=512, enforce_eager=enforce_eager)
    assert enforce_eager or llm.engine.runner.graphs.split_sizes
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 500) for _ in range(n)] for n in (1100, 1030)]
    hf = _hf(checkpoint)
    for prompt, out in zip(prompts, _tokens(llm, prompts)):
        note = check_greedy_against_hf(hf, prompt, out, tie_gap=1e-4)
        if note:
            warnings.warn(note)
    llm.engine.check_integrity()


def test_kv_cache_sized_from_gpu_memory(checkpoint):
    llm = LLM(checkpoint, device="cuda", max_model_len=256, gpu_memory_utilization=0.5)
    free, total = torch.cuda.mem_get_info()
    kv_bytes = sum(c.numel() * c.element_size() for c in llm.engine.runner.kv_caches)
    assert llm.engine.num_blocks > 1000
    assert kv_bytes <= 0.5 * total
    assert _tokens(llm, _prompts(2, seed=3))


def test_default_dtype_is_bf16(checkpoint):
    llm = LLM(checkpoint, **ENGINE)
    assert llm.engine.dtype == torch.bfloat16


@pytest.mark.parametrize("enforce_eager", [False, True])
def test_async_scheduling_gives_the_in_order_tokens(checkpoint, enforce_eager):
    """Overlap on CUDA (the default there): step N+1 reads step N's tokens on the device; greedy and
    seeded outputs equal the in-order engine's, with graphs and eagerly."""
    prompts = _prompts(40, seed=4)
    params = [SamplingParams(temperature=0.0 if i % 2 else 0.8, seed=i, max_tokens=4 + i % 13, ignore_eos=True,
                             logprobs=1 if i % 3 == 0 else None) for i in range(40)]
    outs = []
    for is_async in (False, True):
        llm = LLM(checkpoint, dtype="float32", enforce_eager=enforce_eager, async_scheduling=is_async,
                  max_num_seqs=16, **ENGINE)
        outs.append([[c.token_ids for c in o.outputs] for o in llm.generate(prompts, params)])
        assert (llm.engine.runner.times.num_device_inputs > 0) == is_async
        llm.engine.check_integrity()
    assert outs[0] == outs[1]


def test_async_scheduling_is_the_cuda_default(checkpoint):
    llm = LLM(checkpoint, dtype="bfloat16", **ENGINE)
    assert llm.engine.is_async


def test_host_values_reach_the_device_through_pinned_memory():
    """Lists through sample.metadata.to_device, numpy arrays through model.paged_indices.on_device (torch
    pins no tensor made from numpy: handing an array to to_device once crashed the engine)."""
    import numpy as np

    from llmserve.model.paged_indices import on_device
    from llmserve.sample.metadata import to_device

    cuda = torch.device("cuda")
    assert on_device(np.array([4, 5], dtype=np.int64), cuda).tolist() == [4, 5]
    assert to_device([[1, 2], [3, 4]], torch.int32, cuda).cpu().tolist() == [[1, 2], [3, 4]]


def test_penalised_requests_run_with_overlap(checkpoint):
    """A penalised row's sampled ids are appended on the device (numpy batch rows, pinned copies)."""
    llm = LLM(checkpoint, dtype="bfloat16", **ENGINE)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, repetition_penalty=1.2,
                            frequency_penalty=0.5)
    outs = llm.generate(_prompts(6, seed=7), params)
    assert llm.engine.is_async and all(len(o.outputs[0].token_ids) == 8 for o in outs)
    llm.engine.check_integrity()


@pytest.mark.parametrize("num_penalized", [6, 3])  # every row, and some rows (an index on the device)
def test_a_penalised_decode_step_never_waits_for_the_device(checkpoint, num_penalized):
    """With async scheduling the host launches step N+1 while step N runs: launching a decode step of sampled,
    penalised rows (the checkpoint defaults of `bench serve`) makes no synchronising CUDA call."""
    llm = LLM(checkpoint, dtype="bfloat16", **ENGINE)
    penalized = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=40,
                               ignore_eos=True)
    plain = SamplingParams(temperature=0.7, top_p=0.8, top_k=20, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(_prompts(6, seed=9)):
        for request in llm.processor.process(str(i), prompt, penalized if i < num_penalized else plain):
            llm.engine.add_request(request)
    for _ in range(8):  # prompts done, every row decoding
        llm.engine.step()
    runner = llm.engine.runner
    launch = runner.launch

    def strict_launch(*args, **kwargs):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return launch(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    runner.launch = strict_launch
    for _ in range(4):
        llm.engine.step()
    runner.launch = launch
    while llm.engine.has_unfinished_requests():
        llm.engine.step()
    llm.engine.check_integrity()
