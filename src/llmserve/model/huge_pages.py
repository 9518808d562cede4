"""A loaded CPU model's large tensors (and a CPU KV cache) on transparent huge pages (2 MiB-aligned arenas, madvised).

A CPU decode step streams every weight from DRAM once. On 4 KiB pages the hardware prefetchers stop at each page's
end and the TLB misses every few lines; on 2 MiB pages the same step's weights stream close to the machine's read
bandwidth (docs/benchmarks.md). Linux hands out huge pages to an anonymous mapping madvised MADV_HUGEPAGE when
/sys/kernel/mm/transparent_hugepage/enabled is `always` or `madvise` (the common default); where it is `never`,
off Linux, or with LLMSERVE_CPU_HUGE_PAGES=0, the tensors stay where they are.
"""

from __future__ import annotations

import logging
import math
import mmap
from dataclasses import dataclass

import torch
from torch import nn

from llmserve.model.cpu_build import is_switched_off

logger = logging.getLogger(__name__)

ENV = "LLMSERVE_CPU_HUGE_PAGES"
HUGE_PAGE = 2 << 20  # bytes: x86-64's transparent huge page
MIN_BYTES = 256 << 10  # smaller tensors (norms, biases) stay: they are a step's least and stay cached
_ALIGN = 64  # bytes: each tensor starts on a cache line
THP_MODE = "/sys/kernel/mm/transparent_hugepage/enabled"


def _aligned(num_bytes: int) -> int:
    """num_bytes rounded up to a whole number of cache lines (where the next tensor starts)."""
    return -(-num_bytes // _ALIGN) * _ALIGN


def thp_mode() -> str:
    """The kernel's THP setting (`always`, `madvise` or `never`), '' where it cannot be read."""
    try:
        with open(THP_MODE) as f:
            text = f.read()
    except OSError:
        return ""
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else ""


def is_enabled() -> bool:
    """Linux with THP not `never`, Python's mmap able to madvise it, LLMSERVE_CPU_HUGE_PAGES not switched off."""
    return (not is_switched_off(ENV) and hasattr(mmap, "MADV_HUGEPAGE")
            and thp_mode() in ("always", "madvise"))


@dataclass(frozen=True)
class _Slot:
    """Where a tensor goes: its owner's dict, its name there, and its byte offset in the arena."""
    owner: dict
    name: str
    offset: int


def arena(num_bytes: int) -> torch.Tensor | None:
    """num_bytes [uint8] on a fresh anonymous mapping madvised MADV_HUGEPAGE, its start 2 MiB-aligned (pages are
    faulted in as huge pages when first written); None where the mapping or the advice fails. The tensor keeps
    the mapping alive."""
    try:
        mapping = mmap.mmap(-1, num_bytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as e:
        logger.info("no huge-page arena for %d bytes (%s): weights stay on small pages", num_bytes, e)
        return None
    whole = torch.frombuffer(mapping, dtype=torch.uint8)
    start = -whole.data_ptr() % HUGE_PAGE
    return whole[start:start + num_bytes]


def zeros(count: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor] | None:
    """count zeroed tensors of shape, one after the other in one huge-page arena (a CPU KV cache's layers: the
    attention reads their blocks all over), every page faulted in now as torch.zeros would; None where switched
    off or unavailable (`is_enabled`)."""
    if not is_enabled():
        return None
    numel = math.prod(shape)
    stride = _aligned(numel * torch.empty((), dtype=dtype).element_size())  # bytes from one tensor to the next
    memory = arena(count * stride) if count and stride else None
    if memory is None:
        return None
    memory.zero_()
    return [memory[i * stride:(i + 1) * stride].view(dtype)[:numel].view(shape) for i in range(count)]


def _movable(tensor: object, min_bytes: int) -> bool:
    """A plain (strided) CPU tensor of at least min_bytes that owns its whole storage (a view of a larger one stays
    with it; oneDNN's packed weights, opaque, stay where oneDNN put them)."""
    return (isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.layout == torch.strided
            and not tensor.is_mkldnn and not tensor.is_quantized and tensor.is_contiguous()
            and tensor.nbytes >= min_bytes and tensor.untyped_storage().nbytes() == tensor.nbytes)


def _plan(model: nn.Module, min_bytes: int) -> tuple[list[_Slot], dict[int, torch.Tensor], int]:
    """Every movable tensor's slot (parameters, buffers and plain tensor attributes, in module order: the order a
    step reads them), the tensors by offset (a tensor held twice, as a tied weight is, gets one offset) and the
    arena's size."""
    slots: list[_Slot] = []
    by_offset: dict[int, torch.Tensor] = {}
    offset_of: dict[int, int] = {}  # data_ptr -> offset
    size = 0
    for module in model.modules():
        attributes = {name: value for name, value in vars(module).items() if isinstance(value, torch.Tensor)}
        for owner in (module._parameters, module._buffers, attributes):
            for name, tensor in owner.items():
                if not _movable(tensor, min_bytes):
                    continue
                if tensor.data_ptr() not in offset_of:
                    offset_of[tensor.data_ptr()] = size
                    by_offset[size] = tensor
                    size += _aligned(tensor.nbytes)
                slots.append(_Slot(vars(module) if owner is attributes else owner, name,
                                   offset_of[tensor.data_ptr()]))
    return slots, by_offset, size


def move_to_huge_pages(model: nn.Module, min_bytes: int = MIN_BYTES) -> int:
    """Copy the model's CPU tensors of at least min_bytes into one huge-page arena and point their modules at the
    copies (the same values; the old memory is freed). Returns the bytes moved: 0 where switched off or
    unavailable (`is_enabled`), or where nothing is that large."""
    if not is_enabled():
        return 0
    slots, by_offset, size = _plan(model, min_bytes)
    memory = arena(size) if size else None
    if memory is None:
        return 0
    copies = {}
    for offset, tensor in by_offset.items():
        copies[offset] = memory[offset:offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        copies[offset].copy_(tensor)
    for slot in slots:
        current = slot.owner[slot.name]
        if isinstance(current, nn.Parameter):
            current.data = copies[slot.offset]
        else:
            slot.owner[slot.name] = copies[slot.offset]
    logger.info("%.0f MB of weights on transparent huge pages (%s=0 turns it off)", size / 1e6, ENV)
    return size

