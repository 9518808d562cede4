"""Optional C++ CPU kernels, JIT-built on first use with torch.utils.cpp_extension.

`paged_attention` attends rows of any query length straight from the paged KV cache through the block
table (csrc/paged_attention.cpp): no K/V gather copies, float32 online softmax, OpenMP over work items
(a row's tile of up to 16 query tokens, per kv head or all; few rows' items split over their keys); float32,
and bfloat16 over a bfloat16 cache, with head_dim % 8 == 0 run an AVX2 + FMA path when the build has them
(csrc/paged_attention_avx2.cpp). That path also beats torch's SDPA on whole float32 prompts, and on bfloat16 ones
up to ~1,000 keys (`attends_prompts`); the portable one is kept to decode-like rows. A float32
model's cache may be float16 (--kv-cache-dtype fp16): the AVX2 path widens it with F16C. The build (model/cpu_build.py)
goes to <llmserve cache>/torch_extensions/<torch+python tag>/ with -O3 and -fopenmp, plus -mavx2 -mfma
(and -mf16c, AVX-512) when the CPU has them. It needs a C++ compiler and ninja; when the build or load fails (or
LLMSERVE_CPU_KERNELS=0), `available()` is False, a line is logged once, and callers keep their plain
torch path.

The same build holds the fused elementwise ops of a float32 or bfloat16 decoder layer (csrc/fused_ops.cpp): RMSNorm
(with the residual add, in place), SiLU-and-mul, rotary in place and the K/V write into the paged cache;
`can_fuse(x)` says when the model's layers call them instead of their chains of torch ops.

And float32 linear layers (csrc/linear_avx2.cpp, AVX2 + FMA builds: `has_avx2_kernels`): a weight packed
once into 16-column panels, multiplied by a kernel that streams it with prefetches, through AVX-512 registers
where the CPU has them (csrc/linear_avx512.cpp, built with -mavx512f... there); model/linear.py uses it instead of
oneDNN (`packs_linears`; LLMSERVE_CPU_LINEAR forces either: model/cpu_isa.py). With AVX512-BF16, bfloat16
decode rows go through a GEMV on the weight as loaded (`bf16_gemv`).
The float32 experts of an MoE layer, packed as those linears' panels, run in one op a layer (csrc/moe_experts.cpp:
`moe_experts`, called by model/moe_cpu.py).
Likewise int8 linear layers (csrc/int8_linear_avx2.cpp): on CPUs where oneDNN has no VNNI its s8 GEMM is inexact, and
model/quant/linear.py's Int8Linear runs this exact one instead (`packs_int8`).
"""

from __future__ import annotations

import functools
import logging
import os

import torch
import torch.nn.functional as F

from llmserve.model import cpu_build, cpu_isa

logger = logging.getLogger(__name__)

MAX_QUERY_LEN = 16  # decode-like rows: up to this many query tokens over a cached prefix
SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_CSRC = cpu_build.CSRC
_SOURCES = [os.path.join(_CSRC, name) for name in ("paged_attention.cpp", "paged_attention_avx2.cpp", "fused_ops.cpp",
                                                      "linear_avx2.cpp", "int8_linear_avx2.cpp", "linear_avx512.cpp",
                                                      "fused_ops_bf16.cpp", "paged_attention_split.cpp",
                                                      "decode_stack.cpp", "moe_experts.cpp", "moe_layer.cpp",
                                                      "sampling_ops.cpp", "sampling_rows.cpp")]
_HEADERS = [os.path.join(_CSRC, name) for name in ("paged_attention.h", "avx2_math.h", "panel_gemm.h",
                                                                     "panel_blocks.h", "fused_ops_bf16.h", "cpu_ops.h",
                                                                     "decode_head.h", "moe_layer.h", "balanced_for.h",
                                                                     "bf16_avx2.h", "attention_avx2.h")]
_NAME = "llmserve_cpu_kernels"


