"""The benchmark client and runner against a scripted fake OpenAI server (FastAPI on a loopback port).

The fake serves /{server}/v1/... so that one process plays both sides of --compare; the request's model
name picks the script: ok, slow, error500, hang, midstream_error, drop, garbage, strict (rejects ignore_eos).
"""

import asyncio
import json
import socket
import threading
import time

import aiohttp
import pytest
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse

from llmserve.bench import probe
from llmserve.bench.client import Target, make_http_client, send_request
from llmserve.bench.client_procs import num_client_processes
from llmserve.bench.config import BenchServeConfig, DatasetConfig, LoadConfig, OutputConfig, TargetConfig
from llmserve.bench.datasets import BenchRequest
from llmserve.bench.runner import run_benchmark
from llmserve.messages import GrammarStats, SchedulerStats
from llmserve.server.metrics import ServerMetrics
from llmserve.testing.servers import wait_until

MODELS = ["ok", "slow", "error500", "hang", "midstream_error", "drop", "garbage", "strict", "flaky"]
TOKEN_DELAY_S = 0.002


def _chunk(endpoint, text):
    if endpoint == "chat":
        return {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]}
    return {"object": "text_completion", "choices": [{"index": 0, "text": text}]}


def make_app(log):
    app = FastAPI()

    @app.get("/{server}/v1/models")
    async def models(server: str):
        return {"object": "list", "data": [{"id": m, "object": "model"} for m in MODELS]}

    @app.get("/{server}/metrics")
    async def metrics(server: str):
        """Server "g" exports llmserve's grammar metrics: the first constrained request compiles, the rest hit."""
        if server != "g":
            return PlainTextResponse("not found", 404)
        n = sum(1 for c in log if c[0] == "g" and ("response_format" in c[3] or "structured_outputs" in c[3]))
        exported = ServerMetrics("m")
        exported.on_scheduler_stats(SchedulerStats(grammar=GrammarStats(n, max(n - 1, 0), [0.05] if n else [])))
        return PlainTextResponse(exported.render().decode())

    @app.post("/{server}/v1/completions")
    async def completions(server: str, request: Request):
        return await _answer(server, "completions", await request.json())

    @app.post("/{server}/v1/chat/completions")
    async def chat(server: str, request: Request):
        return await _answer(server, "chat", await request.json())

    async def _answer(server, endpoint, body):
        model = body.get("model")
        log.append((server, model, time.perf_counter(), body))
        if model not in MODELS:
            return JSONResponse({"error": {"message": f"The model `{model}` does not exist."}}, 404)
        if model == "error500" or (model == "flaky" and len(log) % 3 == 0):
            return JSONResponse({"error": {"message": "internal"}}, 500)
        if model == "strict" and "ignore_eos" in body:
            return JSONResponse({"error": {"message": "Unrecognized request argument: ignore_eos"}}, 400)
        if model == "hang":
            await asyncio.sleep(3)
        n = body["max_tokens"]
        if not body.get("stream"):
            await asyncio.sleep(TOKEN_DELAY_S * n)
            text = "x" * n
            choice = {"message": {"role": "assistant", "content": text}} if endpoint == "chat" else {"text": text}
            return {"choices": [choice], "usage": {"prompt_tokens": 11, "completion_tokens": n}}
        return StreamingResponse(_stream(model, endpoint, body, n), media_type="text/event-stream")

    async def _stream(model, endpoint, body, n):
        if endpoint == "chat":
            yield "data: " + json.dumps({"choices": [{"delta": {"role": "assistant", "content": ""}}]}) + "\n\n"
        for i in range(n):
            await asyncio.sleep(TOKEN_DELAY_S * (5 if model == "slow" else 1))
            if i == 2 and model == "midstream_error":
                yield 'data: {"error": {"message": "engine died"}}\n\n'
                return
            if i == 2 and model == "drop":
                raise RuntimeError("connection dropped")
            if model == "garbage":
                yield "data: not json\n\n"
                return
            yield "data: " + json.dumps(_chunk(endpoint, f"t{i}")) + "\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            yield "data: " + json.dumps({"choices": [], "usage": {"prompt_tokens": 11, "completion_tokens": n}}) + "\n\n"
        yield "data: [DONE]\n\n"

    return app


