"""The C++ CPU paged-attention kernel (llmserve.model.cpu_kernels) against the torch path and a naive
reference: random block tables, mixed lengths, GQA, decode and short multi-query rows, and whole prompts
and long chunks split in tiles of 16 query tokens."""

from __future__ import annotations

import logging
import os
import time

import pytest
import torch

from llmserve.model import cpu_build, cpu_kernels, lora_cpu
from llmserve.model.attention import select_attention_backend
from llmserve.model.attn_torch import TorchAttentionBackend
from attention_cases import SCALE, check_against_reference, make_case, random_rows, reference, run_backend


def test_disabled_by_env(monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_KERNELS", "0")
    assert cpu_kernels._load() is None


@pytest.mark.parametrize("module", [cpu_kernels, lora_cpu], ids=["cpu_kernels", "lora_cpu"])
def test_every_kernel_build_loads_wherever_a_compiler_and_ninja_are(module):
    """A compile error must fail the suite, not skip every test that needs the kernels (each build falls back to
    torch with one warning, which the suite would not see)."""
    import shutil

    from torch.utils import cpp_extension

    if cpu_build.kernels_disabled() or shutil.which("c++") is None or not cpp_extension.is_ninja_available():
        pytest.skip("no C++ compiler or ninja here (or LLMSERVE_CPU_KERNELS=0): the torch path serves")
    assert module.available(), f"{module.__name__}'s C++ build failed to build or load: see the log's warning"


def test_build_failure_falls_back(monkeypatch, caplog):
    from torch.utils import cpp_extension

    def fail(*args, **kwargs):
        raise RuntimeError("Error building extension 'llmserve_cpu_kernels': no compiler")

    monkeypatch.delenv("LLMSERVE_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpp_extension, "load", fail)
    with caplog.at_level(logging.WARNING, logger="llmserve.model.cpu_kernels"):
        assert cpu_kernels._load() is None
    assert "torch path" in caplog.text


def test_a_first_build_is_announced_with_its_time(monkeypatch, caplog, tmp_path):
    from torch.utils import cpp_extension

    def stop(*args, **kwargs):
        raise RuntimeError("stopped before compiling")

    monkeypatch.delenv("LLMSERVE_CPU_KERNELS", raising=False)
    monkeypatch.setattr(cpu_build, "build_dir", lambda flags: str(tmp_path))
    monkeypatch.setattr(cpp_extension, "load", stop)
    with caplog.at_level(logging.INFO, logger="llmserve.model.cpu_kernels"):
        cpu_kernels._load()
    assert f"compiling the C++ CPU kernels (model/csrc) into {tmp_path}: this takes about 2-3 minutes" in caplog.text


def cpu_kernels_needs_build(build_dir: str) -> bool:
    return cpu_build.needs_build(build_dir, cpu_kernels._NAME, cpu_kernels._SOURCES + cpu_kernels._HEADERS)


def test_a_build_newer_than_every_source_needs_no_build(tmp_path):
    assert cpu_kernels_needs_build(str(tmp_path))  # nothing built yet
    library = tmp_path / "llmserve_cpu_kernels.so"
    library.touch()
    later = time.time() + 60
    os.utime(library, (later, later))
    assert not cpu_kernels_needs_build(str(tmp_path))


def test_stale_build_lock_is_removed_and_a_fresh_one_kept(tmp_path):
    stale, fresh = tmp_path / "stale", tmp_path / "fresh"
    for folder in (stale, fresh):
        folder.mkdir()
        (folder / "lock").touch()
    old = time.time() - cpu_build.STALE_LOCK_S - 1
    os.utime(stale / "lock", (old, old))
    cpu_build.clear_stale_lock(str(stale))
    cpu_build.clear_stale_lock(str(fresh))  # a build in progress elsewhere: wait for it, as torch does
    assert not (stale / "lock").exists() and (fresh / "lock").exists()


needs_kernel = pytest.mark.skipif(not cpu_kernels.available(),
                                  reason="the C++ CPU kernel could not be built here (no compiler/ninja?)")


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 4, 6])  # 6: the kernel's division path (others shift)
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("seed", range(3))
def test_kernel_matches_torch_path_and_reference(block_size, group, seed):
    rows = random_rows(seed)
    q, k, v, kv_cache, inputs, full = make_case(rows, block_size, group, seed)
    out, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
    assert metadata.kernel is not None and metadata.groups == []  # every row here is decode-like
    torch_out, torch_metadata = run_backend(TorchAttentionBackend(use_cpu_kernel=False), q, k, v, kv_cache, inputs)
    assert torch_metadata.kernel is None
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 4])
def test_kernel_rows_mixed_with_prefill_groups(block_size):
    """Decode-like rows go to the kernel, fresh prompts and long chunks stay on SDPA, one out."""
    rows = [(40, 1), (0, 20), (7, 3), (0, 5), (100, 30), (299, 1), (0, 1), (33, 16), (5, 17)]
    q, k, v, kv_cache, inputs, full = make_case(rows, block_size, 3, seed=11)
    out, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
    assert metadata.kernel.rows.tolist() == [0, 2, 5, 6, 7]
    torch_out, _ = run_backend(TorchAttentionBackend(use_cpu_kernel=False), q, k, v, kv_cache, inputs)
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=1e-5)


