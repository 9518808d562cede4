"""Prefill/decode disaggregation with real processes on one machine: a prefill server, a decode server and
the P/D router, against a plain server. Greedy tokens are the same; the decode server loads the prompt's
blocks the prefill server sent (counted in its metrics) instead of computing them; streaming passes through
the router; a prefill server that is down costs only the decode server's own prefill."""

from __future__ import annotations

import json
import random
import signal
import socket
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from llmserve.testing.router_servers import RouterProcess, sample_value
from llmserve.testing.servers import ServerProcess, tiny_model, wait_until

ENGINE_ARGS = ("--max-model-len", "512", "--num-kv-blocks", "128", "--max-num-seqs", "8")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return tiny_model(str(tmp_path_factory.mktemp("pd-model")))


@pytest.fixture(scope="module")
def servers(model, gate):
    """(plain, prefill, decode) servers; the P/D router's prefill list also names a port nobody listens on.
    The prefill server's engine has the module's step gate (free-running until a test holds it)."""
    started = []
    try:
        for extra, env in (((), None), (("--disaggregation-mode", "prefill"), gate.env),
                           (("--disaggregation-mode", "decode", "--disaggregation-kv-port", str(_free_port())), None)):
            started.append(ServerProcess(["--model", model, *ENGINE_ARGS, *extra], env=env).start())
        yield tuple(started)
    finally:
        for server in started:
            assert server.stop() == 0


@pytest.fixture(scope="module")
def router(servers):
    _, prefill, decode = servers
    dead = f"http://127.0.0.1:{_free_port()}"
    with RouterProcess(["--pd-disaggregation", "--prefill", prefill.url, "--prefill", dead,
                        "--decode", decode.url, "--port", "0"]) as proc:
        yield proc


def _prompt(seed: int, length: int = 150) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 250) for _ in range(length)]


def _complete(url: str, prompt=None, **fields) -> dict:
    body = {"max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True, **fields}
    if prompt is not None:
        body["prompt"] = prompt
    response = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def _metrics(server: ServerProcess) -> str:
    return httpx.get(f"{server.url}/metrics", timeout=10).text


def test_tokens_equal_a_single_servers_and_the_prompt_is_loaded_not_computed(servers, router):
    plain, prefill, decode = servers
    hits_before = sample_value(_metrics(decode), "llmserve:kv_offload_hit_tokens_total", tier="host")
    for seed in range(2):  # round robin: one request meets the live prefill server, one the dead one
        prompt = _prompt(seed)
        expected = _complete(plain.url, prompt)["choices"][0]["text"]
        assert _complete(router.url, prompt)["choices"][0]["text"] == expected
    stats = httpx.get(f"{router.url}/pd_stats", timeout=10).json()
    assert stats["num_requests"] == 2 and stats["num_prefill_failures"] == 1
    decode_metrics = _metrics(decode)
    hits = sample_value(decode_metrics, "llmserve:kv_offload_hit_tokens_total", tier="host") - hits_before
    assert hits == 144  # the 9 full blocks of the prompt the prefill server ran
    assert sample_value(decode_metrics, "llmserve:kv_transfer_received_blocks_total") >= 9
    assert sample_value(_metrics(prefill), "llmserve:kv_transfer_sent_blocks_total") >= 9


def test_streaming_through_the_router(servers, router):
    plain, _, _ = servers
    messages = [{"role": "user", "content": "tell me about disaggregated serving " * 8}]
    body = {"model": None, "messages": messages, "max_tokens": 10, "temperature": 0}
    expected = httpx.post(f"{plain.url}/v1/chat/completions", json=body, timeout=120).json()
    texts = []
    for _ in range(2):  # both prefill servers in turn
        with httpx.stream("POST", f"{router.url}/v1/chat/completions", json={**body, "stream": True},
                          timeout=120) as response:
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = [line for line in response.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        chunks = [json.loads(line[6:]) for line in lines[:-1]]
        texts.append("".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]))
    assert texts == [expected["choices"][0]["message"]["content"]] * 2


def test_structured_outputs_through_the_router(servers, router):
    """The prefill server runs the grammar for its one token, the decode server for the whole answer."""
    plain, _, _ = servers
    body = {"prompt": _prompt(11), "max_tokens": 20, "temperature": 0, "ignore_eos": False,
            "structured_outputs": {"choice": ["prefill", "decode", "disaggregated"]}}
    expected = _complete(plain.url, **body)
    for _ in range(2):  # both prefill servers in turn
        text = _complete(router.url, **body)["choices"][0]["text"]
        assert text == expected["choices"][0]["text"] and text in ("prefill", "decode", "disaggregated")


def test_a_client_that_goes_away_mid_stream_leaves_nothing_running(servers, router):
    _, prefill, decode = servers
    body = {"prompt": _prompt(7), "max_tokens": 300, "temperature": 0, "ignore_eos": True, "stream": True}

    def num_aborted() -> float:
        return sample_value(_metrics(decode), "llmserve:request_success_total", finished_reason="abort")

    num_before = num_aborted()
    with httpx.stream("POST", f"{router.url}/v1/completions", json=body, timeout=120) as response:
        assert response.status_code == 200
        next(line for line in response.iter_lines() if line.startswith("data: "))
    for server in (prefill, decode):  # the decode server aborts the request once the router drops it
        wait_until(lambda: sample_value(_metrics(server), "llmserve:num_requests_running") == 0, timeout=60,
                   what="no request running")
    wait_until(lambda: num_aborted() == num_before + 1, timeout=30, what="the decode server's abort")


