"""The official `openai` client (sync and async) and huggingface_hub's InferenceClient against a real
server on a tiny random model."""

from __future__ import annotations

import asyncio

import openai
import pytest
from huggingface_hub import InferenceClient


GREEDY = {"temperature": 0.0}
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


@pytest.fixture
def aclient(server):
    return openai.AsyncOpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)


def chat(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def test_models(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_completion(client):
    out = client.completions.create(model="tiny", prompt="Hello, my name is", max_tokens=7, extra_body=NO_EOS)
    assert out.object == "text_completion" and len(out.choices) == 1
    choice = out.choices[0]
    assert choice.finish_reason == "length" and isinstance(choice.text, str)
    assert out.usage.completion_tokens == 7
    assert out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 7


def test_completion_stream_matches_non_stream(client):
    kwargs = dict(model="tiny", prompt="The capital of France", max_tokens=12, **GREEDY, extra_body=NO_EOS)
    full = client.completions.create(**kwargs).choices[0].text
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full
    assert chunks[-1].choices[0].finish_reason == "length"


def test_completion_token_prompts_and_batch(client):
    out = client.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=3, n=2, extra_body=NO_EOS)
    assert sorted(c.index for c in out.choices) == [0, 1, 2, 3]
    assert out.usage.prompt_tokens == 5 and out.usage.completion_tokens == 12


def test_completion_echo(client):
    out = client.completions.create(model="tiny", prompt="echo me", max_tokens=2, echo=True)
    assert out.choices[0].text.startswith("echo me")


def test_chat(client):
    out = client.chat.completions.create(model="tiny", messages=chat("hi"), max_tokens=5, extra_body=NO_EOS)
    assert out.object == "chat.completion"
    assert out.choices[0].message.role == "assistant"
    assert out.choices[0].finish_reason == "length"
    assert out.usage.completion_tokens == 5


def test_chat_stream_with_usage(client):
    stream = client.chat.completions.create(model="tiny", messages=chat("hi"), max_tokens=6, stream=True,
                                            stream_options={"include_usage": True}, extra_body=NO_EOS)
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-2].choices[0].finish_reason == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6


def test_n_greater_than_one(client):
    out = client.chat.completions.create(model="tiny", messages=chat("n"), max_tokens=4, n=3, extra_body=NO_EOS)
    assert sorted(c.index for c in out.choices) == [0, 1, 2]
    assert out.usage.completion_tokens == 12
    stream = client.completions.create(model="tiny", prompt="n", max_tokens=4, n=2, stream=True, extra_body=NO_EOS)
    finished = {c.choices[0].index for c in stream if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}


def test_logprobs(client):
    out = client.completions.create(model="tiny", prompt="logprobs", max_tokens=4, logprobs=3, extra_body=NO_EOS)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(v <= 0 for v in lp.token_logprobs)
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs)  # texts may coincide (bytes decode to U+FFFD)
    out = client.chat.completions.create(model="tiny", messages=chat("lp"), max_tokens=3, logprobs=True,
                                         top_logprobs=2, extra_body=NO_EOS)
    content = out.choices[0].logprobs.content
    assert len(content) == 3 and all(len(t.top_logprobs) == 2 for t in content)


def test_stop_string(client):
    kwargs = dict(model="tiny", prompt="Once upon a time", max_tokens=24, **GREEDY, extra_body=NO_EOS)
    full = client.completions.create(**kwargs).choices[0].text
    stop = next((full[i:i + 2] for i in range(4, len(full) - 2) if full[i:i + 2].strip() and
                 "\ufffd" not in full[:i + 2]), None)
    if stop is None:
        pytest.skip(f"no usable stop string in {full!r}")
    out = client.completions.create(stop=[stop], **kwargs).choices[0]
    assert out.finish_reason == "stop" and out.text == full[:full.index(stop)]
    assert out.stop_reason == stop


def test_seed_reproducible(client):
    kwargs = dict(model="tiny", prompt="random", max_tokens=16, temperature=1.0, extra_body=NO_EOS)
    a = client.completions.create(seed=1234, **kwargs).choices[0].text
    b = client.completions.create(seed=1234, **kwargs).choices[0].text
    c = client.completions.create(seed=4321, **kwargs).choices[0].text
    assert a == b
    assert a != c


def test_prefix_cache_reports_cached_tokens(client):
    prompt = "A long shared prefix for the prefix cache. " * 4
    client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
    assert out.usage.prompt_tokens_details.cached_tokens >= 16


def test_async_client_concurrent(aclient):
    async def one(i: int) -> str:
        stream = await aclient.chat.completions.create(model="tiny", messages=chat(f"hello {i}"), max_tokens=8,
                                                       stream=True, extra_body=NO_EOS)
        parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        return "".join(parts)

    async def main():
        texts = await asyncio.gather(*(one(i) for i in range(8)))
        out = await aclient.completions.create(model="tiny", prompt="async", max_tokens=3, extra_body=NO_EOS)
        return texts, out

    texts, out = asyncio.run(main())
    assert len(texts) == 8 and out.usage.completion_tokens == 3


