"""`llmserve bench spec` end to end on the tiny model (one round, short outputs)."""

import pytest

from llmserve.bench.spec import SpecBenchConfig, run
from llmserve.config import EngineConfig, SpeculativeConfig
from llmserve.engine.llm import build_engine_config
from llmserve.testing.maker import make_model


def spec_config(model: str | None = None, dtype: str = "auto", quantization: str | None = None,
                **bench) -> SpecBenchConfig:
    """The benchmark's config with the engine flags it takes as `serve` does (model, dtype, quantization), and
    speculation at every level the tests run (the CPU's default cap is 1 in bf16 at k = 4)."""
    return SpecBenchConfig(engine=build_engine_config(model=model, dtype=dtype, quantization=quantization,
                                                      speculative_max_batch=8), **bench)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("tiny")), seed=2)


@pytest.mark.parametrize("one_engine_at_a_time", [False, True])
def test_spec_bench_reports_every_config_and_controls_acceptance(tiny, one_engine_at_a_time):
    """All engines alive and interleaved (CPU default), or built and freed one by one (CUDA default)."""
    cfg = spec_config(tiny, configs="none,self,oracle=0.0,oracle=1.0,ngram", concurrency="2",
                      requests_per_slot=1, prompt_len=32, output_len=12, draft_layers=1, rounds=1,
                      one_engine_at_a_time=one_engine_at_a_time)
    rows = run(cfg)["levels"]["2"]
    assert set(rows) == {"none", "self", "oracle=0.0", "oracle=1.0", "ngram"}
    assert rows["none"]["ratio_to_none"] == 1.0 and rows["none"]["acceptance_rate"] is None
    assert rows["self"]["acceptance_rate"] == 1.0 and rows["oracle=1.0"]["acceptance_rate"] == 1.0
    assert rows["oracle=0.0"]["acceptance_rate"] == 0.0
    assert all(r["output_tok_s"] > 0 and r["tpot_ms"] > 0 for r in rows.values())
    assert rows["none"]["decode_ratio_to_none"] == 1.0  # plain decoding's TPOT over itself


def test_oracle_reference_follows_the_speculative_engines_output(tiny, tmp_path):
    """A reference that is wrong from the first token (as a plain bf16 engine's may be after a rounding
    difference): the oracle continues it from the engine's own output, so oracle=1.0 still accepts all."""
    from llmserve import SamplingParams
    from llmserve.bench.spec import _build, _make_drafts, _workload

    path = tiny
    cfg = spec_config(path, configs="none,oracle=1.0", concurrency="2", prompt_len=32, output_len=16,
                      draft_layers=1)
    drafts = _make_drafts(cfg, path, ["oracle=1.0"], str(tmp_path))
    prompts = _workload(cfg, 512, 2, False)
    reference = {tuple(p): [3 + i for i in range(cfg.output_len)] for p in prompts}  # not the target's
    engines: dict = {}
    engines["none"] = _build(cfg, path, "none", drafts, reference, engines)
    llm, counter = engines["oracle=1.0"] = _build(cfg, path, "oracle=1.0", drafts, reference, engines)
    params = SamplingParams(temperature=0, max_tokens=cfg.output_len, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    assert counter.num_draft_tokens > 0 and counter.num_accepted == counter.num_draft_tokens
    assert llm.engine.runner.speculator.proposer.num_rebases >= len(prompts)
    assert got == [o.outputs[0].token_ids for o in engines["none"][0].generate(prompts, params)]


def test_ngram_on_a_copying_target_accepts_its_drafts():
    """`--copying` makes a target that continues the workload's repeated spans: prompt lookup's drafts hold."""
    cfg = SpecBenchConfig(shape="demo", copying=True, configs="none,ngram", concurrency="1", requests_per_slot=2,
                          prompt_len=64, output_len=24, rounds=1)
    rows = run(cfg)["levels"]["1"]
    assert rows["ngram"]["acceptance_rate"] > 0.9 and rows["ngram"]["mean_accepted_length"] > 4


def test_copying_needs_a_made_target():
    with pytest.raises(ValueError, match="--copying makes the target"):
        spec_config("/some/checkpoint", copying=True)


def test_quantized_target_in_every_configuration(tiny, tmp_path):
    """--quantization reaches plain decoding's target and the speculative ones' (the drafts stay float), and
    the oracle still controls acceptance on it."""
    from llmserve import SamplingParams
    from llmserve.bench.spec import _build, _make_drafts, _workload

    path = tiny
    cfg = spec_config(path, "float32", "int8", configs="none,oracle=1.0", concurrency="2", prompt_len=32,
                      output_len=12, draft_layers=1)
    drafts = _make_drafts(cfg, path, ["oracle=1.0"], str(tmp_path))
    engines: dict = {}
    engines["none"] = _build(cfg, path, "none", drafts, {}, engines)
    llm, counter = engines["oracle=1.0"] = _build(cfg, path, "oracle=1.0", drafts, {}, engines)
    assert engines["none"][0].engine.model_info.quantization == llm.engine.model_info.quantization == "int8"
    llm.generate(_workload(cfg, 512, 2, False), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    assert counter.num_draft_tokens > 0 and counter.num_accepted == counter.num_draft_tokens


def test_the_engine_flags_are_serves(tiny, capsys):
    """`bench spec` takes the engine's own flags (the model positional, the speculative flags for the
    speculating configurations) and refuses a bad value before making or loading anything."""
    from llmserve.cli import main

    assert main(["bench", "spec", tiny, "--dtype", "float32", "--configs", "none,ngram", "--concurrency", "1",
                 "--requests-per-slot", "1", "--prompt-len", "16", "--output-len", "4", "--rounds", "1",
                 "--num-speculative-tokens", "2", "--num-threads", "1"]) == 0
    assert "ngram" in capsys.readouterr().out
    for argv, flag in [(["--max-num-seqs", "0"], "max-num-seqs"), (["--speculative", "ngram"], "--configs"),
                       (["--configs", "none,bogus"], "bogus"), (["--num-speculative-tokens", "0"], "num-speculative")]:
        assert main(["bench", "spec", "/no/such/model", *argv]) == 2, argv
        assert flag in capsys.readouterr().err


def test_draft_flags_apply_to_the_draft_configurations_only():
    """--draft-vocab-size is the engine's draft-only flag: valid here, as the draft configurations take it."""
    from llmserve.bench.spec import configuration_engine

    cfg = SpecBenchConfig(engine=EngineConfig(speculative=SpeculativeConfig(draft_vocab_size=64)),
                          configs="none,self,ngram")
    cfg.validate()
    assert configuration_engine(cfg, "self", "m", "m").speculative.draft_vocab_size == 64
    assert configuration_engine(cfg, "ngram", "m", None).speculative.draft_vocab_size is None
    assert not configuration_engine(cfg, "none", "m", None).speculative.is_enabled
