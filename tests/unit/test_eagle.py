"""EAGLE and EAGLE-3 draft heads (--speculative eagle | eagle3): the engine's drafts against a reference written
from the method's definition over transformers' hidden states, exact greedy outputs, sampled drafts' q, refusals."""

import json
import math

import pytest
import torch

from llmserve import LLM, SamplingParams
from llmserve.config_speculative import SpeculativeConfig
from llmserve.model.eagle import eagle_shape
from llmserve.testing.eagle_maker import make_eagle_head
from llmserve.testing.maker import make_model

from spec_cases import repeating_prompts


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """4 layers: EAGLE-3's default feature layers (2, 2, 1) exist."""
    return make_model("llama", "demo", str(tmp_path_factory.mktemp("target")), seed=2)


@pytest.fixture(scope="module")
def heads(target, tmp_path_factory):
    root = tmp_path_factory.mktemp("heads")
    return {"eagle": make_eagle_head(target, str(root / "eagle"), "eagle", seed=1, num_layers=2),
            "eagle3": make_eagle_head(target, str(root / "eagle3"), "eagle3", seed=1, draft_vocab_size=1024),
            "eagle3-ids": make_eagle_head(target, str(root / "eagle3-ids"), "eagle3", seed=3,
                                          aux_layer_ids=[0, 1, 2])}


@pytest.fixture(scope="module")
def hf_target(target):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()


def _llm(target: str, head: str, method: str, **kwargs) -> LLM:
    kwargs = {"num_kv_blocks": 400, **kwargs}
    return LLM(target, dtype="float32", max_model_len=256, speculative=method, draft_model=head,
               num_speculative_tokens=3, speculative_dynamic=False, **kwargs)


def _record(llm: LLM) -> list[tuple[list[int], list[int]]]:
    """Every row of every proposal from now on: (its tokens then, its drafts)."""
    proposer, calls = llm.engine.runner.speculator.proposer, []
    original = proposer.propose

    def propose(rows):
        tokens = [r.token_ids.tolist() for r in rows]
        drafts, probs = original(rows)
        calls.extend(zip(tokens, drafts))
        return drafts, probs

    proposer.propose = propose
    return calls


# ---- a reference head: the method's definition over whole sequences, no cache ------------------------------------

def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rotate(x, positions, theta):  # x [T, heads, D], neox (rotate-half)
    half = x.shape[-1] // 2
    freqs = positions[:, None].float() * theta ** (-torch.arange(half).float() / half)  # [T, D/2]
    cos, sin = freqs.cos()[:, None], freqs.sin()[:, None]
    a, b = x[..., :half], x[..., half:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)


def _theta(cfg):
    return (cfg.get("rope_parameters") or {}).get("rope_theta") or cfg.get("rope_theta") or 10000.0


def _layer(w, p, x_attn, residual, cfg):
    """One Llama layer over a whole sequence: x_attn [T, in] already normed, residual [T, H] -> output [T, H]."""
    heads, kv_heads = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    dim = cfg["hidden_size"] // heads
    positions = torch.arange(len(x_attn))
    q = _rotate((x_attn @ w[f"{p}.self_attn.q_proj.weight"].T).view(-1, heads, dim), positions, _theta(cfg))
    k = _rotate((x_attn @ w[f"{p}.self_attn.k_proj.weight"].T).view(-1, kv_heads, dim), positions, _theta(cfg))
    v = (x_attn @ w[f"{p}.self_attn.v_proj.weight"].T).view(-1, kv_heads, dim)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("thd,shd->hts", q, k) / math.sqrt(dim)
    scores = scores.masked_fill(torch.ones(len(q), len(q), dtype=torch.bool).triu(1), float("-inf"))
    attn = torch.einsum("hts,shd->thd", scores.softmax(-1), v).reshape(len(q), -1) @ w[f"{p}.self_attn.o_proj.weight"].T
    h = residual + attn
    x = _rms(h, w[f"{p}.post_attention_layernorm.weight"], cfg["rms_norm_eps"])
    gate, up = x @ w[f"{p}.mlp.gate_proj.weight"].T, x @ w[f"{p}.mlp.up_proj.weight"].T
    return h + (torch.nn.functional.silu(gate) * up) @ w[f"{p}.mlp.down_proj.weight"].T