def test_unknown_model_is_404(client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert e.value.body["code"] == "model_not_found"


def test_tgi_text_generation(server):
    tgi = InferenceClient(model=server.url)
    text = tgi.text_generation("Hello", max_new_tokens=5)
    assert isinstance(text, str)
    out = tgi.text_generation("Hello", max_new_tokens=5, details=True, seed=3, do_sample=True)
    assert out.details.generated_tokens == len(out.details.tokens) <= 5
    assert out.details.finish_reason in ("length", "eos_token")
    assert "".join(t.text for t in out.details.tokens) or out.generated_text == ""


def test_tgi_streaming(server):
    tgi = InferenceClient(model=server.url)
    full = tgi.text_generation("Stream", max_new_tokens=6, details=True)
    pieces = list(tgi.text_generation("Stream", max_new_tokens=6, stream=True))
    assert "".join(pieces) == full.generated_text
    events = list(tgi.text_generation("Stream", max_new_tokens=6, stream=True, details=True))
    assert events[-1].generated_text == full.generated_text
    assert events[-1].details.generated_tokens == full.details.generated_tokens
    assert [e.token.id for e in events] == [t.id for t in full.details.tokens]


def _tokenize(server, **body) -> list[int]:
    import httpx

    return httpx.post(f"{server.url}/tokenize", json=body, timeout=60).json()["tokens"]


def test_completion_returns_token_ids_streamed_or_not(server, client):
    """vLLM's return_token_ids: the prompt's ids (once per choice) and the output's, the same streamed or not."""
    body = {**NO_EOS, "return_token_ids": True}
    out = client.completions.create(model="tiny", prompt="Hello there", max_tokens=6, extra_body=body, **GREEDY)
    choice = out.choices[0].model_extra
    assert choice["prompt_token_ids"] == _tokenize(server, prompt="Hello there") and len(choice["token_ids"]) == 6
    chunks = [c.choices[0].model_extra for c in client.completions.create(
        model="tiny", prompt="Hello there", max_tokens=6, stream=True, extra_body=body, **GREEDY) if c.choices]
    assert chunks[0]["prompt_token_ids"] == choice["prompt_token_ids"]
    assert all(c["prompt_token_ids"] is None for c in chunks[1:])
    assert [t for c in chunks for t in c["token_ids"] or []] == choice["token_ids"]
    plain = client.completions.create(model="tiny", prompt="Hello there", max_tokens=2, extra_body=NO_EOS)
    assert plain.choices[0].model_extra["token_ids"] is None  # only when asked for


def test_chat_returns_token_ids_streamed_or_not(server, client):
    messages = chat("Say hi")
    body = {**NO_EOS, "return_token_ids": True}
    out = client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, extra_body=body, **GREEDY)
    prompt_ids = _tokenize(server, messages=messages)
    assert out.model_extra["prompt_token_ids"] == prompt_ids
    token_ids = out.choices[0].model_extra["token_ids"]
    assert len(token_ids) == out.usage.completion_tokens == 5
    chunks = list(client.chat.completions.create(model="tiny", messages=messages, max_tokens=5, stream=True,
                                                 extra_body=body, **GREEDY))
    assert chunks[0].model_extra["prompt_token_ids"] == prompt_ids
    assert [t for c in chunks for choice in c.choices for t in choice.model_extra["token_ids"] or []] == token_ids


@pytest.mark.parametrize("route", ["completions", "chat"])
def test_logprobs_name_tokens_by_id_when_asked(client, route):
    body = {**NO_EOS, "return_tokens_as_token_ids": True, "return_token_ids": True}
    if route == "completions":
        out = client.completions.create(model="tiny", prompt="Hi", max_tokens=4, logprobs=2, extra_body=body)
        tokens, ids = out.choices[0].logprobs.tokens, out.choices[0].model_extra["token_ids"]
        assert all(k.startswith("token_id:") for top in out.choices[0].logprobs.top_logprobs for k in top)
    else:
        out = client.chat.completions.create(model="tiny", messages=chat("Hi"), max_tokens=4, logprobs=True,
                                             top_logprobs=2, extra_body=body)
        tokens = [lp.token for lp in out.choices[0].logprobs.content]
        ids = out.choices[0].model_extra["token_ids"]
    assert tokens == [f"token_id:{i}" for i in ids]


@pytest.mark.parametrize("include", [False, True])
def test_the_eos_that_ended_a_completion_is_not_in_its_text(client, include):
    """skip_special_tokens=False: the EOS that stopped the sequence is left out of the text, streamed or not, as
    vLLM does; include_stop_str_in_output keeps it. Its id is still among the output's ids."""
    from llmserve.testing.toy_tokenizer import EOS_TOKEN, SPECIAL_TOKENS

    eos = SPECIAL_TOKENS.index(EOS_TOKEN)
    body = {"skip_special_tokens": False, "min_tokens": 3, "return_token_ids": True,
            "include_stop_str_in_output": include}
    kwargs = dict(model="tiny", prompt="Hello", max_tokens=10, logit_bias={str(eos): 100}, **GREEDY)
    out = client.completions.create(**kwargs, extra_body=body).choices[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 4 and out.token_ids[-1] == eos
    assert out.text.endswith(EOS_TOKEN) == include
    chunks = list(client.completions.create(stream=True, **kwargs, extra_body=body))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.text
