"""serve-ray stopped by SIGTERM while it starts, without a Ray cluster: Ray's calls are stood in for, the signal
is real. It exits 128 + 15 and stops what it started: a Ray of its own (Serve and Ray shut down), or on a
cluster it joined, only its application."""

from __future__ import annotations

import argparse
import os
import signal

import pytest

ray = pytest.importorskip("ray")

from llmserve.rayserve import cli  # noqa: E402


class FakeServe:
    """Records the calls; `run` is where the signal comes (the replicas would be loading)."""

    def __init__(self, deployed: list[str]) -> None:
        self.calls: list[str] = []
        self.deployed = deployed

    def start(self, **kwargs) -> None:
        self.calls.append("start")

    def run(self, app, name: str, route_prefix: str) -> None:
        self.calls.append("run")
        self.deployed.append(name)
        signal.raise_signal(signal.SIGTERM)
        raise AssertionError("the signal did not stop the start-up")

    def status(self):
        return argparse.Namespace(applications={name: None for name in self.deployed})

    def delete(self, name: str) -> None:
        self.calls.append(f"delete {name}")

    def shutdown(self) -> None:
        self.calls.append("shutdown")


@pytest.fixture
def fake_ray(monkeypatch):
    """ray.init/shutdown stood in for; this process's signal handlers and mask restored after."""
    handlers = {s: signal.getsignal(s) for s in cli.STOP_SIGNALS}
    calls = []
    monkeypatch.setattr(ray, "init", lambda **kwargs: calls.append("init"))
    monkeypatch.setattr(ray, "is_initialized", lambda: "init" in calls and "ray.shutdown" not in calls)
    monkeypatch.setattr(ray, "shutdown", lambda: calls.append("ray.shutdown"))
    monkeypatch.setattr(ray, "available_resources", lambda: {"CPU": 8.0})
    monkeypatch.setattr("llmserve.rayserve.app.build_application", lambda deployment: "app")
    environ = dict(os.environ)  # run() sets a Ray of its own's settings in the environment
    yield calls
    os.environ.clear()
    os.environ.update(environ)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, cli.STOP_SIGNALS)
    for signum, handler in handlers.items():
        signal.signal(signum, handler)


def deployment(*flags: str):
    parser = argparse.ArgumentParser()
    cli.add_serve_ray_args(parser)
    return cli.deployment_from_args(parser.parse_args(["--model", "m", "--num-replicas", "1", *flags]))


def test_a_ray_of_its_own_is_shut_down(fake_ray, capsys):
    serve = FakeServe([])
    assert cli.run(serve, deployment()) == 128 + signal.SIGTERM
    assert serve.calls == ["start", "run", "shutdown"] and fake_ray == ["init", "ray.shutdown"]
    assert "SIGTERM while starting: stopping" in capsys.readouterr().err


@pytest.mark.parametrize("others", [[], ["theirs"]])
def test_on_a_joined_cluster_only_its_application_goes(fake_ray, others):
    serve = FakeServe(list(others))
    assert cli.run(serve, deployment("--address", "auto", "--app-name", "ours")) == 128 + signal.SIGTERM
    assert serve.calls == ["start", "run", "delete ours"] and fake_ray == ["init", "ray.shutdown"]