def _reference_head(method, w, cfg, embed, tokens, h):
    """tokens [T] (the token at p + 1 for each position p), h [T, H] (EAGLE: the features; EAGLE-3: after fc, or
    the head's own) -> (for the logits, next feature) [T, H]."""
    e = embed[tokens]
    if method == "eagle":
        x = torch.cat([e, h], -1) @ w["fc.weight"].T + w["fc.bias"]
        for i in range(cfg["num_hidden_layers"]):
            p = f"layers.{i}"
            normed = x if i == 0 else _rms(x, w[f"{p}.input_layernorm.weight"], cfg["rms_norm_eps"])
            x = _layer(w, p, normed, x, cfg)
        return x, x
    eps = cfg["rms_norm_eps"]
    x_attn = torch.cat([_rms(e, w["midlayer.input_layernorm.weight"], eps),
                        _rms(h, w["midlayer.hidden_norm.weight"], eps)], -1)
    out = _layer(w, "midlayer", x_attn, h, cfg)
    return _rms(out, w["norm.weight"], eps), out


def _reference_drafts(method, head_dir, hf, tokens, k):
    """The k greedy drafts after `tokens` (prompt and output so far): features of the target at each position but
    the last, the head over (token at p + 1, feature at p), then k - 1 steps on its own output features."""
    from safetensors.torch import load_file
    w = load_file(f"{head_dir}/model.safetensors")
    with open(f"{head_dir}/config.json") as f:
        cfg = json.load(f)
    embed = hf.model.embed_tokens.weight
    with torch.no_grad():
        states = hf(torch.tensor([tokens[:-1]]), output_hidden_states=True).hidden_states  # [L + 1] x [1, T, H]
        if method == "eagle":
            features = states[-1][0]  # after the final norm
        else:
            shape = eagle_shape("eagle3", type("C", (), {**cfg, "eagle_config": cfg.get("eagle_config")})(), hf.config)
            features = torch.cat([states[i][0] for i in shape.aux_layers], -1) @ w["fc.weight"].T  # layer i's input
        seq, drafts = list(tokens[1:]), []
        for _ in range(k):
            logits_in, out = _reference_head(method, w, cfg, embed, torch.tensor(seq), features)
            logits = hf.lm_head(logits_in[-1]) if method == "eagle" else _eagle3_logits(w, logits_in[-1], len(embed))
            drafts.append(int(logits.argmax()))
            seq.append(drafts[-1])
            features = torch.cat([features, out[-1:]])
    return drafts


def _eagle3_logits(w, hidden, vocab_size):
    kept = w["lm_head.weight"] @ hidden  # [Vd]
    if "d2t" not in w:
        return kept
    full = torch.full((vocab_size,), float("-inf"))
    full[torch.arange(len(kept)) + w["d2t"]] = kept
    return full


@pytest.mark.parametrize("head", ["eagle", "eagle3", "eagle3-ids"])
def test_drafts_are_the_reference_heads_after_prompts_in_chunks_and_rejections(target, heads, hf_target, head):
    """Chunked prompts (features kept across steps) and mostly rejected drafts (features of rejected positions
    dropped): every proposal equals the reference's greedy drafts for the tokens the row held."""
    method = head.split("-")[0]
    llm = _llm(target, heads[head], method, max_num_batched_tokens=32, enable_prefix_caching=False)
    calls = _record(llm)
    prompts = repeating_prompts(3, seed=4)
    llm.generate(prompts, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    assert len(calls) >= 3 * 5 and all(len(drafts) == 3 for _, drafts in calls)
    for tokens, drafts in calls:
        assert drafts == _reference_drafts(method, heads[head], hf_target, tokens, 3), f"after {len(tokens)} tokens"
    assert llm.engine.runner.speculator.proposer.num_skipped == 0
    llm.engine.check_integrity()


def test_features_of_plain_steps_and_windows_reach_the_head(target, heads, hf_target):
    """More rows than --speculative-max-batch: plain steps (multi-step windows on CPU) until rows finish, then
    proposals, which must still equal the reference (the head caught up on every feature of the plain steps)."""
    llm = _llm(target, heads["eagle"], "eagle", speculative_max_batch=1, num_scheduler_steps=4)
    calls = _record(llm)
    prompts = repeating_prompts(3, seed=6)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (6, 9, 30)]
    llm.generate(prompts, params)
    assert calls and max(len(tokens) for tokens, _ in calls) > len(prompts[2]) + 12  # after the others finished
    for tokens, drafts in calls:
        assert drafts == _reference_drafts("eagle", heads["eagle"], hf_target, tokens, 3), f"after {len(tokens)}"
    llm.engine.check_integrity()


@pytest.fixture(scope="module")
def plain(target):
    return LLM(target, dtype="float32", max_model_len=256, num_kv_blocks=400)


