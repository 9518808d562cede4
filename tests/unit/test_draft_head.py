"""The draft's head over a reduced vocabulary (spec/draft_head.py), against the model's own logits."""

from __future__ import annotations

import pytest
import torch

from llmserve.model.loader import load_model
from llmserve.testing.maker import make_model
from llmserve.spec.draft_head import DraftHead, read_token_map


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory) -> str:
    """The demo shape: 2,048 ids x 256 wide, its own lm_head (large enough for the CPU to pack)."""
    return make_model("llama", "demo", str(tmp_path_factory.mktemp("demo")), seed=4)


@pytest.fixture(scope="module")
def model(demo_path, cpu_linear_path):
    """The demo as a reduced-head draft is loaded: every linear packed for the CPU's path but the lm_head."""
    return load_model(demo_path, torch.float32, torch.device("cpu"), pack_head=False)


def packed_layout_rank(path: str) -> int:
    """The rank of a weight packed for a linear path: our panels [P, in, 16], oneDNN's layout [out, in]."""
    return 3 if path == "panels" else 2


def test_the_draft_is_packed_for_the_path_but_its_lm_head_stays_plain(model, cpu_linear_path):
    assert model.lm_head.weight is not None and model.lm_head.packed_weight is None
    mlp = model.model.layers[0].mlp.gate_up_proj
    assert mlp.weight is None and mlp.packed_weight.dim() == packed_layout_rank(cpu_linear_path)


@pytest.mark.parametrize("num_kept", [1000, 2048])
def test_kept_logits_are_the_models_and_the_rest_minus_infinity(model, cpu_linear_path, num_kept):
    head = DraftHead(model, num_kept)
    assert head.is_packed  # the path the CPU takes for real drafts (1,000: the last panel part-used)
    assert head.weight.dim() == packed_layout_rank(cpu_linear_path)
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
    """The map's rows are gathered from the plain lm_head, then packed for the CPU's path."""
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


def test_a_draft_of_the_whole_vocabulary_keeps_its_packed_lm_head(demo_path, cpu_linear_path):
    """Without a reduced head the draft loads as any model (its lm_head packed) and the head is its logits."""
    whole = load_model(demo_path, torch.float32, torch.device("cpu"))
    assert whole.lm_head.weight is None and whole.lm_head.packed_weight.dim() == packed_layout_rank(cpu_linear_path)
    head = DraftHead(whole, None)
    hidden = torch.randn(3, whole.config.hidden_size, generator=torch.Generator().manual_seed(6))
    assert torch.equal(head.argmax(hidden), whole.compute_logits(hidden).argmax(dim=1))


def test_the_engine_drafts_through_a_reduced_head_on_the_cpus_path(demo_path, cpu_linear_path):
    """The demo as its own draft, head cut to 1,000 ids: the worker loads it with a plain lm_head, the head
    is packed for this path, and greedy outputs are plain decoding's."""
    from llmserve import LLM, SamplingParams

    engine = dict(dtype="float32", max_model_len=128, num_kv_blocks=128, enforce_eager=True)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    prompts = [[5, 6, 7, 8], list(range(100, 130))]
    want = [o.outputs[0].token_ids for o in LLM(demo_path, **engine).generate(prompts, params)]
    llm = LLM(demo_path, speculative="draft", draft_model=demo_path, num_speculative_tokens=2,
              draft_vocab_size=1000, **engine)
    head = llm.engine.runner.speculator.proposer.head
    assert head.is_packed and head.weight.dim() == packed_layout_rank(cpu_linear_path)
    assert [o.outputs[0].token_ids for o in llm.generate(prompts, params)] == want
