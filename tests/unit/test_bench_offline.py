"""`llmserve bench offline` on the tiny model: the workload runs to its exact token count, greedy or with
the checkpoint's sampling defaults (what the server applies to requests that set none)."""

from __future__ import annotations

import os

import pytest
import torch

from llmserve.bench.offline import OfflineBenchConfig, _sampling_params, make_workload, run
from llmserve.engine.llm import build_engine_config
from llmserve.testing.maker import make_model


def bench(model: str, num_threads: int | None = None, **workload) -> OfflineBenchConfig:
    return OfflineBenchConfig(engine=build_engine_config(model=model, num_threads=num_threads), **workload)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("tiny")), seed=0)


@pytest.mark.parametrize("sampling", ["greedy", "model"])
def test_offline_bench_runs_the_workload(tiny, sampling):
    cfg = bench(tiny, num_requests=6, prompt_len="4-20", output_len="3-9", sampling=sampling)
    results = run(cfg)
    expected = sum(n for _, n in make_workload(cfg, 512))
    assert results["engine"]["num_output_tokens"] == expected
    assert results["engine"]["output_tok_s"] > 0


def test_model_sampling_takes_the_generation_config(tiny):
    from llmserve import LLM

    llm = LLM(tiny, max_model_len=64, num_kv_blocks=16)
    greedy, model = _sampling_params(llm, "greedy", 5), _sampling_params(llm, "model", 5)
    defaults = llm.get_default_sampling_params()
    assert greedy.temperature == 0 and model.max_tokens == 5 and model.ignore_eos
    assert model.temperature > 0
    assert (model.temperature, model.top_p, model.top_k, model.repetition_penalty) == \
        (defaults.temperature, defaults.top_p, defaults.top_k, defaults.repetition_penalty)


def test_profile_writes_the_engine_step_functions(tiny, tmp_path):
    path = tmp_path / "profile.txt"
    run(bench(tiny, num_requests=4, prompt_len="4-8", output_len="3-5", profile=str(path)))
    text = path.read_text()
    assert "cumulative" in text and all(f"({name})" in text for name in ("step", "schedule", "execute", "update_from_output"))


@pytest.mark.parametrize("is_quiet", [False, True])
def test_progress_on_stderr_unless_quiet(tiny, capsys, is_quiet):
    run(bench(tiny, num_requests=3, prompt_len="4-8", output_len="3-5", num_threads=1,
                           quiet=is_quiet))
    captured = capsys.readouterr()
    assert "tok/s" in captured.out  # the results, either way
    has_progress = "bench offline: loading the engine, then 3 requests" in captured.err and "3/3" in captured.err
    assert has_progress is not is_quiet, captured.err


@pytest.mark.skipif(torch.cuda.is_available(), reason="the engine runs on CUDA there: threads are left alone")
def test_threads_follow_the_free_cpus_unless_asked(tiny, capsys, monkeypatch):
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    results = run(bench(tiny, num_requests=2, prompt_len="4-8", output_len="3-5"))
    err = capsys.readouterr().err
    assert "CPUs free at start-up (--num-threads to choose)" in err, err
    assert 1 <= results["engine"]["num_threads"] <= len(os.sched_getaffinity(0))
    asked = run(bench(tiny, num_requests=2, prompt_len="4-8", output_len="3-5", num_threads=1))
    assert asked["engine"]["num_threads"] == 1 and "CPUs free" not in capsys.readouterr().err


def test_plot_draws_the_run_as_bench_serve_does(tiny, tmp_path, capsys):
    results = run(bench(tiny, num_requests=4, prompt_len="4-8", output_len="3-5", num_threads=1,
                                     quiet=True, baseline="hf", baseline_batch_size=2, plot=str(tmp_path / "plots")))
    requests = results["engine"]["requests"]
    assert [r["num_output_tokens"] for r in requests] == [n for _, n in make_workload(bench(tiny, num_requests=4, prompt_len="4-8", output_len="3-5"), 512)]
    assert all(0 < r["ttft_s"] <= r["e2e_s"] <= results["engine"]["elapsed_s"] for r in requests)
    names = sorted(p.name for p in (tmp_path / "plots").iterdir())
    assert names == ["e2e_cdf.png", "throughput.png", "ttft_cdf.png", "ttft_vs_load.png"]  # no ITL in-process
    assert all((tmp_path / "plots" / n).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for n in names)
    assert "plots: " in capsys.readouterr().out


def test_the_plotted_result_has_both_engines_throughput(tiny):
    from llmserve.bench.offline_plots import ENGINE_LABEL, HF_LABEL, offline_bench_result

    requests = [{"prompt_len": 5, "num_output_tokens": 10, "ttft_s": 0.1, "e2e_s": 0.5},
                {"prompt_len": 7, "num_output_tokens": 30, "ttft_s": 0.2, "e2e_s": 1.5}]
    results = {"config": {}, "model_path": tiny, "engine": {"elapsed_s": 2.0, "requests": requests},
               "hf": {"elapsed_s": 8.0}}
    result = offline_bench_result(results)
    level = result.levels[0]
    assert level.name == "c=2" and [t.label for t in result.servers] == [ENGINE_LABEL, HF_LABEL]
    engine, hf = result.run(ENGINE_LABEL, level).metrics, result.run(HF_LABEL, level).metrics
    assert (engine.output_throughput, hf.output_throughput) == (20.0, 5.0)
    assert engine.ttft_ms.median == pytest.approx(150.0) and hf.ttft_ms is None


def test_the_engine_flags_are_serves(tiny, capsys):
    """`bench offline` takes the engine's own flags (the model positional, vLLM's names, float16 among the
    dtypes) and refuses a bad value before loading anything."""
    from llmserve.cli import main

    assert main(["bench", "offline", tiny, "--dtype", "float32", "--enable-prefix-caching", "--num-requests", "2",
                 "--prompt-len", "4-8", "--output-len", "3", "--quiet", "--num-threads", "1"]) == 0
    assert "tok/s" in capsys.readouterr().out
    assert main(["bench", "offline", tiny, "--max-num-seqs", "0"]) == 2
    assert "max-num-seqs" in capsys.readouterr().err
