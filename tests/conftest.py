import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
import torch

if TYPE_CHECKING:
    from llmserve.testing.servers import EngineGates, StepGateClient

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if not torch.cuda.is_available():
    # Triton kernels run through Triton's interpreter on CPU; triton.jit reads this when the kernels (and
    # triton.language itself) are first imported, so it is set before any test module can import them.
    os.environ.setdefault("TRITON_INTERPRET", "1")

SESSION_TMP = pytest.StashKey[Path]()
CACHES = {"TORCHINDUCTOR_CACHE_DIR": "torchinductor"}  # library caches (torch makes its own on first use)


def pytest_configure(config: pytest.Config) -> None:
    """The run's temporary files (this process's and every child's) go to a folder of its own, which must be
    empty at the end (`no_temporary_files_left`) and is then removed. pytest's tmp_path stays where it was."""
    system_tmp = tempfile.gettempdir()
    os.environ.setdefault("PYTEST_DEBUG_TEMPROOT", system_tmp)
    session_tmp = Path(tempfile.mkdtemp(prefix="llmserve-tests-", dir=system_tmp))
    os.environ["TMPDIR"] = str(session_tmp)
    for variable, name in CACHES.items():
        os.environ.setdefault(variable, str(session_tmp / name))
    tempfile.tempdir = str(session_tmp)  # gettempdir() caches its first answer
    config.stash[SESSION_TMP] = session_tmp


def pytest_unconfigure(config: pytest.Config) -> None:
    shutil.rmtree(config.stash[SESSION_TMP], ignore_errors=True)


@pytest.fixture(scope="session", autouse=True)
def no_temporary_files_left(request: pytest.FixtureRequest) -> Iterator[None]:
    """Fails the run (an error at the last test's teardown) if a test left a file in the temporary folder."""
    yield
    session_tmp = request.config.stash[SESSION_TMP]
    left = sorted(path.name for path in session_tmp.iterdir() if path.name not in CACHES.values())
    assert not left, f"tests left {len(left)} file(s) in the temporary folder: {left[:10]} (use tmp_path)"


@pytest.fixture(scope="module")
def gate() -> Iterator["StepGateClient"]:
    """A step gate for the test module's server (start it with `env=gate.env`): one per module, like the
    servers that use it, so tests hold and step the engine at step boundaries instead of racing it."""
    from llmserve.testing.servers import StepGateClient  # noqa: F811 (the server stack only when asked for)

    with StepGateClient() as step_gate:
        yield step_gate



@pytest.fixture(scope="module")
def engine_gates() -> Iterator["EngineGates"]:
    """Step gates for every engine started with `engine_gates.env` (several engines under one environment:
    Ray Serve's or the router's replicas), each on its own socket; free-running until a test holds one."""
    from llmserve.testing.servers import EngineGates  # noqa: F811

    gates = EngineGates()
    yield gates
    gates.close()


@pytest.fixture(scope="module", params=["panels", "onednn"])
def cpu_linear_path(request: pytest.FixtureRequest) -> Iterator[str]:
    """The module's tests once under each float32 linear path of the CPU (LLMSERVE_CPU_LINEAR, docs/cpu.md):
    our panels (what both kinds of CPU take by default) and oneDNN's packed weights, whichever kind of machine
    runs the suite; engine processes started meanwhile inherit it."""
    from llmserve.model import cpu_isa, cpu_kernels, linear

    if request.param == "panels" and not cpu_kernels.has_avx2_kernels():
        pytest.skip("the AVX2 CPU kernels are not built here")
    if request.param == "onednn" and not linear._has_packing():
        pytest.skip("torch without oneDNN weight packing")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(cpu_isa.LINEAR_ENV, request.param)
        yield request.param


@pytest.fixture
def pretend_cpu(monkeypatch: pytest.MonkeyPatch):
    """`pretend_cpu(flags, cap)`: the CPU seen as having these /proc/cpuinfo flags, oneDNN held to `cap`
    (ONEDNN_MAX_CPU_ISA; None: uncapped), LLMSERVE_CPU_LINEAR unset: what model/cpu_isa.py then chooses."""
    from llmserve.model import cpu_isa

    def pretend(flags: set[str], cap: str | None = None) -> None:
        monkeypatch.setattr(cpu_isa, "cpu_flags", lambda: frozenset(flags))
        monkeypatch.delenv("DNNL_MAX_CPU_ISA", raising=False)
        monkeypatch.delenv(cpu_isa.LINEAR_ENV, raising=False)
        if cap is None:
            monkeypatch.delenv("ONEDNN_MAX_CPU_ISA", raising=False)
        else:
            monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", cap)

    return pretend