def _self_test(ops) -> None:
    """Tiny cases against plain torch (attention over a float32 and a float16 cache, with a window and sinks,
    the fused ops): a miscompiled kernel must not serve."""
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn(2, 5, 4, 1, 8, generator=gen)
    q = torch.randn(3, 2, 8, generator=gen)  # row 0: 1 query over 6 keys; row 1: 2 queries over 3 keys
    _self_test_case(ops.paged_attention, q, kv)
    _self_test_case(ops.paged_attention, q, kv.half())
    _self_test_case(ops.paged_attention, q, kv, window=2, sinks=torch.randn(2, generator=gen))
    x, weight = torch.randn(3, 20, generator=gen), torch.randn(20, generator=gen)
    normed, silu = torch.empty_like(x), torch.empty(3, 10)
    ops.rms_norm(normed, x, weight, 1e-6)
    ops.silu_mul(silu, x)
    expected = (weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)), F.silu(x[:, :10]) * x[:, 10:])
    if not all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip((normed, silu), expected)):
        raise RuntimeError("self-test mismatch (fused ops)")
    if "-mavx2" in cpu_build.compile_flags():  # the packed linear
        w, bias, x = torch.randn(21, 9, generator=gen), torch.randn(21, generator=gen), torch.randn(7, 9, generator=gen)
        out = torch.empty(7, 21)
        ops.packed_linear(out, x, ops.pack_linear_weight(w), bias)
        if not torch.allclose(out, F.linear(x, w, bias), atol=1e-5, rtol=1e-5):
            raise RuntimeError("self-test mismatch (packed linear)")
        _self_test_int8(ops, gen)
        _self_test_moe(ops, gen)


def _self_test_int8(ops, gen: torch.Generator) -> None:
    """The int8 linear against its definition in float64 (exact integer sums; K odd, N not a multiple of 16)."""
    q = torch.randint(-127, 128, (21, 9), generator=gen, dtype=torch.int8)
    w_scale, x = torch.rand(21, generator=gen) + 0.5, torch.randn(5, 9, generator=gen)
    out = torch.empty(5, 21)
    ops.int8_linear(out, x, ops.pack_int8_weight(q), w_scale, None)
    x_scale = (x.abs().amax(1, keepdim=True) / 127.0).clamp(min=1e-12)
    expected = (torch.round(x / x_scale).double() @ q.double().t()) * x_scale.double() * w_scale.double()
    if not torch.allclose(out.double(), expected, atol=1e-5, rtol=1e-5):
        raise RuntimeError("self-test mismatch (int8 linear)")


def _self_test_moe(ops, gen: torch.Generator) -> None:
    """moe_experts on 2 experts (H = 20: a partial last panel, I = 16) against F.linear per pair."""
    gate_up = torch.randn(2, 32, 20, generator=gen)  # [E, 2I, H]
    down = torch.randn(2, 20, 16, generator=gen)  # [E, H, I]
    rows, weights = torch.randn(3, 20, generator=gen), torch.rand(6, generator=gen)  # 3 sorted pairs of 6
    pairs, experts = torch.tensor([4, 1, 2]), [0, 1, 1]
    out = torch.zeros(6, 20)
    panels = [torch.stack([ops.pack_linear_weight(w) for w in weight]) for weight in (gate_up, down)]
    ops.moe_experts(out, rows, torch.tensor([1, 2]), pairs, weights, *panels, None, None, False)
    expected = torch.zeros(6, 20)
    for row, (pair, e) in enumerate(zip(pairs.tolist(), experts)):
        gate, up = F.linear(rows[row], gate_up[e]).chunk(2)
        expected[pair] = F.linear(F.silu(gate) * up, down[e]) * weights[pair]
    if not torch.allclose(out, expected, atol=1e-4, rtol=1e-4):
        raise RuntimeError("self-test mismatch (MoE experts)")