PROMPT_ROWS = [(0, 200), (40, 1), (33, 40), (0, 17), (299, 1), (7, 3), (0, 1), (90, 64), (0, 33)]


@needs_kernel
@pytest.mark.parametrize("block_size", [16, 6])
@pytest.mark.parametrize("group", [1, 3])
@pytest.mark.parametrize("num_threads", [1, 2, 16])  # 16: one kv head per work item
def test_kernel_takes_prompts_in_tiles(block_size, group, num_threads):
    """With kernel_takes_prompts every row goes to the kernel (no SDPA group): fresh prompts and long chunks
    over a cache, tiled by 16 query tokens, causal within and across tiles."""
    q, k, v, kv_cache, inputs, full = make_case(PROMPT_ROWS, block_size, group, seed=block_size + group)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out, metadata = run_backend(TorchAttentionBackend(kernel_takes_prompts=True), q, k, v, kv_cache, inputs)
    finally:
        torch.set_num_threads(previous)
    assert metadata.kernel.rows.tolist() == list(range(len(PROMPT_ROWS))) and metadata.groups == []
    torch_out, _ = run_backend(TorchAttentionBackend(use_cpu_kernel=False), q, k, v, kv_cache, inputs)
    torch.testing.assert_close(out, torch_out, atol=1e-5, rtol=1e-5)
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype,head_dim,atol", [(torch.float32, 36, 1e-5), (torch.bfloat16, 64, 2e-2)])
def test_portable_path_tiles_prompts_too(dtype, head_dim, atol):
    """The portable path (head_dim not a multiple of 8; half dtypes) reads the same work items."""
    q, k, v, kv_cache, inputs, full = make_case(PROMPT_ROWS, 16, 3, seed=4, dtype=dtype, head_dim=head_dim)
    out, metadata = run_backend(TorchAttentionBackend(kernel_takes_prompts=True), q, k, v, kv_cache, inputs)
    assert metadata.groups == []
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=atol)


@needs_kernel
def test_backend_takes_float32_prompts_and_bfloat16_ones_up_to_a_length():
    f32 = select_attention_backend(torch.device("cpu"), "auto", torch.float32)
    bf16 = select_attention_backend(torch.device("cpu"), "auto", torch.bfloat16)
    assert f32.kernel_takes_prompts == cpu_kernels.attends_prompts(torch.float32)
    assert f32.max_kernel_prompt_seq_len is None
    assert bf16.kernel_takes_prompts == cpu_kernels.attends_prompts(torch.bfloat16)
    assert bf16.max_kernel_prompt_seq_len == cpu_kernels.BF16_KERNEL_PROMPT_SEQ_LEN
    assert not select_attention_backend(torch.device("cpu")).kernel_takes_prompts


@needs_kernel
def test_prompts_past_the_length_limit_go_to_sdpa():
    """The kernel takes decode-like rows and prompts of sequences up to the limit; longer prompts form SDPA
    groups in the same step, and every row's output is the reference's."""
    q, k, v, kv_cache, inputs, full = make_case(PROMPT_ROWS, 16, 3, seed=5, dtype=torch.bfloat16, head_dim=64)
    backend = TorchAttentionBackend(kernel_takes_prompts=True, max_kernel_prompt_seq_len=64)
    out, metadata = run_backend(backend, q, k, v, kv_cache, inputs)
    # (cached, new) rows: 200, 73 and 154 keys are past 64 and not decode-like
    assert metadata.kernel.rows.tolist() == [1, 3, 4, 5, 6, 8]
    assert sum(group.num_rows for group in metadata.groups) == 3
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=2e-2)


@needs_kernel
def test_kernel_writes_only_its_rows():
    rows = [(10, 1), (50, 4), (3, 1)]
    q, k, v, kv_cache, inputs, full = make_case(rows, 16, 3, seed=5)
    backend = TorchAttentionBackend()
    backend.forward(q, k, v, kv_cache, backend.build_metadata(inputs), SCALE)  # writes this step's k/v
    out = torch.full(q.shape, 7.0)
    cpu_kernels.paged_attention(out, q, kv_cache, inputs.block_table, inputs.seq_lens, inputs.query_start_loc,
                                torch.tensor([1], dtype=torch.int32), SCALE)
    assert bool((out[:1] == 7.0).all()) and bool((out[5:] == 7.0).all())
    torch.testing.assert_close(out[1:5], reference(q[1:5], *full[1]).float(), atol=1e-5, rtol=1e-5)


