"""The transformers generate() baseline: static batches, fixed output lengths, on the tiny random model."""

import pytest

from llmserve.bench.hf_baseline import run_hf_baseline


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from llmserve.testing.maker import make_model

    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("tiny")))


def test_static_batches(tiny):
    requests = [([5, 6, 7], 4), ([8] * 9, 2), ([9, 10], 3)]
    result = run_hf_baseline(tiny, requests, batch_size=2, device="cpu", is_warmup=False)
    assert (result.num_requests, result.num_batches) == (3, 2)
    assert (result.num_prompt_tokens, result.num_output_tokens) == (14, 9)
    assert result.num_generated_tokens == 2 * 4 + 1 * 3  # each batch runs to its longest output
    assert result.output_throughput == pytest.approx(9 / result.elapsed_s)


def test_auto_runs_the_engines_dtype(tiny):
    """A comparison runs one dtype on both sides: auto is the engine's choice (bf16 on AVX512-BF16/AMX CPUs)."""
    from llmserve.model.loader import resolve_dtype

    result = run_hf_baseline(tiny, [([5, 6], 2)], batch_size=1, device="cpu", is_warmup=False)
    assert result.dtype == str(resolve_dtype("auto", "cpu")).removeprefix("torch.")
    result = run_hf_baseline(tiny, [([5, 6], 2)], batch_size=1, device="cpu", dtype="float32", is_warmup=False)
    assert result.dtype == "float32"


def test_bad_input(tiny):
    with pytest.raises(ValueError, match="batch_size"):
        run_hf_baseline(tiny, [([1], 1)], batch_size=0)
    with pytest.raises(ValueError, match="request 0"):
        run_hf_baseline(tiny, [([], 1)])
