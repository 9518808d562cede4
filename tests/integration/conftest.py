"""The integration tests' shared server: one real `llmserve serve` on a tiny model for the modules that need
nothing but these settings (each server costs seconds to start on 2 cores). A module that needs other flags,
a step gate or a server of its own defines its own `server` fixture, which takes precedence. Started on
first use, stopped at the end of the run, when it must drain and exit 0."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from llmserve.testing.servers import ServerProcess, start_tiny_server

SHARED_NAME = "tiny"
SHARED_MAX_MODEL_LEN = 2048  # room for tool definitions in the system turn


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    server = start_tiny_server(str(tmp_path_factory.mktemp("shared-model")), "--served-model-name", SHARED_NAME,
                               "--max-model-len", str(SHARED_MAX_MODEL_LEN))
    yield server
    assert server.stop() == 0
