"""Paged attention in plain PyTorch: the CPU backend and the generic fallback.

Per step, `build_metadata` splits the rows into groups and precomputes, once for all layers, each
group's token indices, its block table truncated to the group's longest sequence and its boolean
attention mask. Decode rows (query_len == 1) are sorted by length and cut into a few buckets so that
short rows do not pay for the longest one's KV gather. Prefill rows (query_len > 1) form a few groups
too; a group whose rows have no cached prefix attends over the step's own k/v and skips the cache.

Per layer, `forward` writes the new K/V into the cache at the slot mapping, then for each group
gathers the padded q (and K/V through the block table), runs one scaled_dot_product_attention and
scatters the result back to [T, H, D]. The work per layer is a handful of batched calls, never a loop
over requests. Decode folds the G query heads of a kv head into the query axis (q [Bg, Hkv, G, D]);
prefill uses SDPA's enable_gqa. K/V are never repeated per query head.

On CPU, when the C++ kernel of `cpu_kernels` builds, decode-like rows (query_len 1, or up to 16 over a
cached prefix: speculative verification, short chunks) skip all that: one kernel call per layer reads
their K/V in place through the block table (no gather copies) and writes their out rows directly.
The other rows keep the groups above. LLMSERVE_CPU_KERNELS=0, or any build failure, keeps torch only.

A layer with a sliding window gets groups that gather each row's blocks from its first query's window on, with
masks that hide the keys before the window (built on its first call in the step, then shared by every layer
of that window); the kernel skips those keys itself.
Attention sinks take a float32 math path over the same groups (SDPA has no sink term).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import torch
import torch.nn.functional as F

from llmserve.model import cpu_kernels
from llmserve.model.attention import FP8_KV_DTYPE, K_SCALE, V_SCALE, AttentionBackend, AttentionInputs, as_int32, write_kv

_MAX_DECODE_BUCKETS = 4
_BUCKET_OVERHEAD_BLOCKS = 32  # a bucket's fixed cost, in gathered blocks: split only when it pays
_MAX_PREFILL_GROUPS = 4


@dataclass
class GroupMetadata:
    """Bg rows attended together; Q = their longest query, K = keys (cache or the step's own k/v)."""

    token_index: torch.Tensor  # [Bg * Q] int64: flat token of each padded query slot (pads -> 0)
    valid_slots: torch.Tensor | None  # [n] int64: the real query slots; None when nothing is padded
    valid_tokens: torch.Tensor  # [n] int64: their flat tokens (token_index[valid_slots])
    block_table: torch.Tensor | None  # [Bg * nb] int64, K = nb * block_size; None: keys = new tokens
    attn_mask: torch.Tensor | None  # [Bg, 1, Q, K] bool, True = attend; None: plain causal (fresh rows, equal lengths)
    num_rows: int
    max_query_len: int
    is_in_token_order: bool  # decode rows 0..T-1 in order: q and out need no gather/scatter


@dataclass
class KernelRows:
    """Decode-like rows for the C++ kernel: it reads the step's int32 tensors as they are."""

    rows: torch.Tensor  # [R] int32
    block_table: torch.Tensor  # [B, W] int32
    seq_lens: torch.Tensor  # [B] int32
    query_start_loc: torch.Tensor  # [B + 1] int32
    make_groups: Callable[[int], list[GroupMetadata]]  # the same rows as torch groups, under a window
    fallback: dict[int, list[GroupMetadata]] = field(default_factory=dict)

    def fallback_groups(self, window: int) -> list[GroupMetadata]:
        """The rows as torch groups (a dtype or layout the kernel does not take), built once per window."""
        if window not in self.fallback:
            self.fallback[window] = self.make_groups(window)
        return self.fallback[window]


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64
    groups: list[GroupMetadata]  # the SDPA rows under full attention
    kernel: KernelRows | None = None
    make_groups: Callable[[int], list[GroupMetadata]] | None = None  # the same rows under a window
    max_seq_len: int = 0
    windowed: dict[int, list[GroupMetadata]] = field(default_factory=dict)

    def groups_for(self, window: int) -> list[GroupMetadata]:
        """The SDPA rows' groups under `window` (0, or one no row outgrows: the full-attention groups)."""
        if window <= 0 or window >= self.max_seq_len or not self.groups:
            return self.groups
        if window not in self.windowed:
            self.windowed[window] = self.make_groups(window)
        return self.windowed[window]


def _row_token_index(query_start: list[int], query_lens: list[int], max_query_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows' token indices padded to max_query_len -> (index [Bg, Q] int64, is_valid [Bg, Q] bool)."""
    starts = torch.tensor(query_start, dtype=torch.int64)[:, None]  # [Bg, 1]
    lens = torch.tensor(query_lens, dtype=torch.int64)[:, None]  # [Bg, 1]
    offsets = torch.arange(max_query_len, dtype=torch.int64)[None, :]  # [1, Q]
    is_valid = offsets < lens
    return torch.where(is_valid, starts + offsets, 0), is_valid


def _causal_mask(query_lens: list[int], seq_lens: list[int], max_query_len: int, max_kv_len: int,
                 window: int = 0, key_starts: list[int] | None = None) -> torch.Tensor:
    """[Bg, 1, Q, K] bool: query j of a row (at p = seq_len - query_len + j) sees key k iff k < seq_len, k <= p
    and, with a window, k > p - window; key slot i of a row is position key_starts[row] + i (default 0).
    Padded query slots see every key (no empty softmax; dropped later)."""
    q_lens = torch.tensor(query_lens, dtype=torch.int64)[:, None, None]  # [Bg, 1, 1]
    s_lens = torch.tensor(seq_lens, dtype=torch.int64)[:, None, None]  # [Bg, 1, 1]
    q_pos = torch.arange(max_query_len, dtype=torch.int64)[None, :, None]  # [1, Q, 1]
    k_pos = torch.arange(max_kv_len, dtype=torch.int64)[None, None, :]  # [1, 1, K]
    if key_starts is not None:
        k_pos = k_pos + torch.tensor(key_starts, dtype=torch.int64)[:, None, None]  # [Bg, 1, K]
    pos = s_lens - q_lens + q_pos  # [Bg, Q, 1]
    mask = (k_pos <= pos) & (k_pos < s_lens)  # [Bg, Q, K]
    if window > 0:
        mask &= (k_pos > pos - window) | (q_pos >= q_lens)
    return mask[:, None]


def _build_group(inputs: AttentionInputs, rows: list[int], query_start: list[int], window: int = 0) -> GroupMetadata:
    device = inputs.block_table.device
    query_lens = [inputs.query_lens_cpu[i] for i in rows]
    seq_lens = [inputs.seq_lens_cpu[i] for i in rows]
    max_query_len = max(query_lens)
    is_fresh = max_query_len > 1 and query_lens == seq_lens  # no cached prefix: keys = the new tokens
    token_index, is_valid = _row_token_index([query_start[i] for i in rows], query_lens, max_query_len)
    valid_slots = is_valid.flatten().nonzero().squeeze(1)
    block_table = mask = None
    if is_fresh:
        if len(set(query_lens)) > 1 or 0 < window < max_query_len:  # equal lengths, no window: plain causal
            mask = _causal_mask(query_lens, seq_lens, max_query_len, max_query_len, window).to(device)
    elif window > 0:
        block_table, first_blocks = _window_blocks(inputs, rows, query_lens, seq_lens, window)
        key_starts = [b * inputs.block_size for b in first_blocks]
        mask = _causal_mask(query_lens, seq_lens, max_query_len, block_table.numel() // len(rows) * inputs.block_size,
                            window, key_starts).to(device)
    else:
        num_blocks = -(-max(seq_lens) // inputs.block_size)
        assert num_blocks <= inputs.block_table.shape[1], "block table narrower than the longest sequence"
        row_index = torch.tensor(rows, dtype=torch.int64, device=device)
        block_table = inputs.block_table.index_select(0, row_index)[:, :num_blocks].long().flatten()
        mask = _causal_mask(query_lens, seq_lens, max_query_len, num_blocks * inputs.block_size).to(device)
    return GroupMetadata(
        token_index=token_index.flatten().to(device),
        valid_slots=None if bool(is_valid.all()) else valid_slots.to(device),
        valid_tokens=token_index.flatten()[valid_slots].to(device), block_table=block_table,
        attn_mask=mask, num_rows=len(rows), max_query_len=max_query_len,
        is_in_token_order=max_query_len == 1 and rows == list(range(len(rows))))


def _window_blocks(inputs: AttentionInputs, rows: list[int], query_lens: list[int], seq_lens: list[int],
                   window: int) -> tuple[torch.Tensor, list[int]]:
    """The rows' blocks from the one holding their first query's first visible key -> (block ids [Bg * nb] int64,
    each row's first block index): a long row gathers about window / block_size blocks, not its whole length.
    Columns past a row's table read its last entry; the mask hides them (their positions are >= seq_len)."""
    block_size, width = inputs.block_size, inputs.block_table.shape[1]
    assert -(-max(seq_lens) // block_size) <= width, "block table narrower than the longest sequence"
    first_blocks = [max(0, s - q - window + 1) // block_size for q, s in zip(query_lens, seq_lens)]
    num_blocks = max(-(-s // block_size) - b for s, b in zip(seq_lens, first_blocks))
    cols = torch.tensor(first_blocks, dtype=torch.int64)[:, None] + torch.arange(num_blocks)[None, :]  # [Bg, nb]
    device = inputs.block_table.device
    row_index = torch.tensor(rows, dtype=torch.int64)[:, None].expand_as(cols)  # [Bg, nb]
    table = inputs.block_table[row_index.to(device), cols.clamp_(max=width - 1).to(device)]  # [Bg, nb]
    return table.long().flatten(), first_blocks


def _padded_blocks(num_blocks: list[int], num_buckets: int) -> int:
    """Blocks gathered when rows sorted by num_blocks are cut into num_buckets equal-count buckets."""
    size = -(-len(num_blocks) // num_buckets)
    return sum(len(num_blocks[i:i + size]) * num_blocks[i:i + size][-1] for i in range(0, len(num_blocks), size))


def _decode_buckets(rows: list[int], inputs: AttentionInputs) -> list[list[int]]:
    """Decode rows in a few buckets of similar length (rows kept in order when one bucket wins)."""
    ordered = sorted(rows, key=lambda i: inputs.seq_lens_cpu[i])
    num_blocks = [-(-inputs.seq_lens_cpu[i] // inputs.block_size) for i in ordered]
    best, best_cost = 1, _padded_blocks(num_blocks, 1) + _BUCKET_OVERHEAD_BLOCKS
    for n in range(2, min(_MAX_DECODE_BUCKETS, len(rows)) + 1):
        cost = _padded_blocks(num_blocks, n) + n * _BUCKET_OVERHEAD_BLOCKS
        if cost < best_cost:
            best, best_cost = n, cost
    if best == 1:
        return [rows]
    size = -(-len(ordered) // best)
    return [ordered[i:i + size] for i in range(0, len(ordered), size)]


def _prefill_groups(rows: list[int], inputs: AttentionInputs) -> list[list[int]]:
    """Prefill rows: fresh and continuing apart; one group per row when few, else length buckets."""
    groups = []
    for is_fresh in (True, False):
        part = [i for i in rows if (inputs.query_lens_cpu[i] == inputs.seq_lens_cpu[i]) == is_fresh]
        part.sort(key=lambda i: inputs.seq_lens_cpu[i])
        size = max(1, -(-len(part) // _MAX_PREFILL_GROUPS))
        groups += [part[i:i + size] for i in range(0, len(part), size)]
    return groups


def _gather_kv(kv_cache: torch.Tensor, block_table: torch.Tensor, num_rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_cache [2, N, bs, Hkv, D], block_table [Bg * nb] -> k, v [Bg, Hkv, nb * bs, D]."""
    _, _, block_size, num_kv_heads, head_dim = kv_cache.shape
    kv_len = block_table.numel() // num_rows * block_size
    stored = kv_cache.view(torch.uint8) if kv_cache.dtype == FP8_KV_DTYPE else kv_cache  # no float8 index_select
    k = stored[0].index_select(0, block_table).view(kv_cache.dtype).view(num_rows, kv_len, num_kv_heads, head_dim)
    v = stored[1].index_select(0, block_table).view(kv_cache.dtype).view(num_rows, kv_len, num_kv_heads, head_dim)
    return k.transpose(1, 2), v.transpose(1, 2)


def _as_cached(x: torch.Tensor, cache_dtype: torch.dtype, scale: float) -> torch.Tensor:
    """x [T, Hkv, D] rounded through a cache of another dtype (fp8 with its scale, float16): stored, then read back."""
    if cache_dtype != FP8_KV_DTYPE:
        return x.to(cache_dtype).to(x.dtype)
    fp8_max = torch.finfo(FP8_KV_DTYPE).max
    return ((x.float() / scale).clamp(-fp8_max, fp8_max).to(FP8_KV_DTYPE).to(x.dtype)) * scale


def _new_kv(k: torch.Tensor, v: torch.Tensor, group: GroupMetadata) -> tuple[torch.Tensor, torch.Tensor]:
    """The step's own k/v [T, Hkv, D] padded like q -> k, v [Bg, Hkv, Q, D]."""
    shape = (group.num_rows, group.max_query_len, k.shape[1], k.shape[2])
    k = k.index_select(0, group.token_index).view(shape)
    v = v.index_select(0, group.token_index).view(shape)
    return k.transpose(1, 2), v.transpose(1, 2)


def _attend_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Bg, H, D], k/v [Bg, Hkv, K, D], mask [Bg, 1, 1, K] -> [Bg, H, D]."""
    num_rows, num_heads, head_dim = q.shape
    qf = q.view(num_rows, k.shape[1], num_heads // k.shape[1], head_dim)  # [Bg, Hkv, G, D]
    out = F.scaled_dot_product_attention(qf, k, v, attn_mask=mask, scale=scale)  # [Bg, Hkv, G, D]
    return out.reshape(num_rows, num_heads, head_dim)


def _attend_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: GroupMetadata,
                    scale: float) -> torch.Tensor:
    """q [Bg * Q, H, D], k/v [Bg, Hkv, K, D] -> [Bg * Q, H, D]."""
    num_heads, head_dim = q.shape[1], q.shape[2]
    qb = q.view(group.num_rows, group.max_query_len, num_heads, head_dim).transpose(1, 2)  # [Bg, H, Q, D]
    out = F.scaled_dot_product_attention(qb, k, v, attn_mask=group.attn_mask, scale=scale,
                                         is_causal=group.attn_mask is None, enable_gqa=True)  # [Bg, H, Q, D]
    return out.transpose(1, 2).reshape(-1, num_heads, head_dim)


def _attend_with_sinks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None,
                       sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """q [Bg, H, Q, D], k/v [Bg, Hkv, K, D], mask [Bg, 1, Q, K] bool (None: plain causal) -> [Bg, H, Q, D]:
    softmax over the visible keys plus one sink logit per head (sinks [H]) in the denominator, float32."""
    num_queries, num_keys = q.shape[2], k.shape[2]
    if mask is None:
        mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).tril(num_keys - num_queries)
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1).float(), v.repeat_interleave(group, 1).float()  # [Bg, H, K, D]
    scores = torch.einsum("bhqd,bhkd->bhqk", q.float(), k).mul_(scale).masked_fill_(~mask, float("-inf"))
    sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)  # [Bg, H, Q, 1]
    lse = torch.logsumexp(torch.cat([scores, sink], -1), -1, keepdim=True)  # [Bg, H, Q, 1]
    return torch.einsum("bhqk,bhkd->bhqd", torch.exp(scores - lse), v).to(q.dtype)


def _attend_group(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                  group: GroupMetadata, scale: float, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, H, D], k/v [T, Hkv, D] -> the group's out [Bg * Q, H, D] (padded slots included)."""
    qg = q[:group.num_rows] if group.is_in_token_order else q.index_select(0, group.token_index)
    if group.block_table is None:
        kg, vg = _new_kv(k, v, group)
    else:
        kg, vg = _gather_kv(kv_cache, group.block_table, group.num_rows)
        if kg.dtype == FP8_KV_DTYPE:  # dequantize what was gathered (the reference path)
            kg, vg = kg.to(q.dtype) * K_SCALE, vg.to(q.dtype) * V_SCALE
        elif kg.dtype != q.dtype:  # a float16 cache of a float32 model: upcast what was gathered
            kg, vg = kg.to(q.dtype), vg.to(q.dtype)
    if sinks is not None:
        qb = qg.view(group.num_rows, group.max_query_len, *qg.shape[1:]).transpose(1, 2)  # [Bg, H, Q, D]
        out = _attend_with_sinks(qb, kg, vg, group.attn_mask, sinks, scale)  # [Bg, H, Q, D]
        return out.transpose(1, 2).reshape(qg.shape)
    if group.max_query_len == 1:
        return _attend_decode(qg, kg, vg, group.attn_mask, scale)
    return _attend_prefill(qg, kg, vg, group, scale)


def _row_groups(rows: list[int], inputs: AttentionInputs, query_start: list[int],
                window: int = 0) -> list[GroupMetadata]:
    decode_rows = [i for i in rows if inputs.query_lens_cpu[i] == 1]
    prefill_rows = [i for i in rows if inputs.query_lens_cpu[i] > 1]
    row_groups = (_decode_buckets(decode_rows, inputs) if decode_rows else [])
    row_groups += _prefill_groups(prefill_rows, inputs)
    return [_build_group(inputs, group_rows, query_start, window) for group_rows in row_groups]


def _kernel_rows(inputs: AttentionInputs, query_start: list[int], takes_prompts: bool,
                 max_prompt_seq_len: int | None = None) -> tuple[KernelRows | None, list[int]]:
    """Split off the rows the kernel attends (all of them when it takes prompts, up to max_prompt_seq_len keys
    where that is set; else the decode-like ones: query_len 1, or <= 16 over a cached prefix) -> (them, the rest)."""
    query_lens, seq_lens = inputs.query_lens_cpu, inputs.seq_lens_cpu
    is_every_row = takes_prompts and (max_prompt_seq_len is None or max(seq_lens, default=0) <= max_prompt_seq_len)
    if is_every_row or max(query_lens, default=0) == 1:  # every row, no per-row test
        rows, rest, row_index = list(range(len(query_lens))), [], torch.arange(len(query_lens), dtype=torch.int32)
    else:
        limit = max_prompt_seq_len if takes_prompts else 0
        is_kernel = [n == 1 or (n <= cpu_kernels.MAX_QUERY_LEN and n < s) or s <= limit
                     for n, s in zip(query_lens, seq_lens)]
        rows = [i for i, ok in enumerate(is_kernel) if ok]
        rest = [i for i, ok in enumerate(is_kernel) if not ok]
        row_index = torch.tensor(rows, dtype=torch.int32)
    if not rows:
        return None, rest
    assert -(-max(map(seq_lens.__getitem__, rows)) // inputs.block_size) <= inputs.block_table.shape[1], \
        "block table narrower than the longest sequence"
    kernel = KernelRows(rows=row_index, block_table=as_int32(inputs.block_table),
                        seq_lens=as_int32(inputs.seq_lens), query_start_loc=as_int32(inputs.query_start_loc),
                        make_groups=lambda window: _row_groups(rows, inputs, query_start, window))
    return kernel, rest


class TorchAttentionBackend(AttentionBackend):
    """Batched paged attention with torch SDPA: a few calls per layer, whatever the batch.

    use_cpu_kernel: None = the C++ kernel for decode-like rows on CPU whenever it builds; False = never.
    kernel_takes_prompts: the kernel attends prompt rows too (`cpu_kernels.attends_prompts` of the model's
    dtype), those of sequences up to max_kernel_prompt_seq_len keys where that is set; else SDPA does.
    """

    name = "torch"

    def __init__(self, use_cpu_kernel: bool | None = None, kernel_takes_prompts: bool = False,
                 max_kernel_prompt_seq_len: int | None = None):
        self.use_cpu_kernel = use_cpu_kernel
        self.kernel_takes_prompts = kernel_takes_prompts
        self.max_kernel_prompt_seq_len = max_kernel_prompt_seq_len

    def _kernel_enabled(self, inputs: AttentionInputs) -> bool:
        return (self.use_cpu_kernel is not False and inputs.block_table.device.type == "cpu"
                and cpu_kernels.available())

    def build_metadata(self, inputs: AttentionInputs) -> TorchAttentionMetadata:
        query_start = list(accumulate(inputs.query_lens_cpu, initial=0))[:-1]  # [B]
        kernel, rows = None, list(range(len(query_start)))
        if self._kernel_enabled(inputs):
            kernel, rows = _kernel_rows(inputs, query_start, self.kernel_takes_prompts,
                                        self.max_kernel_prompt_seq_len)
        return TorchAttentionMetadata(slot_mapping=inputs.slot_mapping.long(),
                                      groups=_row_groups(rows, inputs, query_start), kernel=kernel,
                                      make_groups=lambda window: _row_groups(rows, inputs, query_start, window),
                                      max_seq_len=max(inputs.seq_lens_cpu, default=0))

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                metadata: TorchAttentionMetadata, scale: float, window: int = 0,
                sinks: torch.Tensor | None = None) -> torch.Tensor:
        """q [T, H, D], k/v [T, Hkv, D], kv_cache [2, N, bs, Hkv, D], sinks [H] or None -> out [T, H, D]."""
        write_kv(kv_cache, metadata.slot_mapping, k, v)
        groups, out = metadata.groups_for(window), None
        kernel = metadata.kernel
        if kernel is not None:
            if cpu_kernels.supports(q, kv_cache):
                out = q.new_empty(q.shape)
                cpu_kernels.paged_attention(out, q, kv_cache, kernel.block_table, kernel.seq_lens,
                                            kernel.query_start_loc, kernel.rows, scale, window, sinks)
                if not groups:  # the kernel read everything from the cache: k/v are not needed again
                    return out
            else:  # a dtype or layout the kernel does not take: the same rows through torch
                groups = kernel.fallback_groups(window) + groups
        if groups and kv_cache.dtype == torch.int8:
            raise RuntimeError("an int8 KV cache is read by the CPU attention kernel only, and it must take every "
                               "row (--kv-cache-dtype int8 needs the AVX2 kernels and a float32 model)")
        if kv_cache.dtype != k.dtype:  # the step's own K/V as the cache holds them (fp8, float16): a prompt
            # reads the same whether chunked or not
            k, v = _as_cached(k, kv_cache.dtype, K_SCALE), _as_cached(v, kv_cache.dtype, V_SCALE)
        if out is None and len(groups) == 1 and groups[0].is_in_token_order and groups[0].num_rows == q.shape[0]:
            return _attend_group(q, k, v, kv_cache, groups[0], scale, sinks)
        if out is None:
            out = q.new_empty(q.shape)
        for group in groups:
            group_out = _attend_group(q, k, v, kv_cache, group, scale, sinks)
            if group.valid_slots is not None:
                group_out = group_out.index_select(0, group.valid_slots)
            out.index_copy_(0, group.valid_tokens, group_out)
        return out