@pytest.fixture(scope="module")
def fake():
    """(base URL without the server prefix, request log)."""
    log = []
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(make_app(log), host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_until(lambda: server.started, 30, "the fake server to start", poll_s=0.01)
    yield f"http://127.0.0.1:{port}", log
    server.should_exit = server.force_exit = True
    thread.join(timeout=5)


REQ = BenchRequest([1, 2, 3], 3, 6)


def _send(url, model, req=REQ, **kw):
    async def go():
        async with make_http_client() as client:
            return await send_request(client, Target("A", url, model, **kw), req, 0)

    return asyncio.run(go())


def test_stream_completions(fake):
    rec = _send(fake[0] + "/a", "ok")
    assert rec.is_success and rec.error_kind is None
    assert (rec.num_chunks, rec.num_output_tokens, rec.output_tokens_source) == (6, 6, "usage")
    assert rec.num_prompt_tokens == 11  # the server's usage wins over the dataset's count
    assert len(rec.itl_s) == 5 and 0 < rec.ttft_s <= rec.e2e_s
    assert rec.e2e_s == pytest.approx(rec.ttft_s + sum(rec.itl_s))
    body = fake[1][-1][3]
    assert body["prompt"] == [1, 2, 3] and body["ignore_eos"] is True and body["max_tokens"] == 6
    assert body["stream_options"] == {"include_usage": True}


def test_stream_chat_skips_role_chunk(fake):
    rec = _send(fake[0] + "/a", "ok", BenchRequest("hi", 1, 4, system="sys"), endpoint="chat")
    assert rec.is_success and rec.num_chunks == 4 and len(rec.itl_s) == 3
    assert fake[1][-1][3]["messages"] == [{"role": "system", "content": "sys"}, {"role": "user", "content": "hi"}]


def test_counts_chunks_without_usage(fake):
    rec = _send(fake[0] + "/a", "ok", is_usage_requested=False)
    assert rec.is_success and (rec.num_output_tokens, rec.output_tokens_source) == (6, "chunks")
    assert "stream_options" not in fake[1][-1][3]


def test_no_stream(fake):
    rec = _send(fake[0] + "/a", "ok", is_streaming=False, extra_body={"temperature": 0})
    assert rec.is_success and rec.ttft_s is None and rec.itl_s == [] and rec.e2e_s > 0
    assert (rec.num_output_tokens, rec.output_tokens_source) == (6, "usage")
    body = fake[1][-1][3]
    assert body["stream"] is False and "stream_options" not in body and body["temperature"] == 0


@pytest.mark.parametrize("model, kind", [("error500", "http_500"), ("midstream_error", "stream_error"),
                                         ("drop", "connection"), ("garbage", "protocol"), ("nope", "http_404")])
def test_errors_are_recorded(fake, model, kind):
    rec = _send(fake[0] + "/a", model)
    assert not rec.is_success and rec.error_kind == kind and rec.error


def test_timeout(fake):
    t0 = time.perf_counter()
    rec = _send(fake[0] + "/a", "hang", timeout_s=0.2)
    assert rec.error_kind == "timeout" and time.perf_counter() - t0 < 2


def test_unreachable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert _send(f"http://127.0.0.1:{port}", "ok").error_kind == "connection"


def _connect(url, model, endpoint="completions", req=REQ):
    async def go():
        async with make_http_client() as client:
            return await probe.connect(client, Target("A", url, model, endpoint), req)

    return asyncio.run(go())


def test_probe_finds_model_and_negotiates(fake):
    target, notes = _connect(fake[0] + "/a", "")
    assert target.model == "ok" and target.is_ignore_eos_sent and notes == []
    target, notes = _connect(fake[0] + "/a", "strict")
    assert not target.is_ignore_eos_sent and target.is_usage_requested and "ignore_eos" in notes[0]


@pytest.mark.parametrize("model, endpoint, message", [
    ("nope", "completions", "not among the served models"),
    ("error500", "completions", "HTTP 500"),
])
def test_probe_errors(fake, model, endpoint, message):
    with pytest.raises(ValueError, match=message):
        _connect(fake[0] + "/a", model, endpoint)


def test_probe_wrong_endpoint_and_unreachable(fake):
    with pytest.raises(ValueError, match="try --endpoint"):
        _connect(fake[0] + "/nowhere/x", "ok")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ValueError, match="cannot reach"):
        _connect(f"http://127.0.0.1:{port}", "ok")


def _cfg(url, **load):
    return BenchServeConfig(
        target=TargetConfig(url=url + "/a", model="ok", compare=url + "/b", compare_model="slow", labels="fast,slow"),
        dataset=DatasetConfig(input_len=4, output_len=5),
        load=LoadConfig(**{"num_requests": 8, "warmup": 1, **load}),
        output=OutputConfig(progress=False, slo="ttft=1000"),
    )


