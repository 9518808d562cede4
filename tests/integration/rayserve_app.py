"""The Ray Serve integration tests' one start/stop of an application: a local Ray in the test process (its
temporary files in a short folder: Ray's socket paths must fit 107 bytes), Ray Serve's proxy on a free port,
the application `llmserve serve-ray` would deploy for the given flags; on exit everything stopped and the
folder removed (also when a test killed a replica that left files there)."""

from __future__ import annotations

import argparse
import contextlib
import shutil
import tempfile
from collections.abc import Iterator

import ray
from ray import serve

from llmserve.rayserve.app import build_application
from llmserve.rayserve.cli import add_serve_ray_args, deployment_from_args
from llmserve.router.replicas import free_port


@contextlib.contextmanager
def ray_serve_app(model: str, flags: tuple[str, ...], app: str, num_cpus: int,
                  env_vars: dict[str, str] | None = None) -> Iterator[str]:
    """The application's URL while it runs; `env_vars` go to every Ray process (the replicas' engines)."""
    port = free_port()
    parser = argparse.ArgumentParser()
    add_serve_ray_args(parser)
    deployment = deployment_from_args(parser.parse_args(["--model", model, *flags, "--port", str(port)]))
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
    try:
        ray.init(num_cpus=num_cpus, _temp_dir=ray_dir, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TMPDIR": ray_dir, **(env_vars or {})}})
        try:
            serve.start(http_options={"host": "127.0.0.1", "port": port})
            serve.run(build_application(deployment), name=app)
            yield f"http://127.0.0.1:{port}"
        finally:
            serve.shutdown()
            ray.shutdown()
    finally:
        shutil.rmtree(ray_dir, ignore_errors=True)
