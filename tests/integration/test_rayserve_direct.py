"""`llmserve serve-ray --direct-ingress-port` as a user runs it (a real process starting its own Ray): the
ingress replica's own HTTP server answers the OpenAI client (streamed and not) and TGI's route without Ray's
proxy, through our replica; Ray's proxy port serves too; SIGINT stops everything. Polls with deadlines, no
sleeps."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile

import httpx
import openai
import pytest

pytest.importorskip("ray.serve")

from llmserve.rayserve.messages import REPLICA_HEADER  # noqa: E402
from llmserve.testing.router_servers import shared_tiny_model  # noqa: E402
from llmserve.testing.servers import read_log, wait_until  # noqa: E402

READY_LINE = "without Ray's proxy at"
STARTUP_TIMEOUT_S = 240.0  # Ray, its controller, the proxy, the ingress and one engine replica on 2 cores


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _is_up(url: str) -> bool:
    try:
        return httpx.get(f"{url}/v1/models", timeout=5).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.fixture(scope="module")
def urls(tmp_path_factory):
    """(direct ingress URL, Ray proxy URL) of a running `llmserve serve-ray` process."""
    model = shared_tiny_model(str(tmp_path_factory.getbasetemp()))
    proxy_port, direct_port = free_port(), free_port()
    ray_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    log = tempfile.TemporaryFile("w+")
    cmd = [sys.executable, "-m", "llmserve.cli", "serve-ray", "--model", model, "--dtype", "float32",
           "--max-model-len", "512", "--num-kv-blocks", "200", "--served-model-name", "tiny", "--host", "127.0.0.1",
           "--port", str(proxy_port), "--direct-ingress-port", str(direct_port), "--num-replicas", "1",
           "--num-cpus", "2", "--replica-num-cpus", "1", "--log-level", "warning"]
    env = {**os.environ, "RAY_TMPDIR": ray_dir, "TMPDIR": ray_dir}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
    direct, proxy = f"http://127.0.0.1:{direct_port}", f"http://127.0.0.1:{proxy_port}"
    try:
        # the line it prints once serve.run returned, just before it waits for SIGINT/SIGTERM
        wait_until(lambda: proc.poll() is not None or READY_LINE in read_log(log.fileno()), STARTUP_TIMEOUT_S,
                   "serve-ray up")
        assert proc.poll() is None, f"serve-ray exited with {proc.returncode}:\n{read_log(log.fileno())}"
        yield direct, proxy, proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        shutil.rmtree(ray_dir, ignore_errors=True)


def test_openai_and_tgi_on_the_direct_ingress_port(urls):
    direct, proxy, _ = urls
    client = openai.OpenAI(base_url=f"{direct}/v1", api_key="none", max_retries=0)
    done = client.completions.create(model="tiny", prompt="hello", max_tokens=5, temperature=0,
                                     extra_body={"ignore_eos": True})
    assert done.usage.completion_tokens == 5 and done.choices[0].finish_reason == "length"
    stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                            max_tokens=4, stream=True, extra_body={"ignore_eos": True})
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason == "length"
    tgi = httpx.post(f"{direct}/generate", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}},
                     timeout=60)
    assert tgi.status_code == 200 and "generated_text" in tgi.json()
    assert tgi.headers[REPLICA_HEADER]  # answered by our replica, through the ingress
    through_proxy = httpx.get(f"{proxy}/v1/models", timeout=60)  # Ray's proxy still serves the application
    assert through_proxy.json()["data"][0]["id"] == "tiny"


def test_sigint_stops_serve_ray(urls):
    direct, _, proc = urls
    proc.send_signal(signal.SIGINT)
    assert proc.wait(120) == 0
    assert not _is_up(direct)
