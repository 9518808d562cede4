"""`llmserve bench roofline` from the command line on the tiny model: the engine's own flags, checked first."""

import pytest

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
