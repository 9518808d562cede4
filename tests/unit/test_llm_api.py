"""The offline API: outputs in order, stop strings, n > 1, seeds, logprobs, validation."""

import pytest

from llmserve import LLM, SamplingParams
from llmserve.testing.maker import make_model


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    path = make_model("llama", "tiny", str(tmp_path_factory.mktemp("api")), seed=5)
    return LLM(path, dtype="float32", max_model_len=128, num_kv_blocks=120)


def test_outputs_in_input_order_with_per_prompt_params(llm):
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (3, 1, 5)]
    outs = llm.generate([[5, 6, 7], [8, 9], "hello"], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [3, 1, 5]
    assert outs[2].prompt == "hello" and outs[0].prompt_token_ids == [5, 6, 7]
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)


def test_stop_string_is_matched_on_text_and_excluded(llm):
    greedy = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    full = llm.generate(["abc"], greedy)[0].outputs[0]
    text = full.text
    stop = text[5:8]
    assert stop and text.find(stop) == 5, "pick a stop string that first appears at char 5"
    out = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop]))
    c = out[0].outputs[0]
    assert c.text == text[:5] and c.finish_reason == "stop" and c.stop_reason == stop
    inc = llm.generate(["abc"], SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, stop=[stop],
                                               include_stop_str_in_output=True))[0].outputs[0]
    assert inc.text == text[:8]
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.scheduler.kv.pool.num_usable_blocks


def test_stop_token_id_reports_stop_reason(llm):
    full = llm.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    target = full.token_ids[4]
    first = full.token_ids.index(target)
    out = llm.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                stop_token_ids=[target]))[0].outputs[0]
    assert out.token_ids == full.token_ids[:first + 1]
    assert out.finish_reason == "stop" and out.stop_reason == target


def test_n_and_seed_reproducible_regardless_of_batch(llm):
    params = SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=123, ignore_eos=True)
    alone = llm.generate([[10, 11, 12]], params)[0]
    batched = llm.generate([[40, 41], [10, 11, 12], [7] * 30],
                           [SamplingParams(temperature=1.0, max_tokens=6), params, SamplingParams(max_tokens=9)])[1]
    assert [c.token_ids for c in alone.outputs] == [c.token_ids for c in batched.outputs]
    assert [c.index for c in alone.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in alone.outputs}) > 1, "the n samples should differ"
    other = llm.generate([[10, 11, 12]], SamplingParams(n=3, temperature=1.0, max_tokens=8, seed=124,
                                                        ignore_eos=True))[0]
    assert [c.token_ids for c in other.outputs] != [c.token_ids for c in alone.outputs]


def test_logprobs_top_k(llm):
    out = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=4, logprobs=3, ignore_eos=True))[0]
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for token, lp in zip(c.token_ids, c.logprobs):
        assert lp.token_id == token and lp.rank == 1  # greedy picks the most likely
        assert len(lp.top) == 3 and lp.top[0][0] == token
        assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]
        assert lp.logprob == pytest.approx(lp.top[0][1])


@pytest.mark.parametrize("kwargs", [dict(temperature=-1), dict(top_p=0), dict(n=0), dict(logprobs=21),
                                    dict(max_tokens=0), dict(top_k=-2), dict(min_p=2.0)])