def test_a_killed_decode_server_fails_its_requests_cleanly(model, servers):
    """The router answers 502 in OpenAI's shape; the prefill server, whose transfer finds no receiver, finishes
    its request after about a second and stays healthy and idle (its block counts checked when idle)."""
    _, prefill, _ = servers
    decode = ServerProcess(["--model", model, *ENGINE_ARGS, "--disaggregation-mode", "decode",
                            "--disaggregation-kv-port", str(_free_port())]).start()
    try:
        with RouterProcess(["--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
                            "--port", "0"]) as proc:
            _complete(proc.url, _prompt(21))  # the router learns the decode server's KV address
            decode.stop(signal.SIGKILL)
            response = httpx.post(f"{proc.url}/v1/completions", json={"prompt": _prompt(22), "max_tokens": 4},
                                  timeout=120)
            assert response.status_code == 502 and "decode server failed" in response.json()["error"]["message"]
    finally:
        decode.stop()
    wait_until(lambda: sample_value(_metrics(prefill), "llmserve:num_requests_running") == 0, timeout=30,
               what="no request running on the prefill server")
    assert httpx.get(f"{prefill.url}/health", timeout=5).status_code == 200


def test_kv_transfer_params_are_refused_by_a_server_that_is_no_prefill_server(servers):
    plain, _, decode = servers
    for server in (plain, decode):
        body = {"prompt": "hi", "max_tokens": 2, "kv_transfer_params": {"decode_kv_address": "tcp://127.0.0.1:1"}}
        response = httpx.post(f"{server.url}/v1/completions", json=body, timeout=30)
        assert response.status_code == 400 and "kv_transfer_params" in response.json()["error"]["message"]


def test_a_client_error_on_the_prefill_server_is_the_clients(router):
    response = httpx.post(f"{router.url}/v1/completions", json={"prompt": "hi", "max_tokens": -1}, timeout=30)
    assert response.status_code == 400


def test_both_servers_stay_healthy_with_their_blocks_accounted(servers, router):
    """Each engine checks its block bookkeeping (and its tiers') whenever it goes idle: a broken count
    takes the engine down, which /health reports."""
    for server in servers[1:]:
        wait_until(lambda: httpx.get(f"{server.url}/health", timeout=5).status_code == 200, timeout=30,
                   what="a healthy server")
    assert httpx.get(f"{router.url}/health", timeout=10).status_code == 200


def test_short_prompts_skip_the_prefill_server_with_a_local_prefill_length(servers):
    """--max-local-prefill-length 64: a chat of over a block but under 64 tokens (counted by the decode server's
    /tokenize) is computed by the decode server alone; a 150-token prompt still goes through the prefill server."""
    plain, prefill, decode = servers
    with RouterProcess(["--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
                        "--max-local-prefill-length", "64", "--port", "0"]) as proc:
        sent_before = sample_value(_metrics(prefill), "llmserve:kv_transfer_sent_blocks_total")
        chat = {"messages": [{"role": "user", "content": "hi " * 8}], "max_tokens": 6, "temperature": 0,
                "ignore_eos": True}
        expected = httpx.post(f"{plain.url}/v1/chat/completions", json=chat, timeout=120).json()
        answer = httpx.post(f"{proc.url}/v1/chat/completions", json=chat, timeout=120).json()
        assert answer["choices"][0]["message"] == expected["choices"][0]["message"]
        assert sample_value(_metrics(prefill), "llmserve:kv_transfer_sent_blocks_total") == sent_before
        prompt = _prompt(31)
        assert _complete(proc.url, prompt)["choices"][0]["text"] == _complete(plain.url, prompt)["choices"][0]["text"]
        assert sample_value(_metrics(prefill), "llmserve:kv_transfer_sent_blocks_total") >= sent_before + 9
        stats = httpx.get(f"{proc.url}/pd_stats", timeout=10).json()
        assert (stats["num_requests"], stats["num_local_prefills"], stats["num_prefill_failures"]) == (2, 1, 0)


def test_a_short_prompt_beside_a_long_one_is_computed_on_the_decode_server(servers, gate):
    """--max-local-prefill-length-if-busy 64: while the prefill server holds a 150-token prompt (its engine held
    at a step boundary), a chat under 64 tokens is answered by the decode server alone; the long prompt
    completes once the prefill server steps again, its tokens a plain server's."""
    plain, prefill, decode = servers
    chat = {"messages": [{"role": "user", "content": "hi " * 8}], "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}
    expected = httpx.post(f"{plain.url}/v1/chat/completions", json=chat, timeout=120).json()
    with RouterProcess(["--pd-disaggregation", "--prefill", prefill.url, "--decode", decode.url,
                        "--max-local-prefill-length-if-busy", "64", "--port", "0"]) as proc:
        def pd_stats() -> dict:
            return httpx.get(f"{proc.url}/pd_stats", timeout=10).json()

        with ThreadPoolExecutor(1) as pool:
            with gate.held():
                long = pool.submit(_complete, proc.url, _prompt(41))
                wait_until(lambda: pd_stats()["prefill"].get(prefill.url) == 1, 60, "the long prompt sent")
                answer = httpx.post(f"{proc.url}/v1/chat/completions", json=chat, timeout=120).json()
                assert answer["choices"][0]["message"] == expected["choices"][0]["message"]
                assert not long.done()  # still at the held prefill server
            text = long.result(timeout=120)["choices"][0]["text"]
            assert text == _complete(plain.url, _prompt(41))["choices"][0]["text"]
        stats = pd_stats()
        assert (stats["num_local_beside_long_prefills"], stats["prefill"], stats["num_prefill_failures"]) == \
            (1, {prefill.url: 1}, 0)
