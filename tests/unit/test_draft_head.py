"""The draft's head over a reduced vocabulary (spec/draft_head.py), against the model's own logits."""

from __future__ import annotations

import pytest
import torch

from llmserve.model.loader import load_model
from llmserve.model.maker import make_model
from llmserve.spec.draft_head import DraftHead, read_token_map


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """The demo shape: 2,048 ids x 256 wide, its own lm_head (packed into panels at load on AVX2 CPUs)."""
    path = make_model("llama", "demo", str(tmp_path_factory.mktemp("demo")), seed=4)
    return load_model(path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("num_kept", [1000, 2048])
def test_kept_logits_are_the_models_and_the_rest_minus_infinity(model, num_kept):
    head = DraftHead(model, num_kept)
    assert head.is_packed  # the path the CPU takes for real drafts (1,000: the last panel part-used)
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    full = model.compute_logits(hidden)  # [5, V]
    got = head.logits(hidden)
    assert got.shape == full.shape and got.dtype == torch.float32
    torch.testing.assert_close(got[:, :num_kept], full[:, :num_kept], rtol=1e-4, atol=1e-4)
    assert torch.isneginf(got[:, num_kept:]).all()
    assert torch.equal(head.argmax(hidden), got.argmax(dim=1))
    assert (head.argmax(hidden) < num_kept).all()


def test_without_a_size_the_head_is_the_models(model):
    head = DraftHead(model, None)
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(2))
    assert torch.equal(head.logits(hidden), model.compute_logits(hidden).float())
    assert torch.equal(head.argmax(hidden), model.compute_logits(hidden).argmax(dim=1))


@pytest.mark.parametrize("num_kept,is_packed", [(256, False), (1024, True)])
def test_a_tied_head_keeps_the_tables_first_rows(model, num_kept, is_packed):
    """A draft whose head is its embedding table (the table stays plain: the lookup reads it), here a
    stand-in with the demo's config and a fresh table. 256 x 256 is under the size worth packing;
    1,024 x 256 is packed as a copy of the slice."""
    tied = torch.nn.Module()
    tied.config, tied.lm_head, tied.model = model.config, None, torch.nn.Module()
    tied.model.embed_tokens = torch.nn.Embedding(model.config.vocab_size, model.config.hidden_size)
    tied.model.embed_tokens.weight.requires_grad_(False)
    head = DraftHead(tied, num_kept)
    assert head.is_packed == is_packed
    hidden = torch.randn(4, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    want = hidden @ tied.model.embed_tokens.weight[:num_kept].t()  # [4, N]
    got = head.logits(hidden)
    torch.testing.assert_close(got[:, :num_kept], want, rtol=1e-4, atol=1e-4)
    assert torch.isneginf(got[:, num_kept:]).all()


def test_a_token_map_keeps_its_ids_in_its_order(model):
    """The demo's lm_head is packed into panels at load: the map's rows are gathered from them."""
    token_map = list(range(2047, 999, -3))  # not a prefix: ids 2047, 2044, ..., most frequent first
    head = DraftHead(model, 300, token_map)
    kept = token_map[:300]
    assert head.num_kept == 300 and head.ids.tolist() == kept
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(5))
    full = model.compute_logits(hidden)
    got = head.logits(hidden)
    torch.testing.assert_close(got[:, kept], full[:, kept], rtol=1e-4, atol=1e-4)
    others = torch.ones(model.config.vocab_size, dtype=torch.bool)
    others[kept] = False
    assert torch.isneginf(got[:, others]).all()
    assert torch.equal(head.argmax(hidden), got.argmax(dim=1))


def test_a_token_map_of_the_first_ids_is_the_plain_prefix(model):
    head = DraftHead(model, None, list(range(512)))
    assert head.ids is None and head.num_kept == 512


@pytest.mark.parametrize("text,message", [("[1, 2, 2]", "twice"), ("[1, 4096]", r"in \[0, 2048\)"),
                                          ("{}", "non-empty JSON list"), ("[", "cannot read")])
def test_a_bad_token_map_is_refused_naming_the_flag(tmp_path, text, message):
    path = tmp_path / "map.json"
    path.write_text(text)
    with pytest.raises(ValueError, match=f"--draft-token-map: .*{message}"):
        read_token_map(str(path), 2048)
