"""The Ray Serve integration tests' one local Ray, shared by their modules (starting Ray and Serve's controller
and proxy costs about 10 s on 2 cores): Ray in the test process (its temporary files in a short folder: Ray's
socket paths must fit 107 bytes), 4 logical CPUs, Serve's proxy on a free port, and step gates for every
engine replica (free-running until a test holds one). Each module deploys the application `llmserve serve-ray`
would deploy for its flags and deletes it on exit. The integration conftest runs the modules that use it
(fixture `shared_ray`) one after another and stops Ray (everything, folder removed, also when a test killed a
replica that left files there) once the next test does not use it."""

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
from llmserve.testing.servers import EngineGates

NUM_CPUS = 4  # two engine replicas and a third under autoscaling (0.5 each), the ingress, P/D's two roles
# Replicas and handles report their ongoing requests to Ray's autoscaler every second instead of every 10.
FAST_METRICS = {"RAY_SERVE_REPLICA_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1",
                "RAY_SERVE_HANDLE_AUTOSCALING_METRIC_PUSH_INTERVAL_S": "1"}


class SharedRay:
    """The local Ray and Serve, started on the first `app`, stopped by `stop` (a no-op when not running)."""

    def __init__(self) -> None:
        self.ray_dir: str | None = None
        self.port = 0
        self.gates: EngineGates | None = None

    def _start(self) -> None:
        self.gates = EngineGates()
        self.ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")
        self.port = free_port()
        ray.init(num_cpus=NUM_CPUS, _temp_dir=self.ray_dir, include_dashboard=False, log_to_driver=False,
                 runtime_env={"env_vars": {"TMPDIR": self.ray_dir, **self.gates.env, **FAST_METRICS}})
        serve.start(http_options={"host": "127.0.0.1", "port": self.port})

    @contextlib.contextmanager
    def app(self, model: str, flags: tuple[str, ...], name: str) -> Iterator[str]:
        """The application's URL while it runs (deleted on exit)."""
        if self.ray_dir is None:
            try:
                self._start()
            except BaseException:
                self.stop()
                raise
        parser = argparse.ArgumentParser()
        add_serve_ray_args(parser)
        deployment = deployment_from_args(parser.parse_args(["--model", model, *flags, "--port", str(self.port)]))
        try:
            serve.run(build_application(deployment), name=name)
            yield f"http://127.0.0.1:{self.port}"
        finally:
            serve.delete(name)

    def stop(self) -> None:
        if self.ray_dir is None:
            return
        try:
            if ray.is_initialized():
                serve.shutdown()
        finally:
            ray.shutdown()
            shutil.rmtree(self.ray_dir, ignore_errors=True)
            if self.gates is not None:
                self.gates.close()
            self.ray_dir, self.gates = None, None


SHARED_RAY = SharedRay()
