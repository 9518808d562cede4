"""A reference for EAGLE heads (tests/unit/test_eagle.py, tests/gpu/test_gpu_eagle.py): the method's definition over
whole sequences, no cache, from the head's safetensors and transformers' hidden states of the target."""

from __future__ import annotations

import json
import math

import torch

from llmserve.model.eagle import eagle_shape

TIE_GAP = 1e-4  # float32: logits closer than this may flip order when their sums run in another order


def record_rows(llm) -> list[tuple[list[int], list[int]]]:
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


def check_drafts(method, head_dir, hf, tokens, drafts, tie_gap: float = TIE_GAP) -> int:
    """The engine's drafts after `tokens` (prompt and output so far) against the reference: features of the target at
    each position but the last, the head over (token at p + 1, feature at p), then a step per draft on the head's own
    output features, fed the engine's drafts. Each draft must be the reference's argmax, or within tie_gap of it (a
    logit near-tie that float sums in another order may flip: counted and returned); AssertionError otherwise."""
    from safetensors.torch import load_file
    w = load_file(f"{head_dir}/model.safetensors")
    with open(f"{head_dir}/config.json") as f:
        cfg = json.load(f)
    embed = hf.model.embed_tokens.weight.cpu()
    num_ties = 0
    with torch.no_grad():
        ids = torch.tensor([tokens[:-1]], device=hf.device)
        states = [h.cpu() for h in hf(ids, output_hidden_states=True).hidden_states]  # [L + 1] x [1, T, H]
        if method == "eagle":
            features = states[-1][0]  # after the final norm
        else:
            shape = eagle_shape("eagle3", type("C", (), {**cfg, "eagle_config": cfg.get("eagle_config")})(), hf.config)
            features = torch.cat([states[i][0] for i in shape.aux_layers], -1) @ w["fc.weight"].T  # layer i's input
        seq = list(tokens[1:])
        for step, draft in enumerate(drafts):
            logits_in, out = _reference_head(method, w, cfg, embed, torch.tensor(seq), features)
            logits = logits_in[-1] @ hf.lm_head.weight.cpu().T if method == "eagle" else \
                _eagle3_logits(w, logits_in[-1], len(embed))
            best = int(logits.argmax())
            if draft != best:
                gap = float(logits[best] - logits[draft])
                assert gap < tie_gap, f"draft {step} after {len(tokens)} tokens: {draft}, the reference {best} " \
                                      f"(logit gap {gap:.2e})"
                num_ties += 1
            seq.append(draft)
            features = torch.cat([features, out[-1:]])
    return num_ties


def _eagle3_logits(w, hidden, vocab_size):
    kept = w["lm_head.weight"] @ hidden  # [Vd]
    if "d2t" not in w:
        return kept
    full = torch.full((vocab_size,), float("-inf"))
    full[torch.arange(len(kept)) + w["d2t"]] = kept
    return full
