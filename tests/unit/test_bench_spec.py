"""`llmserve bench spec` end to end on the tiny model (one round, short outputs)."""

import pytest

from llmserve.bench.spec import SpecBenchConfig, run
from llmserve.model.maker import make_model


@pytest.mark.parametrize("one_engine_at_a_time", [False, True])
def test_spec_bench_reports_every_config_and_controls_acceptance(tmp_path, one_engine_at_a_time):
    """All engines alive and interleaved (CPU default), or built and freed one by one (CUDA default)."""
    path = make_model("llama", "tiny", str(tmp_path / "m"), seed=2)
    cfg = SpecBenchConfig(model=path, configs="none,self,oracle=0.0,oracle=1.0,ngram", concurrency="2",
                          requests_per_slot=1, prompt_len=32, output_len=12, draft_layers=1, rounds=1,
                          speculative_dynamic=False, one_engine_at_a_time=one_engine_at_a_time)
    rows = run(cfg)["levels"]["2"]
    assert set(rows) == {"none", "self", "oracle=0.0", "oracle=1.0", "ngram"}
    assert rows["none"]["ratio_to_none"] == 1.0 and rows["none"]["acceptance_rate"] is None
    assert rows["self"]["acceptance_rate"] == 1.0 and rows["oracle=1.0"]["acceptance_rate"] == 1.0
    assert rows["oracle=0.0"]["acceptance_rate"] == 0.0
    assert all(r["output_tok_s"] > 0 for r in rows.values())
