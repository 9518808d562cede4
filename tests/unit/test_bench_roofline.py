"""`llmserve bench roofline` from the command line on the tiny model: the engine's own flags, checked first; the
KV cache's bytes a token it reports for a latent (MLA) cache."""

import pytest

from llmserve.model import cpu_kernels
from llmserve.testing.maker import make_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_model("llama", "tiny", str(tmp_path_factory.mktemp("tiny")), seed=0)


def test_the_engine_flags_are_serves(tiny, capsys):
    from llmserve.cli import main

    assert main(["bench", "roofline", tiny, "--dtype", "float32", "--enable-prefix-caching", "--prompt-len", "8",
                 "--output-len", "4", "--repeats", "1", "--copy-mib", "1", "--num-threads", "1"]) == 0
    assert "batch-1 decode" in capsys.readouterr().out


@pytest.mark.parametrize("argv, flag", [(["--max-num-seqs", "0"], "max-num-seqs"),
                                        (["--output-len", "1"], "--output-len"),
                                        (["--max-model-len", "16", "--prompt-len", "16"], "--max-model-len")])
def test_a_bad_flag_is_refused_before_a_model_is_loaded(argv, flag, capsys):
    from llmserve.cli import main

    assert main(["bench", "roofline", "/no/such/model", *argv]) == 2
    assert flag in capsys.readouterr().err


@pytest.mark.parametrize(("kv_cache_dtype", "bytes_a_token"), [("auto", (32 + 8) * 3 * 4), ("int8", (32 + 8 + 4) * 3)])
def test_a_latent_cache_reports_its_bytes_a_token(kv_cache_dtype, bytes_a_token, capsys, caplog):
    """MLA (tiny-deepseek-v3: kv_lora_rank 32, qk_rope_head_dim 8, 3 layers): (L + R) x layers x dtype size, plus
    an int8 cache's scale a layer, in `bench roofline`'s line and in the engine's start-up line."""
    import logging

    from llmserve.cli import main

    if kv_cache_dtype == "int8" and not cpu_kernels.has_avx2_kernels():
        pytest.skip("--kv-cache-dtype int8 runs with the C++ kernels' AVX2 build")
    with caplog.at_level(logging.INFO, logger="llmserve.engine.engine_core"):
        assert main(["bench", "roofline", "--arch", "deepseek_v3", "--shape", "tiny-deepseek-v3", "--dtype", "float32",
                     "--device", "cpu", "--kv-cache-dtype", kv_cache_dtype, "--prompt-len", "8", "--output-len", "4",
                     "--repeats", "1", "--copy-mib", "1", "--num-threads", "1"]) == 0
    assert f"KV cache {bytes_a_token:,} bytes a token" in capsys.readouterr().out
    ready = [r.getMessage() for r in caplog.records if r.getMessage().startswith("engine ready:")]
    assert len(ready) == 1 and f" tokens, {bytes_a_token:,} bytes a token, " in ready[0]