@pytest.mark.parametrize("method", ["eagle", "eagle3"])
def test_greedy_outputs_are_plain_decodings_with_preemption_prefix_hits_and_n2(target, heads, plain, method):
    prompts = repeating_prompts(10, seed=3)
    prompts += [prompts[0][:40] + [7, 8, 9], prompts[0][:40] + [9, 8, 7]]  # prefix hits on prompt 0's blocks
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, n=2)
    llm = _llm(target, heads[method], method, num_kv_blocks=24, max_num_batched_tokens=64, speculative_max_batch=16)
    got = [list(c.token_ids) for o in llm.generate(prompts, params) for c in o.outputs]
    assert llm.num_preemptions > 0, "the small pool was meant to force preemption"
    assert got == [list(c.token_ids) for o in plain.generate(prompts, params) for c in o.outputs]
    llm.engine.check_integrity()
    assert llm.engine.num_free_blocks() == llm.engine.scheduler.kv.pool.num_usable_blocks
    assert set(llm.engine.runner.speculator.proposer.features) <= set(llm.engine.runner.states)  # none leaked


def test_sampled_drafts_carry_q_over_the_heads_ids_only(target, heads):
    """EAGLE-3 with 1,024 of the 2,048 ids: sampled drafts draw from a q that is zero past its ids."""
    llm = _llm(target, heads["eagle3"], "eagle3")
    proposer = llm.engine.runner.speculator.proposer
    kept = proposer.head.target_ids()
    calls, original = [], proposer.propose
    proposer.propose = lambda rows: calls.append(original(rows)) or calls[-1]
    llm.generate(repeating_prompts(3, seed=8), SamplingParams(temperature=1.0, seed=5, max_tokens=12, ignore_eos=True))
    q = [p for _, probs in calls for p in probs if p is not None]  # [k, V] each
    outside = torch.ones(2048, dtype=torch.bool).index_fill_(0, kept, False)
    assert q and all(torch.allclose(p.sum(dim=1), torch.ones(len(p))) and p[:, outside].sum() == 0 for p in q)
    assert all(set(drafts) <= set(kept.tolist()) for d, _ in calls for drafts in d)


def _config(**fields):
    base = {"vocab_size": 4096, "hidden_size": 256, "num_hidden_layers": 1}
    return type("Config", (), {**base, **fields})()


@pytest.mark.parametrize("method, fields, message", [
    ("eagle", {"vocab_size": 32000}, "vocab_size \\(32000\\) differs"),
    ("eagle", {"hidden_size": 128}, "hidden_size \\(128\\) differs"),
    ("eagle", {"add_para_norm": True}, "add_para_norm"),
    ("eagle3", {"num_hidden_layers": 2}, "num_hidden_layers must be 1"),
    ("eagle3", {"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 2, 3]}}, "eagle_aux_hidden_state_layer_ids"),
    ("eagle3", {"eagle_config": {"use_aux_hidden_state": False}}, "eagle_config.use_aux_hidden_state"),
    ("eagle3", {"target_hidden_size": 512}, "target_hidden_size \\(512\\)"),
])
def test_a_head_config_field_it_cannot_serve_is_refused_by_name(method, fields, message):
    target = _config(num_hidden_layers=4)
    with pytest.raises(ValueError, match=f"--speculative {method}: the head's config field {message}"):
        eagle_shape(method, _config(**fields), target)


def test_a_checkpoint_tensor_with_no_place_is_refused(target, heads, tmp_path):
    from safetensors.torch import load_file, save_file
    import shutil
    shutil.copytree(heads["eagle3"], tmp_path / "head")
    tensors = load_file(str(tmp_path / "head" / "model.safetensors"))
    tensors["midlayer.extra.weight"] = torch.zeros(2)
    save_file(tensors, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(ValueError, match="'midlayer.extra.weight' has no place in the eagle3 head"):
        _llm(target, str(tmp_path / "head"), "eagle3")
    del tensors["midlayer.extra.weight"], tensors["norm.weight"]
    save_file(tensors, str(tmp_path / "head" / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks 1 tensors, e.g. \\['norm.weight'\\]"):
        _llm(target, str(tmp_path / "head"), "eagle3")


def test_the_head_is_required_and_speculative_config_names_the_methods():
    with pytest.raises(ValueError, match="--draft-model: required with --speculative draft, eagle or eagle3"):
        SpeculativeConfig(speculative="eagle3").validate()
    import argparse
    from llmserve.config_speculative import take_speculative_config
    args = argparse.Namespace(speculative_config='{"method": "eagle3", "model": "h", "num_speculative_tokens": 5}',
                              speculative=None, draft_model=None, num_speculative_tokens=4)
    take_speculative_config(args)
    assert (args.speculative, args.draft_model, args.num_speculative_tokens) == ("eagle3", "h", 5)
