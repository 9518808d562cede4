"""Weights that copy (`make-model --copying`): a random-weight checkpoint that continues the spans its
context repeats, as prompt lookup (n-gram speculation) needs of a model.

Plain random weights never continue a repeated span, so on them n-gram speculation finds nothing to
propose (on the H100, the 8B shape: no drafts at all). Real models copy through induction heads (Olsson
et al. 2022): one head moves each token's predecessor into its position, a later one looks for the
earlier positions whose predecessor is the current token and reads what stands there. Layers 0 and 1
are set to that circuit; the other layers keep random weights, their outputs scaled by NOISE_SCALE so
they perturb the logits without outvoting it. Every tensor keeps its shape, so the model costs what the
random one does. The residual stream (D wide) carries, with the token code width d = head_dim:
- dims [0, d): the token's code (unit rows of `codes`, times `r`), which the lm_head also reads;
- dims [d, 2d): the previous token's code (written by layer 0);
- dim 2d: a constant `c`, from which layer 0's previous-token head builds position-only queries and keys.
Layer 0, head 0 (kv head 0) attends from position m to m - 1: its queries and keys use the
`NUM_POSITION_PAIRS` fastest rotary pairs only, set so that the score is a^2 * sum_i cos((m - n - 1) theta_i),
highest at distance 1 by `POSITION_GAP` (its value: the token's code; out: dims [d, 2d)).
Layer 1, head 0 (kv head 0) is the induction head: queries from the token's code, keys from the previous
token's code, both on the slowest rotary pairs (which turn less than ~0.3 rad over the context, so the
score reads content, not distance): it attends where the previous token equals the current one, with a
score of `MATCH_SCORE` there, and writes `GAIN` x that position's code into dims [0, d). Layer 1's first
head of kv head 1 attends to the positions holding the current token (itself included) and subtracts
its code, so the logits read what the induction head wrote (where nothing matched, a mix of context
tokens: the model then copies its context too). The MLPs of layers 0 and 1 write nothing.
Llama and Mistral layouts (no biases, no q/k norms).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

COPYING_ARCHS = ("llama", "mistral")
NUM_POSITION_PAIRS = 8  # rotary pairs of the previous-token head
POSITION_GAP = 16.0  # its score at distance 1 over its best elsewhere (nats)
MATCH_SCORE = 32.0  # the induction head's score where the previous token matches (nats)
SLOW_TURN = 0.3  # radians a content pair may turn over the context
GAIN = 3.0  # the copied code's weight in the residual, against the token's own (1)
TOP_LOGIT = 30.0  # the copied token's logit (the final norm's weight sets it)
NOISE_SCALE = 0.1  # the random layers' output projections, scaled
LAYER1_MEAN_SQUARE = 1.5  # the residual's mean square into layer 1: the embedding's 1, the previous code's 0.5
_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


@dataclass(frozen=True)
class CopyingPlan:
    codes: torch.Tensor  # [V, d] float32: unit rows, the content part (the slow pairs' dims) a fixed share
    hidden_size: int  # D
    head_dim: int  # d: the code width
    num_heads: int
    num_kv_heads: int
    position_pairs: torch.Tensor  # [NUM_POSITION_PAIRS] int64: rotary pairs of the previous-token head
    position_freqs: torch.Tensor  # [NUM_POSITION_PAIRS] float32: their inverse frequencies
    position_amp: float  # a: the previous-token head's query/key size per pair
    content_dims: torch.Tensor  # [n] int64: head dims of the slow pairs (both halves of each)
    content_amp: float  # b: the induction and cancelling heads' query/key scale

    @property
    def code_scale(self) -> float:  # r = c: the embedding's code and constant parts
        return math.sqrt(self.hidden_size / 2)

    @property
    def layer1_rms(self) -> float:  # the residual's RMS into layer 1: embedding plus the previous code
        return math.sqrt(LAYER1_MEAN_SQUARE)

    @property
    def final_norm_weight(self) -> float:
        """The copied token's logit at TOP_LOGIT: the last residual holds GAIN * r * its code, r * the
        previous code and the constant c = r (an RMS of sqrt((GAIN^2 + 2) / 2)); its logit is
        r * GAIN * r / RMS times this weight."""
        rms = math.sqrt((GAIN ** 2 + 2) / 2)
        return TOP_LOGIT * rms / (GAIN * self.code_scale ** 2)


def copying_plan(config, seed: int) -> CopyingPlan:
    """The circuit's constants for a transformers config (rotary frequencies as the engine computes them)."""
    from llmserve.model.layers import rope_inv_freq, rope_params_from_config

    hidden, heads = config.hidden_size, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    if hidden < 2 * head_dim + 1 or config.num_key_value_heads < 2 or config.num_hidden_layers < 2:
        raise ValueError("--copying needs hidden_size >= 2 * head_dim + 1, 2 kv heads and 2 layers")
    inv_freq = rope_inv_freq(head_dim, rope_params_from_config(config))  # [d / 2], fastest first
    context = min(config.max_position_embeddings, 4096)
    num_slow = max(4, int((inv_freq * context < SLOW_TURN).sum()))
    slow = torch.arange(head_dim // 2 - num_slow, head_dim // 2)
    content_dims = torch.cat([slow, slow + head_dim // 2])  # [2 * num_slow]
    pairs = torch.arange(min(NUM_POSITION_PAIRS, head_dim // 2))
    gap = _position_gap(inv_freq[pairs], config.max_position_embeddings)
    codes = _codes(config.vocab_size, head_dim, content_dims, seed)
    share = len(content_dims) / head_dim  # |content part|^2 of a unit code
    code_square = hidden / 2  # r^2: the squared size of the embedding's code part
    content_amp = math.sqrt(MATCH_SCORE * math.sqrt(head_dim) * LAYER1_MEAN_SQUARE / (code_square * share))
    return CopyingPlan(codes, hidden, head_dim, heads, config.num_key_value_heads, pairs, inv_freq[pairs],
                       math.sqrt(POSITION_GAP * math.sqrt(head_dim) / gap), content_dims, content_amp)


def _position_gap(freqs: torch.Tensor, max_position: int) -> float:
    """sum_i cos((delta - 1) f_i) at delta = 1 over its largest value at any other distance."""
    delta = torch.arange(min(max_position, 16384), dtype=torch.float64)  # [P]
    score = torch.cos(torch.outer(delta - 1, freqs.double())).sum(dim=1)  # [P]
    return float(score[1] - torch.cat([score[:1], score[2:]]).max())


def _codes(vocab_size: int, dim: int, content_dims: torch.Tensor, seed: int) -> torch.Tensor:
    """[V, dim] unit rows whose content dims hold exactly their share of the norm (self-matches score alike)."""
    gen = torch.Generator().manual_seed(seed + 7919)
    codes = torch.randn(vocab_size, dim, generator=gen)
    is_content = torch.zeros(dim, dtype=torch.bool)
    is_content[content_dims] = True
    share = is_content.float().mean()
    codes[:, is_content] *= torch.sqrt(share) / codes[:, is_content].norm(dim=1, keepdim=True)
    codes[:, ~is_content] *= torch.sqrt(1 - share) / codes[:, ~is_content].norm(dim=1, keepdim=True)
    return codes


def copying_tensor(plan: CopyingPlan, name: str, tensor: torch.Tensor) -> torch.Tensor:
    """The tensor `name` of the copying checkpoint, from the random one of the same name and shape."""
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return _embedding(plan).to(tensor.dtype)
    if name == "model.norm.weight":
        return torch.full_like(tensor, plan.final_norm_weight)
    if name.endswith("layernorm.weight"):
        return torch.ones_like(tensor)
    match = _LAYER.match(name)
    if match is None:
        return tensor
    layer, part = int(match.group(1)), match.group(2)
    if layer >= 2:
        return tensor * NOISE_SCALE if part in ("self_attn.o_proj.weight", "mlp.down_proj.weight") else tensor
    if part == "mlp.down_proj.weight":
        return torch.zeros_like(tensor)
    if part.startswith("mlp."):
        return tensor
    build = _LAYER0 if layer == 0 else _LAYER1
    return build[part](plan).to(tensor.dtype)


def _embedding(plan: CopyingPlan) -> torch.Tensor:
    """[V, D]: r * code in dims [0, d), c in dim 2d (an RMS of 1); also the lm_head, which reads the codes."""
    d, r = plan.head_dim, plan.code_scale
    table = torch.zeros(plan.codes.shape[0], plan.hidden_size)
    table[:, :d] = r * plan.codes
    table[:, 2 * d] = r
    return table


def _zeros(plan: CopyingPlan, rows_heads: int, cols: int) -> torch.Tensor:
    return torch.zeros(rows_heads * plan.head_dim, cols)


def _position_q(plan: CopyingPlan) -> torch.Tensor:
    """[H * d, D]: head 0's query, a in the first half of each position pair, from the constant dim."""
    q = _zeros(plan, plan.num_heads, plan.hidden_size)
    q[plan.position_pairs, 2 * plan.head_dim] = plan.position_amp / plan.code_scale
    return q


def _position_k(plan: CopyingPlan) -> torch.Tensor:
    """[Hkv * d, D]: kv head 0's key, a at angle theta_i in each pair: scores peak one position back."""
    k = _zeros(plan, plan.num_kv_heads, plan.hidden_size)
    half, const, amp = plan.head_dim // 2, 2 * plan.head_dim, plan.position_amp / plan.code_scale
    k[plan.position_pairs, const] = amp * torch.cos(plan.position_freqs)
    k[plan.position_pairs + half, const] = amp * torch.sin(plan.position_freqs)
    return k


def _code_v(plan: CopyingPlan) -> torch.Tensor:
    """[Hkv * d, D]: kv heads 0 and 1 read the token's code."""
    v = _zeros(plan, plan.num_kv_heads, plan.hidden_size)
    eye = torch.eye(plan.head_dim)
    v[:plan.head_dim, :plan.head_dim] = eye
    v[plan.head_dim:2 * plan.head_dim, :plan.head_dim] = eye
    return v


def _previous_o(plan: CopyingPlan) -> torch.Tensor:
    """[D, H * d]: head 0's output (the previous token's code) into dims [d, 2d)."""
    o = torch.zeros(plan.hidden_size, plan.num_heads * plan.head_dim)
    o[plan.head_dim:2 * plan.head_dim, :plan.head_dim] = torch.eye(plan.head_dim)
    return o


def _content(plan: CopyingPlan, out: torch.Tensor, row0: int, col0: int) -> torch.Tensor:
    """out's rows row0 + content dims read the content part of the code held from column col0."""
    dims = plan.content_dims
    out[row0 + dims, col0 + dims] = plan.content_amp
    return out


def _induction_q(plan: CopyingPlan) -> torch.Tensor:
    """[H * d, D]: head 0 asks for the current token; the first head of kv head 1 too (the cancelling head)."""
    q = _zeros(plan, plan.num_heads, plan.hidden_size)
    group = plan.num_heads // plan.num_kv_heads
    return _content(plan, _content(plan, q, 0, 0), group * plan.head_dim, 0)


def _induction_k(plan: CopyingPlan) -> torch.Tensor:
    """[Hkv * d, D]: kv head 0's key is the previous token's code; kv head 1's the token's own."""
    k = _zeros(plan, plan.num_kv_heads, plan.hidden_size)
    return _content(plan, _content(plan, k, 0, plan.head_dim), plan.head_dim, 0)


def _induction_o(plan: CopyingPlan) -> torch.Tensor:
    """[D, H * d]: head 0 adds GAIN x the code it found; the cancelling head subtracts the current one."""
    o = torch.zeros(plan.hidden_size, plan.num_heads * plan.head_dim)
    d, rms = plan.head_dim, plan.layer1_rms
    group = plan.num_heads // plan.num_kv_heads
    o[:d, :d] = GAIN * rms * torch.eye(d)
    o[:d, group * d:(group + 1) * d] = -rms * torch.eye(d)
    return o


_LAYER0 = {"self_attn.q_proj.weight": _position_q, "self_attn.k_proj.weight": _position_k,
           "self_attn.v_proj.weight": _code_v, "self_attn.o_proj.weight": _previous_o}
_LAYER1 = {"self_attn.q_proj.weight": _induction_q, "self_attn.k_proj.weight": _induction_k,
           "self_attn.v_proj.weight": _code_v, "self_attn.o_proj.weight": _induction_o}
