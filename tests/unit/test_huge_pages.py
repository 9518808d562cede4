"""model/huge_pages.py: a loaded CPU model's large tensors in one 2 MiB-aligned arena madvised for transparent huge
pages (the same values and logits as before, a tied table still one tensor, views and small tensors left where they
are), the kernel backing it with huge pages, and nothing moved where switched off."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

from llmserve.model import huge_pages
from llmserve.model.attention import select_attention_backend
from llmserve.model.loader import load_model
from llmserve.testing import toy_tokenizer
from llmserve.testing.paged_batch import PagedBatchBuilder, allocate_kv_caches

needs_thp = pytest.mark.skipif(not huge_pages.is_enabled(), reason="no transparent huge pages (THP never, or not Linux)")
VOCAB = 512


def _checkpoint(path: str, is_tied: bool) -> str:
    import transformers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                      initializer_range=0.1, tie_word_embeddings=is_tied, eos_token_id=2,
                                      pad_token_id=0, bos_token_id=None)
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(path)
    toy_tokenizer.save_tokenizer(path, VOCAB, 256)
    return path


def _large_tensors(model: nn.Module, min_bytes: int) -> dict[str, torch.Tensor]:
    """name -> each parameter, buffer or tensor attribute of at least min_bytes."""
    found = {}
    for prefix, module in model.named_modules():
        held = {**module._parameters, **module._buffers,
                **{k: v for k, v in vars(module).items() if isinstance(v, torch.Tensor)}}
        for name, tensor in held.items():
            if tensor is not None and tensor.numel() * tensor.element_size() >= min_bytes:
                found[f"{prefix}.{name}"] = tensor
    return found


def _huge_page_kib(tensor: torch.Tensor) -> int:
    """KiB of the mapping holding tensor's data that the kernel backs with huge pages now (/proc/self/smaps)."""
    address = tensor.data_ptr()
    with open(f"/proc/{os.getpid()}/smaps") as f:
        lines = f.read().splitlines()
    is_inside = False
    for line in lines:
        head = line.split(maxsplit=1)[0]
        if "-" in head and not head.endswith(":"):
            start, end = (int(part, 16) for part in head.split("-"))
            is_inside = start <= address < end
        elif is_inside and head == "AnonHugePages:":
            return int(line.split()[1])
    return -1


def _logits(model: nn.Module) -> torch.Tensor:
    """A two-row step's logits (a prefill row and a decode row) on fresh caches."""
    backend = select_attention_backend(torch.device("cpu"), "auto", torch.float32)
    caches = allocate_kv_caches(model, 16, 4)
    builder = PagedBatchBuilder(16, 4, seed=2)
    builder.add_cached("b", 6)
    ids, positions, inputs = builder.step([("a", [3, 9, 27, 81, 243]), ("b", [5])])
    with torch.inference_mode():
        return model.forward_logits(ids, positions, caches, backend.build_metadata(inputs), backend,
                                    torch.tensor([4, 5]))[1]


@needs_thp
@pytest.mark.parametrize("is_tied", [True, False])
def test_large_tensors_move_into_one_aligned_arena_with_the_same_values_and_logits(tmp_path, monkeypatch, is_tied):
    monkeypatch.setenv(huge_pages.ENV, "0")  # loaded as before
    model = load_model(_checkpoint(str(tmp_path), is_tied), torch.float32, "cpu", 128)
    min_bytes = 32 << 10
    large = _large_tensors(model, min_bytes)
    before = {name: tensor.clone() for name, tensor in large.items()}
    distinct = {tensor.data_ptr(): tensor.numel() * tensor.element_size() for tensor in large.values()}
    logits = _logits(model)
    monkeypatch.delenv(huge_pages.ENV)

    num_bytes = huge_pages.move_to_huge_pages(model, min_bytes)

    after = _large_tensors(model, min_bytes)
    assert num_bytes >= sum(distinct.values()) and after.keys() == before.keys()
    starts = sorted(tensor.data_ptr() for tensor in after.values())
    base = starts[0]
    assert base % huge_pages.HUGE_PAGE == 0 and starts[-1] < base + num_bytes  # one arena, from a 2 MiB boundary
    assert all(torch.equal(after[name], before[name]) for name in before)
    assert isinstance(model.model.embed_tokens.weight, nn.Parameter)
    assert torch.equal(_logits(model), logits)
    assert huge_pages.move_to_huge_pages(model, min_bytes) == 0  # already in an arena: nothing moves twice


