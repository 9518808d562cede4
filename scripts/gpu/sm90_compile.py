"""Compile the FP8 Triton kernels and the bf16 GEMV (model/triton_gemv.py) for an H100 (sm_90) on a machine without
one, and check what the GPU would run: the MMA instruction each decode tiling gets, whether its loads are
pipelined (cp.async into shared memory over `num_stages` buffers), that wgmma's FP8 sums are promoted to float32
as K goes, and that its shared memory fits the SM (227 KiB). Triton compiles ahead of time with the ptxas its
wheel ships; the arguments are specialised as the JIT does on the device (pointers and the weight's sizes and
strides divisible by 16). Run without TRITON_INTERPRET.

    python scripts/gpu/sm90_compile.py [--sweep]     # the default and wide tilings, or every fp8_probe one

Exits 1 naming the tilings that fail. tests/unit/test_sm90_compile.py runs it on the default tilings.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from llmserve.model import triton_gemv
from llmserve.model.quant import fp8_triton

TARGET = GPUTarget("cuda", 90, 32)
MAX_SHARED = 227 * 1024
POINTERS = {"xq_ptr": "*fp8e4nv", "x_scale_ptr": "*fp32", "w_ptr": "*fp8e4nv", "w_scale_ptr": "*fp32",
            "out_ptr": "*bf16"}
SIZES = {"M": "i32", "N": "i32", "K": "i32", "K_PART": "i32", "stride_x": "i32", "stride_w": "i32",
         "stride_o": "i32"}
DIVISIBLE_SIZES = ["N", "K", "K_PART", "stride_x", "stride_w", "stride_o"]  # and the pointers; M, the batch: any


@dataclass(frozen=True)
class Compiled:
    name: str
    mma: str  # the MMA instruction(s) in the PTX
    num_async_copies: int  # cp.async instructions: 0 means the loop's loads are not pipelined
    shared_bytes: int
    is_promoted: bool  # wgmma's FP8 sums added into float32 registers as K goes (else ~14 bits kept)

    @property
    def problems(self) -> list[str]:
        found = [] if self.num_async_copies else ["loads not pipelined"]
        found += [] if self.is_promoted or "wgmma" not in self.mma else ["FP8 sums not promoted to float32"]
        return found + ([f"shared {self.shared_bytes} B > {MAX_SHARED}"] if self.shared_bytes > MAX_SHARED else [])


def compile_decode(tiling: fp8_triton.DecodeTiling, row_tiles: int, is_split: bool) -> Compiled:
    """The decode kernel `fp8_decode_matmul` launches for `tiling` (row_tiles: 16-row tiles a program)."""
    is_wide = tiling.row_tile != fp8_triton.ROW_TILE
    fn = fp8_triton._decode_matmul_wide_kernel if is_wide else fp8_triton._decode_matmul_kernel
    rows = {"BLOCK_M": tiling.row_tile} if is_wide else {"ROW_TILES": row_tiles}
    constexprs = {**rows, "BLOCK_N": tiling.block_n, "BLOCK_K": tiling.block_k, "IS_SPLIT": is_split}
    return _compile(fn, POINTERS, constexprs, tiling, f"{tiling} row_tiles={row_tiles} split={is_split}")


def compile_gemv(tiling: triton_gemv.GemvTiling, is_split: bool, has_bias: bool, is_gated: bool) -> Compiled:
    """The bf16 GEMV `triton_gemv.gemv` launches for `tiling`."""
    constexprs = {"BLOCK_N": tiling.block_n, "BLOCK_K": tiling.block_k, "HAS_BIAS": has_bias, "IS_SPLIT": is_split,
                  "IS_GATED": is_gated}
    pointers = {"x_ptr": "*bf16", "w_ptr": "*bf16", "bias_ptr": "*bf16", "out_ptr": "*fp32" if is_split else "*bf16"}
    return _compile(triton_gemv._gemv_kernel, pointers, constexprs, tiling,
                    f"gemv {tiling} split={is_split} bias={has_bias} gated={is_gated}")


def _compile(fn, pointers: dict[str, str], constexprs: dict, tiling, name: str) -> Compiled:
    """A matmul kernel over `pointers` and SIZES compiled for sm_90, specialised as the JIT would be, and what its
    PTX holds."""
    signature = {**pointers, **SIZES, **{key: "constexpr" for key in constexprs}}
    names = list(signature)
    attrs = {(names.index(key),): [["tt.divisibility", 16]] for key in [*pointers, *DIVISIBLE_SIZES]}
    kernel = triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs),
                            target=TARGET, options={"num_warps": tiling.num_warps, "num_stages": tiling.num_stages})
    ptx = kernel.asm["ptx"]
    mma = sorted(set(re.findall(r"(?:wgmma\.mma_async|mma\.sync)[.\w]*", ptx)))
    is_promoted = "maxNumImpreciseAcc = 1073741824" not in kernel.asm["ttgir"]  # Triton's sm_90 default: never
    return Compiled(name, ",".join(mma), len(re.findall(r"cp\.async\.c[ag]", ptx)), kernel.metadata.shared,
                    is_promoted)


def compile_helpers() -> None:
    """The kernels around the decode matmuls: the per-row quantization and the split-K sums (FP8: scaled; the
    GEMV: with a bias) (raises where one does not compile)."""
    quantize = {"x_ptr": "*bf16", "q_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "K": "i32", "stride_x": "i32",
                "stride_q": "i32", "BLOCK_K": "constexpr"}
    add = {"part_ptr": "*fp32", "bias_ptr": "*bf16", "x_scale_ptr": "*fp32", "w_scale_ptr": "*fp32", "out_ptr": "*bf16",
           "M": "i32", "N": "i32", "stride_o": "i32", "SPLIT": "constexpr", "HAS_BIAS": "constexpr",
           "HAS_SCALES": "constexpr", "BLOCK": "constexpr"}
    cases = [(fp8_triton._quantize_rows_kernel, quantize, {"BLOCK_K": 1024})]
    cases += [(triton_gemv._add_parts_kernel, add, {"SPLIT": split, "HAS_BIAS": not is_fp8, "HAS_SCALES": is_fp8,
                                                    "BLOCK": 1024}) for split in (2, 4, 8) for is_fp8 in (True, False)]
    for fn, signature, constexprs in cases:
        triton.compile(ASTSource(fn=fn, signature=signature, constexprs=constexprs), target=TARGET,
                       options={"num_warps": 4})
        print(f"{fn.__name__} {constexprs}: compiled", flush=True)


def check(tilings: list[fp8_triton.DecodeTiling]) -> list[Compiled]:
    results = []
    for tiling in tilings:
        row_tile_counts = sorted({min(tiling.max_row_tiles, r) for r in (1, 2, 4)})
        for row_tiles in row_tile_counts:
            for is_split in (False, True):
                results.append(compile_decode(tiling, row_tiles, is_split))
                c = results[-1]
                print(f"{c.name}: {c.mma}, {c.num_async_copies} cp.async, shared {c.shared_bytes} B",
                      *c.problems, flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sweep", action="store_true", help="every tiling scripts/gpu/fp8_probe.py --sweep times")
    args = parser.parse_args()
    if args.sweep:
        sys.path.insert(0, "scripts/gpu")
        from fp8_probe import TILINGS as tilings  # noqa: PLC0415 (needs CUDA only to run, not to import)
    else:
        tilings = [fp8_triton.DECODE_TILING, fp8_triton.WIDE_TILING]
    compile_helpers()
    # (split, bias, gated): a split K adds the bias with the parts
    kinds = [(False, False, False), (False, True, False), (True, False, False), (False, False, True)]
    gemvs = [compile_gemv(triton_gemv.GEMV_TILING, *kind) for kind in kinds]
    for c in gemvs:
        print(f"{c.name}: {c.mma}, {c.num_async_copies} cp.async, shared {c.shared_bytes} B", *c.problems, flush=True)
    failed = [c.name for c in check(tilings) + gemvs if c.problems]
    print(f"{len(failed)} failed" + "".join(f"\n  {name}" for name in failed))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
