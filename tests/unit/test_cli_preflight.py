"""`llmserve serve` mistakes found before anything loads: each one line on stderr naming the flag, exit code 2,
torch never imported, well under a few seconds (a real `python -m llmserve.cli serve` per case)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time

import pytest


def _serve(*flags: str, command: str = "serve") -> tuple[int, list[str], set[str], float]:
    """Exit code, stderr's lines, the modules imported (from -X importtime) and the seconds it took."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "llmserve.cli", command, *flags],
                          capture_output=True, text=True, timeout=60)
    seconds = time.monotonic() - start
    lines = proc.stderr.splitlines()
    imported = {line.rsplit("|", 1)[-1].strip() for line in lines if line.startswith("import time:")}
    return proc.returncode, [line for line in lines if not line.startswith("import time:")], imported, seconds


@pytest.fixture(scope="module")
def short_model(tmp_path_factory) -> str:
    """A checkpoint directory with only a config.json: enough for every check made before loading."""
    path = tmp_path_factory.mktemp("short-model")
    (path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"],
                                                  "max_position_embeddings": 128}))
    return str(path)


@pytest.fixture
def taken_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield str(sock.getsockname()[1])


CASES = {
    "missing model": (lambda tmp, model, port: ["--model", str(tmp / "missing")], "--model", "does not exist"),
    "no config.json": (lambda tmp, model, port: ["--model", str(tmp)], "--model", "no config.json"),
    "past the model's length": (lambda tmp, model, port: ["--model", model, "--max-model-len", "256"],
                                "--max-model-len", "limit of 128"),
    "fp16 KV on bf16": (lambda tmp, model, port: ["--kv-cache-dtype", "fp16", "--dtype", "bfloat16"],
                        "--kv-cache-dtype", "--dtype float32"),
    "int8 KV on CUDA": (lambda tmp, model, port: ["--kv-cache-dtype", "int8", "--device", "cuda"],
                        "--kv-cache-dtype", "CPU"),
    "too few KV blocks": (lambda tmp, model, port: [model, "--num-gpu-blocks-override", "4"],
                          "--num-gpu-blocks-override",
                          "one block is reserved"),
    "missing draft": (lambda tmp, model, port: ["--speculative", "draft", "--draft-model", str(tmp / "d")],
                      "--draft-model", "does not exist"),
    "port in use": (lambda tmp, model, port: ["--port", port], "--port", "in use"),
    "bad choice": (lambda tmp, model, port: ["--dtype", "float64"], "--dtype", "invalid choice"),
}


@pytest.mark.parametrize("case", CASES)
def test_a_mistake_is_one_line_exit_2_before_anything_loads(case, tmp_path, short_model, taken_port):
    make_flags, flag, words = CASES[case]
    code, lines, imported, seconds = _serve(*make_flags(tmp_path, short_model, taken_port))
    assert code == 2, lines
    assert len(lines) == 1, lines
    assert lines[0].startswith(f"llmserve serve: error: {flag}") and words in lines[0], lines
    assert "torch" not in imported and "transformers" not in imported
    assert seconds < 5  # about 0.5 s on 2 cores; loading the model would take 15 s and more


@pytest.mark.parametrize("command", ["generate", "serve-ray"])
def test_generate_and_a_local_serve_ray_check_the_model_before_loading(command, tmp_path):
    extra = ["--prompt", "hi"] if command == "generate" else []
    code, lines, imported, _ = _serve("--model", str(tmp_path / "missing"), *extra, command=command)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"llmserve {command}: error: --model: directory") and "torch" not in imported