@needs_thp
def test_a_tensor_held_twice_stays_one_and_views_and_small_tensors_stay():
    table = torch.randn(256, 128)  # 128 KiB
    owner = torch.randn(512, 128)
    model = nn.Module()
    model.a, model.b = nn.Linear(128, 256, bias=False), nn.Linear(128, 256, bias=False)
    model.b.weight = model.a.weight  # tied
    model.register_buffer("view", owner[:256])  # a view of a larger storage
    model.small = torch.randn(8)
    model.table = table  # a plain attribute
    weight_ptr, view_ptr, small_ptr = model.a.weight.data_ptr(), model.view.data_ptr(), model.small.data_ptr()
    weight = model.a.weight.clone()

    assert huge_pages.move_to_huge_pages(model, min_bytes=1 << 10) == 2 * 256 * 128 * 4

    assert model.a.weight is model.b.weight and isinstance(model.a.weight, nn.Parameter)
    assert model.a.weight.data_ptr() != weight_ptr and torch.equal(model.a.weight, weight)
    assert model.table is not table and torch.equal(model.table, table)
    assert model.view.data_ptr() == view_ptr and model.small.data_ptr() == small_ptr


@needs_thp
def test_the_arena_is_backed_by_huge_pages_once_written():
    memory = huge_pages.arena(8 << 20)
    assert memory is not None and memory.data_ptr() % huge_pages.HUGE_PAGE == 0
    memory.fill_(1)
    assert _huge_page_kib(memory) >= 2048


def test_switched_off_nothing_moves(monkeypatch):
    monkeypatch.setenv(huge_pages.ENV, "0")
    model = nn.Linear(256, 512)
    ptr = model.weight.data_ptr()
    assert not huge_pages.is_enabled()
    assert huge_pages.move_to_huge_pages(model, min_bytes=1) == 0 and model.weight.data_ptr() == ptr


def test_the_thp_setting_is_read_from_its_brackets(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    setting.write_text("always [madvise] never\n")
    monkeypatch.setattr(huge_pages, "THP_MODE", str(setting))
    assert huge_pages.thp_mode() == "madvise"
    setting.write_text("always madvise [never]\n")
    assert huge_pages.thp_mode() == "never" and not huge_pages.is_enabled()
    monkeypatch.setattr(huge_pages, "THP_MODE", str(tmp_path / "missing"))
    assert huge_pages.thp_mode() == "" and not huge_pages.is_enabled()


@needs_thp
@pytest.mark.parametrize("dtype", [torch.float32, torch.int8])
def test_a_cpu_kv_cache_is_one_zeroed_arena_of_separate_layers(dtype):
    from llmserve.worker.kv_cache import allocate_kv_caches, row_width

    caches = allocate_kv_caches((2, 9, 4, 2, 16), 3, dtype, torch.device("cpu"))
    shape = (2, 9, 4, 2, row_width(16, dtype))
    assert [tuple(c.shape) for c in caches] == [shape] * 3 and all(c.dtype == dtype for c in caches)
    assert caches[0].data_ptr() % huge_pages.HUGE_PAGE == 0 and all(c.is_contiguous() for c in caches)
    assert all(not c.any() for c in caches)
    for i, cache in enumerate(caches):  # separate: writing one leaves the others zero
        cache.fill_(i + 1)
    assert [int(c.min()) for c in caches] == [1, 2, 3] and [int(c.max()) for c in caches] == [1, 2, 3]
    assert len({c.untyped_storage().data_ptr() for c in caches}) == 1  # one arena
