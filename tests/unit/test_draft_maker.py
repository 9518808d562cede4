"""Drafts derived from a target checkpoint: first layers kept, relative noise, tokenizer shared."""

import json
import os

import pytest
from safetensors.torch import load_file

from llmserve.testing.draft_maker import derive_draft
from llmserve.testing.maker import make_model


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_model("qwen3", "tiny", str(tmp_path_factory.mktemp("target")), seed=4)


def test_first_layers_kept_exactly_without_noise(target, tmp_path):
    draft = derive_draft(target, str(tmp_path / "d"), num_layers=1)
    with open(os.path.join(draft, "config.json")) as f:
        assert json.load(f)["num_hidden_layers"] == 1
    want, got = load_file(os.path.join(target, "model.safetensors")), load_file(os.path.join(draft, "model.safetensors"))
    assert set(got) == {n for n in want if not n.startswith("model.layers.1.")}
    assert all(got[n].equal(want[n]) for n in got)
    assert os.path.exists(os.path.join(draft, "tokenizer.json"))


def test_noise_is_relative_and_seeded(target, tmp_path):
    a = load_file(os.path.join(derive_draft(target, str(tmp_path / "a"), noise=0.1, seed=1), "model.safetensors"))
    b = load_file(os.path.join(derive_draft(target, str(tmp_path / "b"), noise=0.1, seed=1), "model.safetensors"))
    want = load_file(os.path.join(target, "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    assert a[name].equal(b[name]) and not a[name].equal(want[name])
    ratio = float((a[name] - want[name]).std() / want[name].std())
    assert 0.08 < ratio < 0.12


def test_bad_arguments_are_rejected(target, tmp_path):
    with pytest.raises(ValueError, match="num_layers"):
        derive_draft(target, str(tmp_path / "x"), num_layers=3)
    with pytest.raises(ValueError, match="noise"):
        derive_draft(target, str(tmp_path / "y"), noise=-1.0)
