"""The engine with --tensor-parallel-size 2 on CPU (2 gloo ranks): the same greedy tokens as one rank for
each architecture, batching invariance under chunked prefill and preemption, a grammar and penalties on
rank 0, a dead rank failing the engine at once, and the combinations refused at start-up."""

import multiprocessing.connection
import random
import time

import pytest

from llmserve import LLM, SamplingParams
from llmserve.testing.maker import make_model
from llmserve.sampling_params import StructuredOutputsParams
from llmserve.worker.tp_executor import WorkerDied

ENGINE = dict(dtype="float32", max_model_len=256, max_num_batched_tokens=64)


def _prompts(num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 500) for _ in range(rng.randint(1, 90))] for _ in range(num)]


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


def _check_idle(llm: LLM) -> None:
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.scheduler.kv.pool.num_usable_blocks


@pytest.mark.parametrize("arch", ["llama", "mistral", "qwen2", "qwen3", "qwen3_moe:tiny-moe", "phi3",
                                  "deepseek_v3:tiny-deepseek-v3"])
def test_two_ranks_give_one_rank_greedy_tokens(arch, tmp_path):
    arch, _, shape = arch.partition(":")
    path = make_model(arch, shape or "tiny", str(tmp_path), seed=1)
    prompts = _prompts(6, seed=0)  # mixed lengths, chunked under the 64-token budget
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    expected = _tokens(LLM(path, num_kv_blocks=200, **ENGINE), prompts, params)
    with LLM(path, num_kv_blocks=200, tensor_parallel_size=2, **ENGINE) as llm:
        assert _tokens(llm, prompts, params) == expected
        logprobs = llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=3, logprobs=2, prompt_logprobs=1))
        assert all(len(o.outputs[0].logprobs) == 3 for o in logprobs)  # rank 0's, reported once
        sampled = llm.generate(prompts[:3], SamplingParams(temperature=1.0, seed=7, max_tokens=8, ignore_eos=True))
        assert [len(o.outputs[0].token_ids) for o in sampled] == [8] * 3
        _check_idle(llm)


@pytest.fixture(scope="module")
def one_rank_moe(tmp_path_factory):
    """arch -> (checkpoint, prompts, params, one rank's greedy tokens), made once an arch for both all2all
    backends."""
    made = {}

    def case(arch: str):
        if arch not in made:
            name, _, shape = arch.partition(":")
            path = make_model(name, shape or "tiny-moe", str(tmp_path_factory.mktemp("tp-moe")), seed=1)
            prompts = _prompts(6, seed=1)
            params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
            made[arch] = (path, prompts, params, _tokens(LLM(path, num_kv_blocks=200, **ENGINE), prompts, params))
        return made[arch]

    return case


@pytest.mark.parametrize("arch, all2all_backend", [("qwen3_moe", "allgather_reducescatter"),
                                                     ("mixtral", "allgather_reducescatter"),
                                                     ("deepseek_v3:tiny-deepseek-v3", "allgather_reducescatter"),
                                                     ("qwen3_moe", "all2allv"),
                                                     ("deepseek_v3:tiny-deepseek-v3", "all2allv")])
def test_two_ranks_holding_whole_experts_give_one_rank_greedy_tokens(arch, all2all_backend, one_rank_moe):
    """--enable-expert-parallel: each rank runs 4 of the 8 experts; the engine reports rank 0's expert load.
    DeepSeek-V3: grouped sigmoid routing with the correction bias, shared experts split by features, a dense
    first layer, latent attention's heads split. all2allv: rows dispatched to the experts' ranks and back."""
    path, prompts, params, expected = one_rank_moe(arch)
    with LLM(path, num_kv_blocks=200, tensor_parallel_size=2, enable_expert_parallel=True,
             all2all_backend=all2all_backend, **ENGINE) as llm:
        blocks = llm.engine.runner.model.moe_blocks()
        assert {block.experts.gate_up_proj.shape[0] for block in blocks} == {4}
        assert {block.is_all_to_all for block in blocks} == {all2all_backend == "all2allv"}
        assert _tokens(llm, prompts, params) == expected
        _check_idle(llm)


