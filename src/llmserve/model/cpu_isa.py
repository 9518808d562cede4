"""What the CPU offers and which of our CPU paths it selects: the instruction sets /proc/cpuinfo lists,
the ceiling oneDNN is held to (ONEDNN_MAX_CPU_ISA), and the project's switch for the float32 linears.

The development and CI machines come in two kinds, AVX2-only and AVX-512 (some with AMX), and these
choices follow from the kind (docs/cpu.md lists them with their switches):
- float32 linears: our panel kernel on both, through AVX-512 registers where oneDNN may use them too (the same
  bits); oneDNN's packed weights by name (`linear_path`; LLMSERVE_CPU_LINEAR=panels|onednn forces one);
- bfloat16 decode rows: our AVX512-BF16 GEMV where `has_fast_bf16` (LLMSERVE_CPU_LINEAR=onednn: oneDNN's);
- int8 linears: our exact AVX2 kernel where oneDNN has no VNNI (`onednn_has_vnni`);
- `--dtype auto`: bfloat16 where oneDNN may run bf16 dot products (AMX or AVX512-BF16), else float32
  (`has_fast_bf16`).
ONEDNN_MAX_CPU_ISA=AVX2 holds an AVX-512 machine to the AVX2 kind's choices, all of them.
"""

from __future__ import annotations

import functools
import os

LINEAR_PATHS = ("auto", "panels", "onednn")
LINEAR_ENV = "LLMSERVE_CPU_LINEAR"


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The flags of /proc/cpuinfo's first processor (empty where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def onednn_isa_cap() -> str:
    """oneDNN's ISA ceiling from ONEDNN_MAX_CPU_ISA (or DNNL_MAX_CPU_ISA), upper case; ALL when unset."""
    return (os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA") or "ALL").upper()


def _cap_allows(*prefixes: str) -> bool:
    return onednn_isa_cap().startswith(("ALL", "DEFAULT", "AVX10", "AMX") + prefixes)


def onednn_has_avx512() -> bool:
    """The CPU has AVX-512 and oneDNN may use it (ONEDNN_MAX_CPU_ISA, e.g. AVX2, caps it below)."""
    return "avx512f" in cpu_flags() and _cap_allows("AVX512")


def onednn_has_vnni() -> bool:
    """The CPU has VNNI (AVX-512 or AVX) and oneDNN may use it (ONEDNN_MAX_CPU_ISA may cap it below)."""
    flags = cpu_flags()
    if onednn_isa_cap().startswith("AVX2_VNNI"):
        return "avx_vnni" in flags
    is_vnni_cap = _cap_allows("AVX512_CORE_VNNI", "AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX")
    return is_vnni_cap and bool({"avx512_vnni", "avx_vnni"} & flags)


def has_fast_bf16() -> bool:
    """The CPU has bf16 dot products (AMX or AVX512-BF16) and oneDNN may use them: `--dtype auto` picks
    bfloat16 there (faster than f32 with those instructions, far slower without them: docs/benchmarks.md,
    "Figures behind choices in the code")."""
    has_flags = bool({"amx_bf16", "avx512_bf16"} & cpu_flags())
    return has_flags and _cap_allows("AVX512_CORE_BF16", "AVX512_CORE_FP16", "AVX512_CORE_AMX")


def linear_path() -> str:
    """LLMSERVE_CPU_LINEAR: auto (the CPU's kind decides), panels (our AVX2 kernel) or onednn; ValueError
    for anything else."""
    choice = os.environ.get(LINEAR_ENV, "auto").strip().lower() or "auto"
    if choice not in LINEAR_PATHS:
        raise ValueError(f"{LINEAR_ENV}={choice!r}: choose one of {', '.join(LINEAR_PATHS)}")
    return choice
