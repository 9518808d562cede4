"""KV cache groups: which layers share a block table, and which cache tensor each layer writes.

A model that mixes full and sliding-window layers (Gemma 3: five sliding to one full; gpt-oss: alternating)
keeps every block of its full layers but only the window's blocks of its sliding ones. As vLLM's hybrid
allocator does, the layers are split into groups of one attention kind and equal size (`group_size`
layers); each group has its own block table per request, all over one block pool. A block is
`group_size` layers deep: the cache holds `group_size` tensors, and tensor j holds, for each block, the
keys and values of the j-th layer of whichever group owns the block. So a sliding group frees the blocks
that left its window while the full group keeps them all, and every block costs the same bytes.

When one kind has many more layers than another (5:1), its layers form several groups of the same window,
each with its own table (vLLM's choice: one page size for the whole pool). With one kind only there is one
group of every layer, the cache as before.
"""

from __future__ import annotations

from dataclasses import dataclass

PAD_RATIO = 1.25  # kinds whose layer counts differ less than this form one group each, padded to the largest


@dataclass(frozen=True)
class KVCacheLayout:
    """group_windows [G]: each group's window (0 = full attention); layer_groups [L]: each layer's group;
    layer_slots [L]: the cache tensor each layer writes (of `num_slots`, the layers a block holds)."""

    group_windows: tuple[int, ...]
    layer_groups: tuple[int, ...]
    layer_slots: tuple[int, ...]
    num_slots: int

    @property
    def num_groups(self) -> int:
        return len(self.group_windows)

    @property
    def is_hybrid(self) -> bool:
        return self.num_groups > 1

    def blocks_per_sequence(self, num_tokens: int, block_size: int, max_chunk: int) -> int:
        """The most blocks one sequence of num_tokens holds at once in every group: a full group all of them, a
        sliding group the window before a prompt chunk of at most max_chunk tokens and the chunk."""
        num_blocks = -(-num_tokens // block_size)
        return sum(min(num_blocks, -(-(window - 1 + max_chunk) // block_size) + 1) if window else num_blocks
                   for window in self.group_windows)

    def describe(self) -> str:
        full = sum(w == 0 for w in self.group_windows)
        windows = sorted({w for w in self.group_windows if w})
        return (f"{self.num_groups} KV cache groups of {self.num_slots} layers ({full} full, "
                f"{self.num_groups - full} sliding of window {'/'.join(map(str, windows))})")


def single_group_layout(layer_windows: list[int] | tuple[int, ...]) -> KVCacheLayout:
    """Every layer in one group: its window is the largest where every layer slides, else 0 (a full layer
    reads every block, so none can go back). --disable-hybrid-kv-cache-manager, and one-kind models."""
    window = 0 if not layer_windows or 0 in layer_windows else max(layer_windows)
    num_layers = len(layer_windows)
    return KVCacheLayout((window,), (0,) * num_layers, tuple(range(num_layers)), num_layers)


def kv_cache_layout(layer_windows: list[int] | tuple[int, ...], is_hybrid_enabled: bool = True) -> KVCacheLayout:
    """The groups of a model whose layers have these windows (0 = full attention)."""
    kinds = sorted(set(layer_windows))
    if not is_hybrid_enabled or len(kinds) == 1:
        return single_group_layout(layer_windows)
    layers_of = {kind: [i for i, w in enumerate(layer_windows) if w == kind] for kind in kinds}
    counts = [len(layers) for layers in layers_of.values()]
    group_size = max(counts) if max(counts) < PAD_RATIO * min(counts) else min(counts)
    group_windows: list[int] = []
    layer_groups = [0] * len(layer_windows)
    layer_slots = [0] * len(layer_windows)
    for kind in kinds:  # full attention (0) first
        layers = layers_of[kind]
        for start in range(0, len(layers), group_size):
            for slot, layer in enumerate(layers[start:start + group_size]):
                layer_groups[layer], layer_slots[layer] = len(group_windows), slot
            group_windows.append(kind)
    return KVCacheLayout(tuple(group_windows), tuple(layer_groups), tuple(layer_slots), group_size)
