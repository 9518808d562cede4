"""LoRA on the decoder's projections for a batch that mixes adapters: a fixed pool of slots per layer and
the grouped products over a step's tokens.

Each wrapped projection (qkv_proj, o_proj, gate_up_proj, down_proj) keeps, per slot, A stacked over its
sub-projections ([slots, n_sub * R, in]: q, k, v each R rows, zero past an adapter's rank) and one B^T per
sub-projection ([slots, R, out_j], the adapter's scale folded in; [slots * R, out_j] is one matrix) and each
slot's rank per sub-projection. A step's `LoRAStep` lists the tokens that run with an adapter, grouped by
slot; base-model tokens are not touched.

On CPU, float32 and bfloat16 projections take one C++ call each for every adapter token of the step
(model/lora_cpu.py: each token's slot read in the kernel, rows past a slot's rank skipped, the work split over
torch's threads; float32 sums, one rounding into a bfloat16 output; bfloat16 slots on float32 rows with
--lora-dtype bfloat16). Other dtypes, or when the kernel does not build, use segmented products
(Punica's SGMV in torch): per slot in the step, its tokens' x @ A^T @ B^T, a loop over the step's adapters
(at most --max-loras), never over rows, on one thread (small ops on several threads each wait for all of
them). The segmented form costs ~6 small ops per adapter, projection and
layer; the kernel one call (docs/benchmarks.md, "LoRA products on CPU").
On CUDA two Triton kernels (model/lora_triton.py) take BGMV's form: one program a token, its slot read on
the device.
With tensor parallelism a rank's slots hold its share of each adapter (`shard_adapter`) and a row-parallel
projection adds its LoRA share before the all-reduce.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from llmserve.model import lora_cpu
from llmserve.model.lora_adapter import LoRAWeights
from llmserve.model.parallel import RowParallelLinear, ShardLayout, shard_of
from llmserve.model.quant.parallel import RowParallelQuantized

# fused projection of our decoder -> the HF module names it holds, in output order
FUSED_MODULES = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "o_proj": ("o_proj",),
                 "gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


@dataclass
class LoRAStep:
    """A forward's tokens that carry an adapter, grouped by slot (base-model tokens are left out)."""

    token_indices: torch.Tensor  # [N] int64 token positions in the step, slot by slot
    token_slots: torch.Tensor  # [N] int64 the slot of each
    segments: list[tuple[int, int, int]]  # (slot, start, end) over token_indices, one per slot in the step
    # A decode graph's step (worker/cuda_graphs.py): every token of the forward in order, slot -1 for the base
    # model's, at fixed shapes and addresses; no segments. Only the Triton kernels take it (they skip slot -1).
    is_padded: bool = False


def lora_step(token_slots: np.ndarray, device: torch.device) -> LoRAStep | None:
    """token_slots [T] (-1: the base model) -> the step's grouping; None when no token has an adapter."""
    indices = np.flatnonzero(token_slots >= 0)  # [N]
    if not len(indices):
        return None
    indices = indices[np.argsort(token_slots[indices], kind="stable")]
    slots = token_slots[indices]  # [N] sorted
    bounds = np.flatnonzero(np.diff(slots)) + 1
    starts, ends = np.concatenate(([0], bounds)), np.concatenate((bounds, [len(slots)]))
    segments = [(int(slots[s]), int(s), int(e)) for s, e in zip(starts, ends)]
    return LoRAStep(torch.from_numpy(indices).to(device), torch.from_numpy(slots.astype(np.int64)).to(device),
                    segments)


@dataclass
class SlotImage:
    """One projection's share of an adapter laid out as its slot holds it, built off the step loop, so that
    filling a slot on the loop is a few contiguous copies."""

    a: torch.Tensor  # [n_sub * R, in] A's rows, zero past each sub-projection's rank
    bs: list[torch.Tensor]  # [R, out_j] B^T of each sub-projection, zero past its rank
    ranks: torch.Tensor  # [n_sub] int32 (0: the adapter leaves that sub-projection)


AdapterImage = dict[tuple[str, int], SlotImage]  # (fused name, layer) -> its slot image


class LoRAContext:
    """What every wrapped projection reads during a forward: the step's grouping (None: base model only)."""

    def __init__(self) -> None:
        self.step: LoRAStep | None = None


