"""The `llmserve` command line: --version, and config errors as argparse-style errors (exit 2)."""

from __future__ import annotations

import pytest

from llmserve import __version__
from llmserve.cli import main


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == f"llmserve {__version__}"


@pytest.mark.parametrize("flags, flag", [
    (["--max-num-seqs", "0"], "--max-num-seqs"),
    (["--block-size", "0"], "--block-size"),
    (["--gpu-memory-utilization", "0"], "--gpu-memory-utilization"),
    (["--ngram-min", "3", "--ngram-max", "2"], "--ngram-max"),
    (["--max-model-len", "64", "--num-gpu-blocks-override", "4", "--block-size", "16"], "--num-gpu-blocks-override"),
    (["--max-model-len", "64", "--num-kv-blocks", "4", "--block-size", "16"], "--num-gpu-blocks-override"),  # alias
    (["--port", "70000"], "--port"),
    (["--max-body-size", "huge"], "--max-body-size"),
])
def test_serve_rejects_a_bad_value_before_starting(monkeypatch, capsys, flags, flag):
    def must_not_run(*args):
        raise AssertionError("the server started with a bad config")

    monkeypatch.setattr("llmserve.server.launcher.run", must_not_run)
    assert main(["serve", *flags]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"llmserve serve: error: {flag}:"), err


def test_route_rejects_a_bad_autoscale_value(capsys):
    assert main(["route", "--backend", "m=http://127.0.0.1:1", "--min-replicas", "3", "--max-replicas", "2"]) == 2
    assert "--max-replicas:" in capsys.readouterr().err


def test_serve_with_zero_max_num_seqs_exits_2_at_once_without_a_traceback():
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-m", "llmserve.cli", "serve", "--max-num-seqs", "0", "--port", "0"],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "--max-num-seqs: must be >= 1, got 0" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_generate_honours_every_engine_flag(tmp_path, monkeypatch, capsys):
    """`llmserve generate` builds its engine from all of the engine's flags (speculation included), not a few."""
    from llmserve.engine import llm as llm_module
    from llmserve.testing.maker import make_model

    path = make_model("llama", "tiny", str(tmp_path / "tiny"), seed=0)
    built, build = [], llm_module.build_engine_config
    monkeypatch.setattr(llm_module, "build_engine_config", lambda **kwargs: built.append(build(**kwargs)) or built[-1])
    assert main(["generate", "--model", path, "--speculative", "ngram", "--num-speculative-tokens", "3",
                 "--num-kv-blocks", "64", "--max-model-len", "128", "--prompt", "a b a b", "--max-tokens", "4"]) == 0
    (config,) = built
    assert (config.speculative.speculative, config.speculative.num_speculative_tokens) == ("ngram", 3)
    assert (config.cache.num_kv_blocks, config.model.max_model_len) == (64, 128)
    assert "'a b a b' -> " in capsys.readouterr().out


@pytest.mark.parametrize("argv", [["--version"], ["--help"], ["serve", "--help"], ["bench", "offline", "--help"]])
def test_version_and_help_do_not_import_torch(argv):
    import subprocess
    import sys

    code = ("import sys\nfrom llmserve.cli import main\ntry:\n    main(sys.argv[1:])\nexcept SystemExit:\n    pass\n"
            "sys.exit(3 if 'torch' in sys.modules else 0)")
    proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout


def test_a_flag_error_is_one_line_naming_the_flag(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--dtype", "float64"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "usage:" not in err
    assert err.startswith("llmserve serve: error: --dtype: invalid choice: 'float64'") and "--help" in err


def test_make_serve_passes_args_to_llmserve_serve():
    """`make serve ARGS="..."` (what `make -n` would run: the install step first when .venv is missing)."""
    import pathlib
    import shutil
    import subprocess

    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    root = pathlib.Path(__file__).resolve().parents[2]
    proc = subprocess.run(["make", "-n", "--no-print-directory", "-C", str(root), "serve",
                           "ARGS=--port 8001 --max-num-seqs 4"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.splitlines()[-1] == ".venv/bin/llmserve serve --port 8001 --max-num-seqs 4"


def test_vllms_flag_names_and_the_positional_model_parse_as_the_former_ones():
    """vLLM's names where they mean the same (the former names still accepted), and `llmserve serve MODEL`."""
    from llmserve.cli import build_parser
    from llmserve.config import engine_config_from_args

    parser = build_parser()
    new = engine_config_from_args(parser.parse_args([
        "serve", "some/model", "--enable-prefix-caching", "--scheduling-policy", "priority",
        "--kv-cache-memory-bytes", "1GiB", "--num-gpu-blocks-override", "64", "--max-cudagraph-capture-size", "8"]))
    old = engine_config_from_args(parser.parse_args([
        "serve", "--model", "some/model", "--prefix-caching", "--policy", "priority", "--kv-cache-memory", "1GiB",
        "--num-kv-blocks", "64", "--max-graph-batch", "8"]))
    assert new == old and new.model.model == "some/model" and new.scheduler.policy == "priority"
    no_prefix = engine_config_from_args(parser.parse_args(["serve", "--no-enable-prefix-caching"]))
    assert not no_prefix.cache.enable_prefix_caching
    with pytest.raises(ValueError, match="--model: the model is given twice"):
        engine_config_from_args(parser.parse_args(["serve", "a/model", "--model", "b/model"]))



@pytest.mark.parametrize("json_config, flags", [
    ('{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 5, "prompt_lookup_min": 2}',
     ["--speculative", "ngram", "--num-speculative-tokens", "3", "--ngram-max", "5", "--ngram-min", "2"]),
    ('{"model": "/d", "num_speculative_tokens": 2, "disable_by_batch_size": 4}',
     ["--speculative", "draft", "--draft-model", "/d", "--num-speculative-tokens", "2",
      "--speculative-max-batch", "4"]),
])
def test_a_speculative_config_json_is_the_flags_it_names(json_config, flags):
    from llmserve.cli import build_parser
    from llmserve.config import engine_config_from_args

    parser = build_parser()
    from_json = engine_config_from_args(parser.parse_args(["serve", "--speculative-config", json_config]))
    assert from_json == engine_config_from_args(parser.parse_args(["serve", *flags]))


@pytest.mark.parametrize("argv, message", [
    (["--speculative-config", '{"method": "medusa", "model": "/d"}'], "method 'medusa' is not supported"),
    (["--speculative-config", '{"method": "ngram", "prompt_lookup_maxx": 3}'], "unsupported key 'prompt_lookup_maxx'"),
    (["--speculative-config", '{"method": "ngram"}', "--speculative", "draft"], "also given by its own flag"),
    (["--speculative-config", "[1]"], "must be a JSON object"),
])
def test_a_bad_speculative_config_is_refused_naming_what(argv, message):
    from llmserve.cli import build_parser
    from llmserve.config import engine_config_from_args

    with pytest.raises(ValueError, match=f"--speculative-config: .*{message}"):
        engine_config_from_args(build_parser().parse_args(["serve", *argv]))