def test_bad_params_raise_value_error(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_context_and_vocab_checks(llm):
    with pytest.raises(ValueError, match="maximum context length is 128"):
        llm.generate([[1] * 100], SamplingParams(max_tokens=50))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        llm.generate([[10**6]], SamplingParams(max_tokens=1))
    with pytest.raises(ValueError, match="empty"):
        llm.generate([""], SamplingParams(max_tokens=1))


def test_max_tokens_none_runs_to_the_context_length(llm):
    out = llm.generate([[1] * 120], SamplingParams(temperature=0, max_tokens=None, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].finish_reason == "length"


def test_unset_token_budget_is_the_devices_default(llm):
    expected = 512 if llm.engine.device.type == "cpu" else 2048
    assert llm.engine.config.scheduler.max_num_batched_tokens == expected
    assert llm.engine.scheduler.config.max_num_batched_tokens == expected


def _engine_outputs(llm, requests, abort_after_steps: int | None = None) -> dict[str, list]:
    """Every engine output per request id, stepping the core until all end (aborting all after N steps)."""
    for request in requests:
        llm.engine.add_request(request)
    seen: dict[str, list] = {r.request_id: [] for r in requests}
    num_steps = 0
    while llm.engine.has_unfinished_requests():
        for out in llm.engine.step().outputs:
            seen[out.request_id].append(out)
        num_steps += 1
        if num_steps == abort_after_steps:
            llm.engine.abort_requests(list(seen))
    return seen


def test_final_only_request_gets_one_output_with_all_its_ids_and_times(llm):
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    every = llm.processor.process("every", [5, 6, 7, 8], params)
    final = llm.processor.process("final", [5, 6, 7, 8], params, is_final_only=True)
    seen = _engine_outputs(llm, every + final)
    assert len(seen["every"]) == 7 and len(seen["final"]) == 1
    (last,) = seen["final"]
    assert last.new_token_ids == [t for o in seen["every"] for t in o.new_token_ids]
    assert last.finish_reason is not None and last.first_token_time is not None and last.scheduled_time is not None
    llm.engine.check_integrity()


def test_aborted_final_only_request_reports_the_ids_it_had(llm):
    params = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    every = llm.processor.process("every2", [9, 10, 11], params)
    final = llm.processor.process("final2", [9, 10, 11], params, is_final_only=True)
    seen = _engine_outputs(llm, every + final, abort_after_steps=4)
    ids_every = [t for o in seen["every2"] for t in o.new_token_ids]
    assert len(ids_every) == 4 and seen["every2"][-1].finish_reason is not None
    (last,) = seen["final2"]
    assert last.new_token_ids == ids_every and str(last.finish_reason) == str(seen["every2"][-1].finish_reason)
    assert llm.engine.num_free_blocks() == llm.engine.scheduler.kv.pool.num_usable_blocks


def test_offline_requests_are_final_only_unless_their_tokens_are_read_as_they_come(llm):
    from llmserve.engine.output_processor import reads_final_only

    assert reads_final_only(SamplingParams(max_tokens=3), collector=None, is_delta=False)
    assert not reads_final_only(SamplingParams(max_tokens=3, stop=["x"]), collector=None, is_delta=False)
    assert not reads_final_only(SamplingParams(max_tokens=3, logprobs=1), collector=None, is_delta=False)
    assert not reads_final_only(SamplingParams(max_tokens=3, prompt_logprobs=0), collector=None, is_delta=False)
    assert not reads_final_only(SamplingParams(max_tokens=3), collector=None, is_delta=True)


def test_chat_renders_the_template_then_generates_its_tokens(llm):
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    conversation = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = llm.chat(conversation, greedy)
    assert len(out) == 1
    text = "<|im_start|>system\nbe brief<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    token_ids = llm.get_tokenizer().encode(text, add_special_tokens=False)
    assert out[0].prompt == text and out[0].prompt_token_ids == token_ids
    assert out[0].outputs[0].token_ids == llm.generate([token_ids], greedy)[0].outputs[0].token_ids
    both = llm.chat([conversation, [{"role": "user", "content": "again"}]], greedy)
    assert [o.prompt_token_ids for o in both][0] == token_ids and len(both) == 2


def test_chat_takes_a_template_of_its_own(llm):
    out = llm.chat([{"role": "user", "content": "hi"}], SamplingParams(max_tokens=1),
                   chat_template="{% for m in messages %}{{ m['content'] }}!{% endfor %}")
    assert out[0].prompt == "hi!"


@pytest.mark.parametrize("stop", [None, ["never-in-the-output"]])  # text decoded once at the end / token by token
def test_the_eos_that_ended_a_sequence_is_not_in_its_text(llm, stop):
    """skip_special_tokens=False shows special tokens the model wrote, but not the EOS that stopped it (vLLM's
    rule: a stop token's text is left out unless include_stop_str_in_output); its id stays in token_ids."""
    tokenizer = llm.tokenizer
    eos = tokenizer.eos_token_id
    params = dict(temperature=0, max_tokens=10, min_tokens=3, logit_bias={eos: 100.0}, skip_special_tokens=False,
                  stop=stop)
    out = llm.generate([[3, 4]], SamplingParams(**params))[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 4 and out.token_ids[-1] == eos
    assert out.text == tokenizer.decode(out.token_ids[:3], skip_special_tokens=False)
    assert tokenizer.eos_token not in out.text
    kept = llm.generate([[3, 4]], SamplingParams(**params, include_stop_str_in_output=True))[0].outputs[0]
    assert kept.text == out.text + tokenizer.eos_token


def test_a_stop_token_ids_text_is_left_out_unless_asked_for(llm):
    full = llm.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))[0].outputs[0]
    target = full.token_ids[4]
    first = full.token_ids.index(target)
    for include in (False, True):
        out = llm.generate([[3, 4]], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True,
                                                    stop_token_ids=[target], include_stop_str_in_output=include))
        kept = out[0].outputs[0].token_ids
        assert kept == full.token_ids[:first + 1]
        assert out[0].outputs[0].text == llm.tokenizer.decode(kept if include else kept[:-1], skip_special_tokens=True)