class LoRALinear(nn.Module):
    """A projection plus the LoRA of the adapter in each token's slot: base(x) + x @ A[slot]^T @ B[slot]^T."""

    def __init__(self, base: nn.Module, in_features: int, out_sizes: list[int], num_slots: int, max_rank: int,
                 context: LoRAContext, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.base = base
        self.context = context
        self.max_rank = max_rank
        self.out_sizes = out_sizes
        self.register_buffer("lora_a", torch.zeros(num_slots, len(out_sizes) * max_rank, in_features, dtype=dtype,
                                                   device=device), persistent=False)  # [S, n_sub * R, in]
        self.register_buffer("lora_ranks", torch.zeros(num_slots, len(out_sizes), dtype=torch.int32, device=device),
                             persistent=False)  # [S, n_sub] each slot's rank per sub-projection (0: none)
        for j, size in enumerate(out_sizes):
            self.register_buffer(f"lora_b{j}", torch.zeros(num_slots, max_rank, size, dtype=dtype, device=device),
                                 persistent=False)  # [S, R, out_j]: B^T

    @property
    def lora_bs(self) -> list[torch.Tensor]:
        return [getattr(self, f"lora_b{j}") for j in range(len(self.out_sizes))]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, in] -> [T, out]. A row-parallel base (tensor parallelism; float or quantized) adds its rank's
        share of the LoRA (A's columns of its inputs, B whole) to its partial sum, and its one all-reduce sums
        both."""
        step = self.context.step
        if step is None:
            return self.base(x)
        if isinstance(self.base, (RowParallelLinear, RowParallelQuantized)):
            return self.base.tp.all_reduce(self._add(self.base.partial(x), x, step))
        return self._add(self.base(x), x, step)

    def _add(self, out: torch.Tensor, x: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        """out [T, out] += each adapter token's x @ A[slot]^T @ B[slot]^T, in place; returns out."""
        if x.is_cuda or step.is_padded:
            _triton_add()(out, x, self.lora_a, self.lora_bs, step)
        elif lora_cpu.can_run(x, out, self.lora_a.dtype):
            lora_cpu.add_lora(out, x, self.lora_a, self.lora_bs, self.lora_ranks, step.token_indices, step.token_slots)
        else:
            with _one_thread():
                add_lora_segmented(out, x, self.lora_a, self.lora_bs, step)
        return out

    def slot_image(self, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> SlotImage:
        """What a slot holds for these (A [r, in], B [out_j, r]) per sub-projection (None: the adapter leaves
        it): A's rows and B^T zero-padded to the slots' rank, in their dtype, on the host."""
        rank, dtype = self.max_rank, self.lora_a.dtype
        a = torch.zeros(self.lora_a.shape[1:], dtype=dtype)  # [n_sub * R, in]
        bs = [torch.zeros(rank, size, dtype=dtype) for size in self.out_sizes]  # [R, out_j] each
        for j, pair in enumerate(pairs):
            if pair is not None:
                a_j, b_j = pair
                a[j * rank:j * rank + a_j.shape[0]].copy_(a_j)
                bs[j][:b_j.shape[1]].copy_(b_j.T)
        ranks = torch.tensor([0 if pair is None else pair[0].shape[0] for pair in pairs], dtype=torch.int32)
        return SlotImage(a, bs, ranks)

    def write_slot(self, slot: int, image: SlotImage) -> None:
        """Slot `slot` takes `image`: one contiguous copy per buffer."""
        self.lora_a[slot].copy_(image.a)
        self.lora_ranks[slot].copy_(image.ranks)
        for b, image_b in zip(self.lora_bs, image.bs, strict=True):
            b[slot].copy_(image_b)

    def set_slot(self, slot: int, pairs: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Slot `slot` holds these (A [r, in], B [out_j, r]) per sub-projection (None: the adapter leaves it)."""
        self.write_slot(slot, self.slot_image(pairs))


@contextmanager
def _one_thread() -> Iterator[None]:
    """torch ops on one CPU thread inside: the small per-adapter ops would pay a fork/join each otherwise."""
    num_threads = torch.get_num_threads()
    if num_threads == 1:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(num_threads)


@functools.cache
def _triton_add():
    """The Triton kernels' entry (imported on first CUDA use: triton is not needed on CPU)."""
    from llmserve.model.lora_triton import add_lora_triton

    return add_lora_triton


def add_lora_segmented(out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bs: list[torch.Tensor],
                       step: LoRAStep) -> None:
    """out [T, out] += each token's LoRA, one pair of matmuls per slot over that slot's tokens (SGMV), in
    float32 for a half-precision model too, rounded once into out (as PEFT upcasts an adapter to float32)."""
    rank = bs[0].shape[1]
    for slot, start, end in step.segments:
        idx = step.token_indices[start:end]  # [n]
        shrunk = x.index_select(0, idx).float() @ a[slot].float().T  # [n, n_sub * R]
        delta = torch.cat([shrunk[:, j * rank:(j + 1) * rank] @ b[slot].float() for j, b in enumerate(bs)], dim=1)
        if out.dtype == torch.float32:
            out.index_put_((idx,), delta, accumulate=True)  # [n, out]; faster than index_add_ on CPU
        else:  # the float32 sum of the base output and the LoRA, rounded once
            out.index_copy_(0, idx, (delta + out.index_select(0, idx)).to(out.dtype))


def attach_lora(model: nn.Module, num_slots: int, max_rank: int,
                slot_dtype: torch.dtype | None = None) -> tuple[LoRAContext, dict[str, list]]:
    """Wrap every dense decoder layer's projections of a loaded CausalLM (MoE MLPs keep none) in place, with
    slots in `slot_dtype` (None: the model's).

    Returns the shared context and {fused name: [LoRALinear or None per layer]}."""
    context = LoRAContext()
    param = model.model.embed_tokens.weight  # the model's dtype (a quantized model's projections hold int8/FP8)
    slot_dtype = slot_dtype or param.dtype
    wrapped: dict[str, list] = {name: [] for name in FUSED_MODULES}
    for layer in model.model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        hidden = model.config.hidden_size
        sizes = {"qkv_proj": (attn, hidden, [attn.q_size, attn.kv_size, attn.kv_size]),
                 "o_proj": (attn, attn.q_size, [hidden])}
        if hasattr(mlp, "gate_up_proj"):
            inter = mlp.intermediate_size
            sizes |= {"gate_up_proj": (mlp, hidden, [inter, inter]), "down_proj": (mlp, inter, [hidden])}
        for name in FUSED_MODULES:
            if name not in sizes:
                wrapped[name].append(None)
                continue
            owner, in_features, out_sizes = sizes[name]
            module = LoRALinear(getattr(owner, name), in_features, out_sizes, num_slots, max_rank, context,
                                slot_dtype, param.device)
            setattr(owner, name, module)
            wrapped[name].append(module)
    return context, wrapped


def adapter_image(wrapped: dict[str, list], weights: LoRAWeights) -> AdapterImage:
    """An adapter as every wrapped projection's slot holds it (zeros where it has no module); ValueError when
    it targets a layer whose projection has no LoRA (an MoE layer's MLP)."""
    placed, image = set(), {}
    for fused, modules in FUSED_MODULES.items():
        for layer, linear in enumerate(wrapped[fused]):
            pairs = [weights.modules.get((layer, module)) for module in modules]
            if linear is None:
                if any(pairs):
                    raise ValueError(f"layer {layer}'s {fused} takes no LoRA (a Mixture-of-Experts layer)")
                continue
            image[fused, layer] = linear.slot_image(pairs)
            placed.update((layer, m) for m, p in zip(modules, pairs) if p is not None)
    assert placed == set(weights.modules), "an adapter module found no projection"
    return image


def load_slot(wrapped: dict[str, list], slot: int, image: AdapterImage) -> None:
    """Write an adapter's image into slot `slot` of every wrapped projection."""
    with _one_thread():  # small copies: a fork/join each on several threads
        for (fused, layer), slot_image in image.items():
            wrapped[fused][layer].write_slot(slot, slot_image)


def shard_adapter(weights: LoRAWeights, layout: ShardLayout) -> LoRAWeights:
    """A tensor-parallel rank's share of an adapter, split as its base projection is (vLLM's split):
    column-parallel (q/k/v, gate/up: this rank's output rows) keep A whole and B's rows of those outputs;
    row-parallel (o, down: this rank's input columns) take A's columns of those inputs and B whole, their
    products summed by the layer's all-reduce."""
    modules = {}
    for (layer, module), (a, b) in weights.modules.items():
        shard = shard_of(f"model.layers.{layer}.{module}.weight", layout)  # (dim of [out, in], start, length)
        if shard is not None:
            dim, start, length = shard
            a, b = (a, b[start:start + length]) if dim == 0 else (a[:, start:start + length], b)
        modules[(layer, module)] = (a.contiguous(), b.contiguous())
    return LoRAWeights(weights.rank, modules)