def test_compare_interleaves_same_requests(fake):
    url, log = fake
    start = len(log)
    result = asyncio.run(run_benchmark(_cfg(url, concurrency="1,4", rounds=2), None, log=lambda m: None))
    assert [t.label for t in result.servers] == ["fast", "slow"]
    assert [lv.name for lv in result.levels] == ["c=1", "c=4"]
    calls = log[start:]
    # probe a, probe b, warm-up a, warm-up b, then per level: 4 on a, 4 on b, then 4 on b, 4 on a (each first once)
    assert [c[0] for c in calls] == ["a", "b", "a", "b"] + (["a"] * 4 + ["b"] * 8 + ["a"] * 4) * 2
    measured = calls[4:]
    for level in range(2):
        chunk = measured[16 * level: 16 * (level + 1)]
        a = [c[3]["prompt"] for c in chunk if c[0] == "a"]
        b = [c[3]["prompt"] for c in chunk if c[0] == "b"]
        assert sorted(a) == sorted(b) and len(a) == 8
    assert measured[0][3]["prompt"] != measured[16][3]["prompt"]  # fresh prompts per level
    for run in result.runs:
        m = run.metrics
        assert m.num_completed == 8 and m.total_output_tokens == 40 and m.goodput is not None
        assert [r.index for r in run.records] == list(range(8))
    fast, slow = result.run("fast", result.levels[1]), result.run("slow", result.levels[1])
    assert slow.metrics.tpot_ms.median > 2 * fast.metrics.tpot_ms.median


@pytest.mark.parametrize("load", [dict(concurrency="4"), dict(request_rate="50", concurrency="3")])
def test_two_client_processes_send_the_one_process_runs_requests_from_one_start(fake, load):
    """Process k sends requests k, k + 2, ...: every request once, the same prompts as from one process, each
    record timed from the common start, the level's duration covering every request."""
    url, log = fake

    def run(num_processes):
        cfg = BenchServeConfig(target=TargetConfig(url=url + "/a", model="ok"),
                               dataset=DatasetConfig(input_len=4, output_len=5),
                               load=LoadConfig(num_requests=10, warmup=0, client_processes=num_processes, **load),
                               output=OutputConfig(progress=False))
        start = len(log)
        (level_run,) = asyncio.run(run_benchmark(cfg, None, log=lambda m: None)).runs
        return level_run, sorted(str(c[3]["prompt"]) for c in log[start + 1:])  # the probe's request first

    one, prompts_one = run(1)
    two, prompts_two = run(2)
    assert prompts_two == prompts_one and len(prompts_two) == 10
    assert [r.index for r in two.records] == list(range(10)) and all(r.is_success for r in two.records)
    assert two.metrics.total_output_tokens == one.metrics.total_output_tokens == 50
    assert all(r.start_s >= 0 for r in two.records)  # from the common start, never before it
    assert two.metrics.duration_s >= max(r.start_s + r.e2e_s for r in two.records)