def _self_test_case(op, q: torch.Tensor, kv: torch.Tensor, window: int = 0, sinks: torch.Tensor | None = None) -> None:
    table = torch.tensor([[3, 1], [4, 0]], dtype=torch.int32)
    out = torch.zeros_like(q)
    op(out, q, kv, table, torch.tensor([6, 3], dtype=torch.int32), torch.tensor([0, 1, 3], dtype=torch.int32),
       torch.tensor([0, 1], dtype=torch.int32), 0.5, window, sinks)
    kv = kv.float()
    keys = [torch.cat([kv[:, 3], kv[:, 1]], dim=1)[:, :6, 0], kv[:, 4, :3, 0]]  # [2, S, 8] each
    for row, (a, b) in enumerate([(0, 1), (1, 3)]):
        k, v = keys[row]
        scores = torch.einsum("qhd,sd->qhs", q[a:b], k) * 0.5  # [Q, H, S]
        pos = torch.arange(b - a)[:, None] + k.shape[0] - (b - a)  # [Q, 1]
        key_pos = torch.arange(k.shape[0])[None, :]  # [1, S]
        visible = (key_pos <= pos) & ((key_pos > pos - window) if window > 0 else True)
        scores = scores.masked_fill(~visible[:, None], float("-inf"))
        if sinks is not None:  # one more logit per head, no value
            scores = torch.cat([scores, sinks.view(1, -1, 1).expand(b - a, -1, 1)], dim=-1)
        ref = torch.einsum("qhs,sd->qhd", scores.softmax(-1)[..., :k.shape[0]], v)
        if not torch.allclose(out[a:b], ref, atol=1e-5, rtol=1e-5):
            raise RuntimeError("self-test mismatch")


def _load():
    if cpu_build.kernels_disabled():
        logger.info("CPU kernels disabled (LLMSERVE_CPU_KERNELS=0): torch attention path")
        return None
    build_dir = cpu_build.build_dir(cpu_build.compile_flags())
    if cpu_build.needs_build(build_dir, _NAME, _SOURCES + _HEADERS):
        logger.info("compiling the C++ CPU kernels (model/csrc) into %s: this takes about %s the first "
                    "time, later starts load the build", build_dir, cpu_build.FIRST_BUILD_TIME)
    return cpu_build.build_and_load(_NAME, _SOURCES, "llmserve_cpu", _self_test, "CPU kernels", "using the torch path",
                                    extra_cflags=(cpu_build.header_digest(_HEADERS),))


@functools.cache
def _ops():
    """The loaded ops' namespace, or None: built (or found failing) once per process."""
    return _load()


def available() -> bool:
    """Whether the kernels are built and loaded (builds them on the first call; False on any failure)."""
    return _ops() is not None