@pytest.fixture(scope="module")
def invariance_case(tmp_path_factory):
    """16 mixed-length requests and each one's greedy output when served alone by one rank."""
    path = make_model("llama", "tiny", str(tmp_path_factory.mktemp("tp-inv")), seed=2)
    prompts = _prompts(16, seed=3)
    params = [SamplingParams(temperature=0, max_tokens=random.Random(i).randint(4, 24), ignore_eos=True)
              for i in range(16)]
    llm = LLM(path, num_kv_blocks=400, enable_prefix_caching=False, **ENGINE)
    alone = [_tokens(llm, [p], [sp])[0] for p, sp in zip(prompts, params)]
    return path, prompts, params, alone


@pytest.mark.parametrize("num_kv_blocks, async_scheduling", [(400, True), (24, False)])
def test_batching_invariance_with_and_without_preemption(invariance_case, num_kv_blocks, async_scheduling):
    path, prompts, params, alone = invariance_case
    with LLM(path, num_kv_blocks=num_kv_blocks, async_scheduling=async_scheduling, tensor_parallel_size=2,
             **ENGINE) as llm:
        assert _tokens(llm, prompts, params) == alone
        if num_kv_blocks == 24:
            assert llm.num_preemptions > 0, "the small pool was meant to force preemption"
        _check_idle(llm)


@pytest.fixture(scope="module")
def llama_on_two_ranks(tmp_path_factory):
    """(checkpoint, its engine on 2 ranks) shared by the grammar test and the dead-rank test, which is the last
    to use it (it kills rank 1): an engine on 2 ranks costs a spawned rank's torch import to start."""
    path = make_model("llama", "tiny", str(tmp_path_factory.mktemp("tp-llama")), seed=1)
    with LLM(path, num_kv_blocks=100, tensor_parallel_size=2, **ENGINE) as llm:
        yield path, llm


def test_grammar_and_penalties_stay_on_rank_0(llama_on_two_ranks):
    """The grammar's bitmask and the penalties act on rank 0's logits; the other rank follows its ids."""
    path, llm = llama_on_two_ranks
    prompts = _prompts(3, seed=5)
    choice = StructuredOutputsParams(choice=["yes", "no"])
    params = [SamplingParams(temperature=0, max_tokens=8, structured_outputs=choice),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, repetition_penalty=1.3,
                             presence_penalty=0.5),
              SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)]
    expected = [o.outputs[0] for o in LLM(path, num_kv_blocks=100, **ENGINE).generate(prompts, params)]
    got = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert got[0].text in ("yes", "no")
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    _check_idle(llm)


def test_a_dead_rank_fails_the_next_step_at_once(llama_on_two_ranks):
    _, llm = llama_on_two_ranks
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    llm.generate([[5, 6, 7]], params)
    rank1 = llm.engine.tp_executor.procs[0]
    rank1.kill()
    # The executor's monitor thread reaps the rank; joining it here too would race that waitpid.
    assert multiprocessing.connection.wait([rank1.sentinel], 10) == [rank1.sentinel]
    start = time.monotonic()
    with pytest.raises(WorkerDied, match=r"tensor-parallel rank 1 \(pid \d+\) exited with code -9"):
        llm.generate([[5, 6, 7]], params)
    assert time.monotonic() - start < 5


def test_unsupported_combinations_are_refused_before_any_rank_starts(tmp_path):
    path = make_model("llama", "tiny", str(tmp_path), seed=1)  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="cannot split 4 attention heads over 2 KV heads"):
        LLM(path, tensor_parallel_size=3, **ENGINE)
    with pytest.raises(ValueError, match="speculative decoding .* not supported with tensor parallelism"):
        LLM(path, tensor_parallel_size=2, speculative="ngram", **ENGINE)


@pytest.mark.parametrize("main_file, is_hidden", [("<stdin>", True), (__file__, False)])
def test_a_main_module_without_a_file_is_hidden_while_ranks_start(monkeypatch, main_file, is_hidden):
    """From `python -` a spawned rank would try to run '<stdin>' as a file and die; a real file stays."""
    import sys
    import types

    from llmserve.worker.tp_executor import hide_missing_main_file

    main = types.ModuleType("__main__")
    main.__file__ = main_file
    monkeypatch.setitem(sys.modules, "__main__", main)
    with hide_missing_main_file():
        assert hasattr(main, "__file__") is not is_hidden
    assert main.__file__ == main_file
