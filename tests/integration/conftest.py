"""The integration tests' shared server: one real `llmserve serve` on a tiny model for the modules that need
nothing but these settings (each server costs seconds to start on 2 cores). A module that needs other flags,
a step gate or a server of its own defines its own `server` fixture, which takes precedence. Started on
first use, stopped at the end of the run, when it must drain and exit 0. Also the Ray Serve modules' one local
Ray (`shared_ray`, rayserve_app.py)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from llmserve.testing.servers import ServerProcess, start_tiny_server

if TYPE_CHECKING:
    from rayserve_app import SharedRay

SHARED_NAME = "tiny"
SHARED_MAX_MODEL_LEN = 2048  # room for tool definitions in the system turn


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_tiny_server(str(tmp_path_factory.mktemp("shared-model")), "--served-model-name", SHARED_NAME,
                               "--max-model-len", str(SHARED_MAX_MODEL_LEN))
    yield server
    assert server.stop() == 0


@pytest.fixture(scope="session")
def shared_ray() -> Iterator["SharedRay"]:
    """The Ray Serve modules' one local Ray (rayserve_app.py), started by the first application deployed on it;
    stopped after the last test that uses it (`pytest_runtest_teardown`), at the latest here."""
    from rayserve_app import SHARED_RAY

    yield SHARED_RAY
    SHARED_RAY.stop()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """The tests on the shared Ray run one after another (from where the first is), so that Ray starts once."""
    users = [item for item in items if "shared_ray" in getattr(item, "fixturenames", ())]
    if len(users) < 2:
        return
    first, moved = items.index(users[0]), set(users)
    rest = [item for item in items if item not in moved]
    items[:] = rest[:first] + users + rest[first:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None):
    """After the last test on the shared Ray (its module's application deleted by then): Ray stopped."""
    yield
    rayserve_app = sys.modules.get("rayserve_app")
    if rayserve_app is not None and (nextitem is None or "shared_ray" not in nextitem.fixturenames):
        rayserve_app.SHARED_RAY.stop()
