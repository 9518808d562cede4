"""Speculative decoding behind the real server: the openai client gets the same greedy text with and
without it (per-request opt-out), and /metrics counts drafts and acceptances."""

from __future__ import annotations

import httpx
import openai
import pytest

from llmserve.testing.servers import metric_value, start_tiny_server

REPEATING = "the cat sat on the mat and the cat sat on the mat and the cat sat on the"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    server = start_tiny_server(str(tmp_path_factory.mktemp("model")), "--speculative", "ngram",
                               "--no-speculative-dynamic", "--num-speculative-tokens", "3")
    yield server
    assert server.stop() == 0


def test_greedy_text_same_with_opt_out_and_metrics_count_drafts(server):
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    # Plain argmax: the checkpoint's default repetition penalty brings near-ties that verification's
    # batch shape (k + 1 rows) may flip by rounding; without it the greedy tokens agree exactly.
    body = {"model": client.models.list().data[0].id, "prompt": REPEATING, "max_tokens": 48,
            "temperature": 0.0}
    plain = client.completions.create(**body, extra_body={"ignore_eos": True, "speculative": False,
                                                          "repetition_penalty": 1.0})
    before = httpx.get(f"{server.url}/metrics").text
    assert metric_value(before, "llmserve:spec_decode_num_draft_tokens_total") == 0
    spec = client.completions.create(**body, extra_body={"ignore_eos": True, "repetition_penalty": 1.0})
    stream = client.completions.create(**body, extra_body={"ignore_eos": True, "repetition_penalty": 1.0},
                                       stream=True)
    streamed = "".join(chunk.choices[0].text for chunk in stream)
    assert spec.choices[0].text == plain.choices[0].text == streamed
    assert spec.usage.completion_tokens == 48
    metrics = httpx.get(f"{server.url}/metrics").text
    num_draft_tokens = metric_value(metrics, "llmserve:spec_decode_num_draft_tokens_total")
    num_accepted = metric_value(metrics, "llmserve:spec_decode_num_accepted_tokens_total")
    assert num_draft_tokens > 0 and 0 < num_accepted <= num_draft_tokens
    assert metric_value(metrics, "llmserve:spec_decode_num_accepted_tokens_per_pos_total") == num_accepted
    assert metric_value(metrics, "llmserve:spec_decode_acceptance_rate") == pytest.approx(
        num_accepted / num_draft_tokens)
    assert metric_value(metrics, "llmserve:generation_tokens_total") == 3 * 48
