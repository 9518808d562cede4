"""The FP8 decode kernels and the bf16 GEMV compile for an H100 (sm_90) without one: scripts/gpu/sm90_compile.py
compiles them ahead of time with the ptxas Triton ships, specialised as the JIT would be on the device, and fails
where a tiling's loads are not pipelined or its shared memory does not fit. What this cannot see (speed, the tensor
cores' row invariance) the GPU tests, scripts/gpu/fp8_probe.py and scripts/gpu/gemv_probe.py measure in a lease."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None
                                or importlib.util.find_spec("triton.backends.nvidia") is None,
                                reason="Triton's NVIDIA backend (its ptxas) is not installed")


def test_decode_kernels_compile_for_the_h100_with_pipelined_loads():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compile, not interpret
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    done = subprocess.run([sys.executable, str(ROOT / "scripts/gpu/sm90_compile.py")], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[-1] == "0 failed"
    # the default tiling: 16-row tiles through mma.sync; the wide one: Hopper's wgmma on the e4m3 operands
    assert all("mma.sync" in line for line in lines if "row_tile=16" in line)
    assert all("wgmma" in line and "e4m3" in line for line in lines if "row_tile=64" in line)
    assert sum("row_tile=" in line for line in lines) == 8  # 1, 2, 4 row tiles and the wide kind, split or not
    assert sum(line.endswith(": compiled") for line in lines) == 7  # quantize_rows, the parts' sums at 3 splits x 2
    gemvs = [line for line in lines if line.startswith("gemv ")]  # plain, with a bias, split, gated
    assert len(gemvs) == 4 and all("mma.sync" in line and "bf16" in line for line in gemvs)