def test_client_processes_by_requests_in_flight():
    import os

    assert num_client_processes(3, 1) == 3 and num_client_processes(0, None) == 1
    most = max(1, (os.cpu_count() or 1) // 4)
    assert num_client_processes(0, 128) == 1 and num_client_processes(0, 1024) == min(most, 8)


def test_open_loop_and_errors_mid_run(fake):
    url, _ = fake
    cfg = BenchServeConfig(
        target=TargetConfig(url=url + "/a", model="flaky", timeout=5),
        dataset=DatasetConfig(input_len=4, output_len=3),
        load=LoadConfig(request_rate="200", concurrency="2", num_requests=12, warmup=0),
        output=OutputConfig(progress=False),
    )
    try:
        result = asyncio.run(run_benchmark(cfg, None, log=lambda m: None))
    except ValueError:  # the probe itself drew a 500 from the flaky script
        result = asyncio.run(run_benchmark(cfg, None, log=lambda m: None))
    (run,) = result.runs
    assert run.level.name == "rate=200,cap=2"
    m = run.metrics
    assert m.num_completed + m.num_failed == 12 and m.num_failed >= 3 and set(m.errors) == {"http_500"}
    starts = [r.start_s for r in run.records]
    assert starts == sorted(starts) and all(r.queue_s >= 0 for r in run.records)  # the cap's queue is FIFO


def test_json_schema_run_reports_grammar_from_servers_that_export_it(fake, tmp_path):
    url, log = fake
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    cfg = BenchServeConfig(
        target=TargetConfig(url=url + "/g", model="ok", compare=url + "/b", compare_model="ok", labels="g,b",
                            endpoint="chat", json_schema=str(path)),
        dataset=DatasetConfig(input_len=4, output_len=3),
        load=LoadConfig(concurrency="2", num_requests=4, warmup=1),
        output=OutputConfig(progress=False),
    )
    start = len(log)
    result = asyncio.run(run_benchmark(cfg, None, log=lambda m: None))
    bodies = [c[3] for c in log[start:]]
    assert len(bodies) == 12 and all(b["response_format"]["json_schema"]["schema"] == schema for b in bodies)
    g, b = result.run("g", result.levels[0]), result.run("b", result.levels[0])
    assert b.grammar is None and b.metrics.num_completed == 4
    assert (g.grammar.num_queries, g.grammar.num_hits, g.grammar.num_compiles) == (4, 4, 0)  # the probe compiled it
    assert g.grammar.cache_hit_rate == 1.0 and g.grammar.mean_compile_s is None
    whole = result.grammar["g"]  # probe and warm-up included
    assert set(result.grammar) == {"g"} and (whole.num_queries, whole.num_compiles) == (6, 1)
    assert whole.mean_compile_s == pytest.approx(0.05) and whole.max_compile_s == 0.05


def test_several_models_are_spread_over_the_requests():
    """--model a,b,c: each request names one, the same one every time it is sent."""
    from llmserve.bench.client import Target, build_payload
    from llmserve.bench.datasets import BenchRequest

    target = Target("t", "http://x", "a0,a1,a2")
    requests = [BenchRequest([i, i + 1, i + 2], 3, 4) for i in range(60)]
    models = [build_payload(target, r)["model"] for r in requests]
    assert set(models) == {"a0", "a1", "a2"}
    assert models == [build_payload(target, r)["model"] for r in requests]
    assert build_payload(Target("t", "http://x", "base"), requests[0])["model"] == "base"


_SSE_BODY = b'data: {"choices":[{"index":0,"text":"hi"}]}\n\ndata: [DONE]\n\n'


async def _read_request(reader: asyncio.StreamReader) -> bool:
    """One HTTP request off the connection (headers and body); False when the client closed it."""
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.IncompleteReadError:
        return False
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
    await reader.readexactly(length)
    return True


def test_a_write_that_fails_on_a_closed_kept_alive_connection_is_sent_again(fake, monkeypatch):
    """aiohttp reports a close that races the request's write (llama-server ending an idle connection) as
    ClientOSError, not ServerDisconnectedError: sent again once, like it. A refused connection is not."""
    from llmserve.bench import client as bench_client

    real, calls = bench_client._exchange, []

    async def close_under_the_first_write(*args):
        calls.append(1)
        if len(calls) == 1:
            raise aiohttp.ClientOSError(None, "Can not write request body")
        return await real(*args)

    monkeypatch.setattr(bench_client, "_exchange", close_under_the_first_write)
    rec = _send(fake[0] + "/a", "ok")
    assert rec.is_success and rec.num_retries == 1 and len(calls) == 2
    monkeypatch.setattr(bench_client, "_exchange", real)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    refused = _send(f"http://127.0.0.1:{port}", "ok")
    assert refused.error_kind == "connection" and refused.num_retries == 0


@pytest.mark.parametrize("is_answer_started", [False, True])
def test_a_kept_alive_connection_closed_unanswered_is_sent_again_once(is_answer_started):
    """A raw HTTP/1.1 server: its first connection answers one request, then closes on the second without a
    byte (what llama-server does to a connection idle past its keep-alive) or after the status line; later
    connections answer. Only the unanswered one is sent again, on a new connection."""
    connections = []

    async def serve(reader, writer):
        connections.append(writer)
        num_answered = 0
        while await _read_request(reader):
            if len(connections) == 1 and num_answered == 1:
                if is_answer_started:
                    writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: 999\r\n\r\n")
                    await writer.drain()
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncontent-length: "
                         + str(len(_SSE_BODY)).encode() + b"\r\n\r\n" + _SSE_BODY)
            await writer.drain()
            num_answered += 1

    async def go():
        server = await asyncio.start_server(serve, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with server, make_http_client() as client:
            target = Target("A", url, "m", is_usage_requested=False)
            return [await send_request(client, target, REQ, i) for i in range(2)]

    first, second = asyncio.run(go())
    assert first.is_success and first.num_retries == 0
    if is_answer_started:  # the server had begun answering: the failure is the request's, never resent
        assert not second.is_success and second.num_retries == 0 and len(connections) == 1
    else:
        assert second.is_success and second.num_retries == 1 and second.num_chunks == 1 and len(connections) == 2