@needs_kernel
def test_kernel_rejects_bad_metadata():
    rows = [(10, 1), (20, 1)]
    q, _, _, kv_cache, inputs, _ = make_case(rows, 16, 1, seed=1)
    out = torch.empty(q.shape)
    with pytest.raises(RuntimeError, match="row index"):
        cpu_kernels.paged_attention(out, q, kv_cache, inputs.block_table, inputs.seq_lens, inputs.query_start_loc,
                                    torch.tensor([2], dtype=torch.int32), SCALE)
    too_long = torch.tensor([10, 4000], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="block table"):
        cpu_kernels.paged_attention(out, q, kv_cache, inputs.block_table, too_long, inputs.query_start_loc,
                                    torch.tensor([0, 1], dtype=torch.int32), SCALE)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_half_dtypes(dtype):
    rows = random_rows(7)
    q, k, v, kv_cache, inputs, full = make_case(rows, 16, 3, seed=7, dtype=dtype)
    out, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
    assert out.dtype == dtype and metadata.kernel is not None
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=2e-2)


@needs_kernel
@pytest.mark.parametrize("head_dim", [128, 96, 40])
@pytest.mark.parametrize("group", [1, 3])
def test_bfloat16_head_dims(head_dim, group):
    """bfloat16 through the kernel at Llama's 128, at 96 and at 40 (the AVX2 path's unrolled and generic dims), one
    query head a kv head and a run of three: each matches the reference."""
    rows = random_rows(head_dim + group)
    q, k, v, kv_cache, inputs, full = make_case(rows, 16, group, seed=head_dim, dtype=torch.bfloat16,
                                                head_dim=head_dim)
    out, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
    assert metadata.kernel is not None and metadata.groups == []
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=2e-2)


@needs_kernel
def test_unsupported_dtype_uses_torch_groups():
    rows = random_rows(3)
    q, k, v, kv_cache, inputs, full = make_case(rows, 4, 3, seed=3, dtype=torch.float64)
    out, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
    assert metadata.kernel is not None and 0 in metadata.kernel.fallback  # built for full attention
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=1e-7)


@needs_kernel
@pytest.mark.parametrize("num_threads", [1, 16])
def test_kernel_work_split_by_thread_count(num_threads):
    """Few rows per thread: one kv head per work item; many: all kv heads of a row per item."""
    rows = random_rows(num_threads)
    q, k, v, kv_cache, inputs, full = make_case(rows, 4, 3, seed=num_threads)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        out, _ = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
    finally:
        torch.set_num_threads(previous)
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("head_dim", [128, 40, 36])
def test_kernel_head_dims(head_dim):
    """float32: 128 (unrolled), 40 (a multiple of 8, not unrolled) and 36 (the portable path) all match."""
    rows = random_rows(head_dim)
    q, k, v, kv_cache, inputs, full = make_case(rows, 16, 3, seed=head_dim, head_dim=head_dim)
    out, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
    assert metadata.kernel is not None and metadata.groups == []
    check_against_reference(out, q, inputs.query_start_loc.tolist(), full, atol=1e-5)


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("group", [2, 3, 4, 7])  # runs of query heads sharing their keys: 2, 3, 2 + 2, 3 + 2 + 2
@pytest.mark.parametrize("num_threads", [1, 2])  # 2: one-row steps split over the keys
def test_query_heads_sharing_a_kv_head_get_the_bits_of_their_own_copies(dtype, group, num_threads):
    """A kv head's query heads read its keys together; each one's output is bit for bit what it gets from its own
    copy of the kv head (the same cache with every kv head repeated `group` times: one query head per kv head)."""
    rows = random_rows(group) + [(700, 1)]  # a long decode row: split over the keys on 2 threads
    q, k, v, kv_cache, inputs, _ = make_case(rows, 16, group, seed=group, dtype=dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(num_threads)
    try:
        shared, metadata = run_backend(TorchAttentionBackend(), q, k, v, kv_cache, inputs)
        copies, _ = run_backend(TorchAttentionBackend(), q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1),
                                kv_cache.repeat_interleave(group, 3), inputs)
    finally:
        torch.set_num_threads(previous)
    assert metadata.kernel is not None and metadata.groups == []
    assert torch.equal(shared, copies)