def supports(q: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """q and the cache share a supported dtype, or q is float32 over a float16 cache (--kv-cache-dtype fp16) or an
    int8 one (--kv-cache-dtype int8: the start-up check asked for the AVX2 build, and the kernel refuses it
    without)."""
    is_f16_of_f32 = q.dtype == torch.float32 and kv_cache.dtype == torch.float16
    is_i8_of_f32 = q.dtype == torch.float32 and kv_cache.dtype == torch.int8
    return (q.device.type == "cpu" and kv_cache.device.type == "cpu" and q.dtype in SUPPORTED_DTYPES
            and (q.dtype == kv_cache.dtype or is_f16_of_f32 or is_i8_of_f32) and kv_cache.is_contiguous()
            and q.stride(-1) == 1)


def paged_attention(out: torch.Tensor, q: torch.Tensor, kv_cache: torch.Tensor, block_table: torch.Tensor,
                    seq_lens: torch.Tensor, query_start_loc: torch.Tensor, rows: torch.Tensor, scale: float,
                    window: int = 0, sinks: torch.Tensor | None = None) -> None:
    """Writes out[t] for every token t of the listed rows: causal attention over the row's cached KV.

    out, q [T, H, D]; kv_cache [2, N, bs, Hkv, D] (already holding this step's K/V; q's dtype, or float16
    under float32 q); block_table
    [B, W], seq_lens [B], query_start_loc [B + 1], rows [R]: int32. Rows need 1 <= query_len <= seq_len.
    window > 0: each query sees only its last `window` keys (itself included), and blocks wholly before that
    are not read. sinks [H]: one logit per query head added to the softmax denominator (float32 on the call).
    """
    if sinks is not None:
        sinks = sinks.float().contiguous()
    _ops().paged_attention(out, q, kv_cache, block_table, seq_lens, query_start_loc, rows, float(scale), int(window),
                           sinks)


BF16_KERNEL_PROMPT_SEQ_LEN = 1024  # keys up to which the kernel attends a bfloat16 prompt faster than SDPA


def attends_prompts(dtype: torch.dtype) -> bool:
    """Whether `paged_attention` should take a model's prompt rows too: float32 and bfloat16 through the AVX2 path,
    which attends a prompt faster than torch's SDPA (bfloat16 up to `prompt_seq_len_limit` keys; docs/benchmarks.md,
    "Figures behind choices in the code", and for bfloat16 "Threads that even out, fewer ATen calls a layer,
    bfloat16 prompts through the kernel"); the portable path (float16, or no AVX2) is slower than SDPA there and
    keeps to decode-like rows."""
    return dtype in (torch.float32, torch.bfloat16) and has_avx2_kernels()


def prompt_seq_len_limit(dtype: torch.dtype) -> int | None:
    """The longest sequence whose prompt rows the kernel takes when it `attends_prompts` (None: any): past
    ~1,000 keys torch's SDPA attends a bfloat16 prompt faster (its bf16 GEMMs against our float32 sums)."""
    return BF16_KERNEL_PROMPT_SEQ_LEN if dtype == torch.bfloat16 else None


FUSED_DTYPES = (torch.float32, torch.bfloat16)


def can_fuse(x: torch.Tensor) -> bool:
    """Whether the fused ops below take x: float32 or bfloat16 on CPU, outside autograd, kernels built (the other
    tensors of a call share x's dtype)."""
    return x.device.type == "cpu" and x.dtype in FUSED_DTYPES and not torch.is_grad_enabled() and available()


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [T, n] contiguous -> weight * (x * rsqrt(mean(x^2) + eps)), a new tensor."""
    out = torch.empty_like(x)
    _ops().rms_norm(out, x, weight, eps)
    return out


def add_rms_norm_(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    """In place, x and residual [T, n] contiguous: residual += x, then x = rms_norm(residual)."""
    _ops().add_rms_norm(x, residual, weight, eps)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """gate_up [T, 2I] contiguous -> silu(gate) * up [T, I]."""
    out = gate_up.new_empty(gate_up.shape[0], gate_up.shape[1] // 2)
    _ops().silu_mul(out, gate_up)
    return out


def rotary_(qk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Neox rotary in place: qk [T, heads, D] (any row/head strides), cos/sin [T, 1, D/2] contiguous."""
    _ops().rotary(qk, cos, sin)


def write_kv(kv_cache: torch.Tensor, slot_mapping: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """k/v [T, Hkv, D] float32 (any row/head strides) into kv_cache [2, N, bs, Hkv, D] (float32, or float16:
    rounded to nearest even; int8: quantized per row), or bfloat16 k/v into a bfloat16 cache, at slot_mapping [T]
    int64."""
    _ops().write_kv(kv_cache, slot_mapping, k, v)


def has_avx2_kernels() -> bool:
    """Whether the build is an AVX2 + FMA one and loaded: attention's fast path (`attends_prompts`) and
    `pack_linear_weight` / `packed_linear` run here."""
    return "-mavx2" in cpu_build.compile_flags() and available()


def packs_linears() -> bool:
    """Whether model/linear.py should pack float32 weights for `packed_linear` rather than oneDNN: wherever the
    kernels built with AVX2 (through AVX-512 registers where the CPU has them: `packed_linear`). On AVX2-only CPUs
    oneDNN runs AVX2 code, which ours beats at every row count; on AVX-512 ones ours streams a decode step's
    weights faster than oneDNN and is within a few percent at prefill sizes (docs/benchmarks.md, "CPU batch
    1"). LLMSERVE_CPU_LINEAR=panels|onednn forces either (`cpu_isa.linear_path`); panels without the AVX2 build
    is a ValueError, not a silent fallback."""
    path = cpu_isa.linear_path()
    if path == "onednn":
        return False
    if path == "panels" and not has_avx2_kernels():
        raise ValueError(f"{cpu_isa.LINEAR_ENV}=panels needs the AVX2 CPU kernels, which this machine "
                         "did not build or load (see the log's 'CPU kernels' line)")
    return has_avx2_kernels()


def packs_int8() -> bool:
    """Whether model/quant/linear.py's Int8Linear should run `int8_linear` rather than torch._int_mm: on
    CPUs where oneDNN has no VNNI. There its s8 GEMM multiplies with vpmaddubsw, whose int16 pair sums
    saturate (wrong logits: docs/benchmarks.md, "Figures behind choices in the code"); ours widens to int16
    and is exact."""
    return not cpu_isa.onednn_has_vnni() and has_avx2_kernels()


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] float32 -> its panels [ceil(N / 16), K, 16] (a new tensor; zero columns pad the last)."""
    return _ops().pack_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] contiguous float32, panels from `pack_linear_weight`, bias [N] or None -> [T, N]; through
    AVX-512 registers where the build and oneDNN's cap allow (the same sums in the same order as AVX2's)."""
    out = x.new_empty(x.shape[0], out_features)
    _panel_op(cpu_isa.onednn_isa_cap())(out, x, panels, bias)
    return out


def moe_experts(out: torch.Tensor, rows: torch.Tensor, counts: torch.Tensor, pairs: torch.Tensor,
                weights: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                biases: tuple[torch.Tensor | None, torch.Tensor | None]) -> None:
    """Every expert of an MoE layer on pairs sorted by expert: out [T*k, H] row q = weights [T*k][q] times pair
    q's expert (silu(gate) * up, then down) of its row in rows [P, H]; counts [E] int64 pairs an expert (in
    turn), pairs [>= P] int64 the pair of each sorted row; gate_up [E, 2I/16, H, 16] and down [E, ceil(H/16),
    I, 16] stacked panels (`pack_linear_weight`'s), biases [E, 2I] and [E, H] or None. Rows of out of other
    pairs are left as they are. The sums of `packed_linear` and `silu_mul`, in the same order."""
    _ops().moe_experts(out, rows, counts, pairs, weights, gate_up, down, biases[0], biases[1],
                       _panel_op(cpu_isa.onednn_isa_cap()) == _ops().packed_linear_avx512)


def pack_int8_weight(weight: torch.Tensor) -> torch.Tensor:
    """weight [N, K] int8 -> its panels [ceil(N / 16), ceil(K / 2), 32] int8 (zeros pad N and K)."""
    return _ops().pack_int8_weight(weight.detach().contiguous())


def unpack_int8_weight(panels: torch.Tensor, out_features: int, in_features: int) -> torch.Tensor:
    """The [N, K] int8 weight that `pack_int8_weight` packed into `panels` (a new tensor)."""
    num_panels, num_pairs, _ = panels.shape
    columns = panels.view(num_panels, num_pairs, 16, 2).permute(0, 2, 1, 3).reshape(num_panels * 16, 2 * num_pairs)
    return columns[:out_features, :in_features].contiguous()


def int8_linear(x: torch.Tensor, panels: torch.Tensor, w_scale: torch.Tensor, out_features: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] contiguous float32 quantized per row, times the int8 panels, scaled -> [T, N] float32."""
    out = x.new_empty(x.shape[0], out_features)
    _ops().int8_linear(out, x, panels, w_scale, bias)
    return out


def panel_isa() -> str:
    """The registers `packed_linear` runs in here: AVX-512 or AVX2."""
    return "AVX-512" if _panel_op(cpu_isa.onednn_isa_cap()) == _ops().packed_linear_avx512 else "AVX2"


@functools.cache
def _panel_op(isa_cap: str):
    """The panel GEMM for oneDNN's ISA cap (read per call: tests change it): AVX-512 where both allow."""
    return _ops().packed_linear_avx512 if _has_avx512_build() and cpu_isa.onednn_has_avx512() else _ops().packed_linear


@functools.cache
def _has_avx512_build() -> bool:
    return available() and bool(_ops().has_avx512_linear())


def has_avx512_linear() -> bool:
    """Whether the build has csrc/linear_avx512.cpp's float32 panel kernel (an AVX-512 build, loaded);
    `packed_linear` runs it where oneDNN may use AVX-512 too (ONEDNN_MAX_CPU_ISA holds both to AVX2)."""
    return _has_avx512_build()


def packed_linear_avx512(x: torch.Tensor, panels: torch.Tensor, out_features: int,
                         bias: torch.Tensor | None = None) -> torch.Tensor:
    """`packed_linear` through AVX-512 registers: the same panels, the same sums in the same order."""
    out = x.new_empty(x.shape[0], out_features)
    _ops().packed_linear_avx512(out, x, panels, bias)
    return out


@functools.cache
def bf16_gemv_max_rows() -> int:
    """Rows of x `bf16_gemv` takes (decode batches of one user or a few: csrc/cpu_ops.h); 0 where the build has
    no AVX512-BF16 GEMV."""
    return int(_ops().bf16_gemv_max_rows()) if available() else 0


def has_bf16_gemv() -> bool:
    """Whether the build has the AVX512-BF16 GEMV (`bf16_gemv`)."""
    return bf16_gemv_max_rows() > 0


def bf16_gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [M <= 4, K] contiguous bfloat16, weight [N, K] contiguous bfloat16 (as loaded), bias [N] or None ->
    [M, N] bfloat16, float32 sums of bf16 products (what oneDNN's bf16 GEMM computes, in another order)."""
    out = x.new_empty(x.shape[0], weight.shape[0])
    _ops().bf16_gemv(out, x, weight, bias)
    return out


def samples_on_cpu(logits: torch.Tensor) -> bool:
    """Whether the sampler's penalties and top-k can run here (csrc/sampling_ops.cpp): float32 CPU logits, rows
    contiguous, kernels loaded."""
    return logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.stride(-1) == 1 and available()


def apply_penalties_(logits: torch.Tensor, row_indices: torch.Tensor, repetition: torch.Tensor,
                     frequency: torch.Tensor, presence: torch.Tensor, output_ids: torch.Tensor,
                     prompt_ids: torch.Tensor | None, has_output_penalties: bool) -> None:
    """sample/ops.py's apply_penalties in one op, the same bits (ids padded with V)."""
    _ops().apply_penalties_(logits, row_indices, repetition, frequency, presence, output_ids, prompt_ids,
                            has_output_penalties)


def top_k_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V] -> (values, ids) [B, k]: each row's k largest, descending, ties by the lower id."""
    return _ops().top_k_rows(logits, k)


def sample_candidates(cand_logits: torch.Tensor, cand_ids: torch.Tensor, noise: torch.Tensor,
                      temperature: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None,
                      min_p: torch.Tensor | None) -> torch.Tensor:
    """Each row's draw [B] int64 from its candidates [B, K] (descending logits, their ids, their noise U [B, K]):
    the sampler's candidates path after its top-k in one op."""
    return _ops().sample_candidates(cand_logits, cand_ids, noise, temperature, top_k, top_p, min_p)


def sample_rows(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor | None, min_p: torch.Tensor | None,
                uniforms: torch.Tensor, race_noise: torch.Tensor | None, is_race: torch.Tensor | None,
                is_greedy: torch.Tensor | None) -> torch.Tensor:
    """Each random row's draw [B] int64 over its whole row of logits [B, V] (scratch): temperature, top-p without a
    sort, min-p, then inverse CDF on uniforms [B, R] or, where is_race, the exponential race on race_noise [B, V]
    (csrc/sampling_rows.cpp). Greedy rows get 0."""
    return _ops().sample_rows(logits, temperature, top_p, min_p, uniforms, race_noise, is_race, is_greedy)
