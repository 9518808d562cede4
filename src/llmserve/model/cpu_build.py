"""Building the C++ CPU kernels (csrc/) with torch.utils.cpp_extension: this machine's compiler flags (AVX2 + FMA,
AVX-512 and AVX512-BF16 where the CPU has them), a build directory per torch, Python, flags and source location,
stale-lock cleanup, and `build_and_load`, which every kernel library (model/cpu_kernels.py, model/lora_cpu.py) loads
through: the ops, or None and one warning line, so that callers keep their torch path."""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import platform
import re
import sys
import time

import torch

from llmserve.model import cpu_isa

logger = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")
FIRST_BUILD_TIME = "2-3 minutes on 2 cores"  # measured: about 2.5 minutes on an AMD EPYC Zen 3 (2 cores)
STALE_LOCK_S = 600.0  # a build takes about a minute; a lock this old was left by a killed build

def compile_flags() -> list[str]:
    flags = ["-O3", "-fopenmp"]
    if platform.machine().lower() in ("x86_64", "amd64") and {"avx2", "fma"} <= cpu_isa.cpu_flags():
        flags += ["-mavx2", "-mfma"] + (["-mf16c"] if "f16c" in cpu_isa.cpu_flags() else [])
        flags += avx512_flags()
    return flags


AVX512_FLAGS = {"avx512f": "-mavx512f", "avx512bw": "-mavx512bw", "avx512vl": "-mavx512vl", "avx512dq": "-mavx512dq"}


def avx512_flags() -> list[str]:
    """-mavx512f/bw/vl/dq where the CPU has all four (csrc/linear_avx512.cpp), plus -mavx512bf16 with AVX512-BF16."""
    cpu = cpu_isa.cpu_flags()
    if not set(AVX512_FLAGS) <= cpu:
        return []
    return list(AVX512_FLAGS.values()) + (["-mavx512bf16"] if "avx512_bf16" in cpu else [])


def build_dir(flags: list[str]) -> str:
    """<llmserve cache>/torch_extensions/<torch, python, machine and flags tag>-<hash of csrc's path>."""
    from llmserve.config import cache_dir

    tag = f"torch{torch.__version__}-py{sys.version_info[0]}{sys.version_info[1]}-{platform.machine()}"
    tag += "-avx2" if "-mavx2" in flags else ""
    tag += "-avx512" if "-mavx512f" in flags else ""
    # one directory per source location: two checkouts never rebuild (or lock) each other's build
    tag += "-" + hashlib.sha256(CSRC.encode()).hexdigest()[:8]
    path = os.path.join(cache_dir(), "torch_extensions", re.sub(r"[^A-Za-z0-9._-]", "_", tag))
    os.makedirs(path, exist_ok=True)
    return path


def header_digest(headers: list[str]) -> str:
    """A define naming the headers' content: torch rebuilds when sources or flags change, not headers."""
    digest = hashlib.sha256()
    for header in headers:
        with open(header, "rb") as f:
            digest.update(f.read())
    return f"-DLLMSERVE_HEADERS_{digest.hexdigest()[:12]}"


def clear_stale_lock(build_dir: str) -> None:
    """torch's JIT build waits for as long as its lock file exists; a build killed midway leaves one behind."""
    lock = os.path.join(build_dir, "lock")
    try:
        age = time.time() - os.path.getmtime(lock)
    except OSError:
        return
    if age > STALE_LOCK_S:
        logger.warning("removing a stale CPU kernel build lock (%.0f s old): %s", age, lock)
        with contextlib.suppress(OSError):
            os.remove(lock)


def needs_build(build_dir: str, name: str, paths: list[str]) -> bool:
    """No built library yet, or a source or header newer than it: torch's load() will compile (it may
    also rebuild for a changed flag, which this does not predict; the message is for the first start)."""
    try:
        built_at = os.path.getmtime(os.path.join(build_dir, f"{name}.so"))
    except OSError:
        return True
    return any(os.path.getmtime(path) > built_at for path in paths)



def is_switched_off(env: str) -> bool:
    """The switch `env` is set to 0 (or false, no, off); unset or anything else leaves it on."""
    return os.environ.get(env, "1").strip().lower() in ("0", "false", "no", "off")


def kernels_disabled() -> bool:
    """LLMSERVE_CPU_KERNELS=0 (or false, no, off): no C++ kernel is built or loaded."""
    return is_switched_off("LLMSERVE_CPU_KERNELS")


def build_and_load(name: str, sources: list[str], namespace: str, self_test, what: str, fallback: str,
                   subdir: str = "", extra_cflags: tuple[str, ...] = ()):
    """JIT-build (or load the build of) C++ `sources` with this machine's flags into torch.ops.<namespace>, then
    run self_test(ops): the ops, or None with one warning line ("<what> unavailable, <fallback>") on any failure,
    so that callers keep their torch path. Builds go to the CPU kernels' build directory (`subdir` below it)."""
    try:
        from torch.utils import cpp_extension

        flags = compile_flags()
        path = os.path.join(build_dir(flags), subdir) if subdir else build_dir(flags)
        os.makedirs(path, exist_ok=True)
        clear_stale_lock(path)
        cpp_extension.load(name=name, sources=sources, extra_cflags=flags + list(extra_cflags),
                           extra_ldflags=["-fopenmp"], build_directory=path, is_python_module=False,
                           verbose=False)
        ops = getattr(torch.ops, namespace)
        self_test(ops)
    except Exception as e:  # no compiler, no ninja, build or load error: the caller keeps its torch path
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
        logger.warning("%s unavailable, %s (%s: %s)", what, fallback, type(e).__name__, first_line)
        logger.debug("%s build failure", what, exc_info=True)
        return None
    logger.info("%s loaded (%s)", what, " ".join(flags))
    return ops
