"""Draft verification (speculative decoding): exact agreement with the papers' rule, and the laws it keeps.

Reference: Leviathan et al. 2023 (Algorithm 1), Chen et al. 2023 (modified rejection sampling).
Distribution tests use fixed seeds: they are deterministic, and the bounds are chi-square critical
values at p = 0.001 (binomial counts: 5 sigma), so a correct rule passes them with a wide margin.
"""

import math

import numpy as np
import pytest
import torch

from llmserve.sample.ops import exponential_race
from llmserve.sample.rejection import accepted_lengths, emit_accepted, rejection_sample


def _num_accepted(is_accepted: list[bool], drafts: list[list[int]]) -> list[int]:
    num_drafts = torch.tensor([len(d) for d in drafts], dtype=torch.int64)
    return accepted_lengths(torch.tensor(is_accepted, dtype=torch.bool), num_drafts).tolist()


def emit_from_rejection(is_accepted: list[bool], fallback: list[int], bonus: list[int],
                        drafts: list[list[int]]) -> list[list[int]]:
    """Per row: the accepted leading drafts, then the residual sample at the first rejection, or the bonus
    token (the target's sample at the row's last position, start + k) when every draft is accepted."""
    last, start = list(fallback), 0
    for row in drafts:
        last[start + len(row)] = bonus[start + len(row)]
        start += len(row) + 1
    return emit_accepted(drafts, _num_accepted(is_accepted, drafts), last)


def accept_point_drafts(target_tokens: list[int], drafts: list[list[int]]) -> list[list[int]]:
    """The point rule (spec/verify.py): keep drafts while they equal the target's own token there."""
    flat = [t for row in drafts for t in row + [None]]  # None at the bonus positions
    is_accepted = [d == t for d, t in zip(flat, target_tokens)]
    return emit_accepted(drafts, _num_accepted(is_accepted, drafts), target_tokens)

# Chi-square critical values at p = 0.001, by degrees of freedom (no scipy in the venv).
CHI2_CRITICAL_0_001 = {1: 10.828, 2: 13.816, 3: 16.266, 4: 18.467, 5: 20.515}


@pytest.fixture(autouse=True)
def one_thread():
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


# ---------------------------------------------------------------------------------------------------
# The reference: one row, a plain loop over the papers' formulas in float64.


def reference_row(p: np.ndarray, q: np.ndarray, drafts: list[int], uniforms: np.ndarray, log_u: np.ndarray,
                  bonus: int) -> list[int]:
    """p, q [k + 1, V]; uniforms [k + 1]; log_u [k + 1, V] (log U, so E = -log U ~ Exp(1))."""
    out = []
    for j, d in enumerate(drafts):
        if uniforms[j] < min(1.0, p[j, d] / q[j, d]):
            out.append(d)
            continue
        out.append(reference_residual_sample(p[j], q[j], log_u[j]))
        return out
    return out + [bonus]


def reference_residual_sample(p: np.ndarray, q: np.ndarray, log_u: np.ndarray) -> int:
    """argmax over x of r(x) / E(x), r = max(0, p - q) normalised (p itself when that is all zero)."""
    r = np.maximum(0.0, p - q)
    r = r / r.sum() if r.sum() > 0 else p
    return int(np.argmax(r / -log_u))


def random_distribution(rng: np.random.Generator, vocab_size: int) -> np.ndarray:
    """float32 probabilities with a few zeros; a one-hot one now and then."""
    kind = rng.integers(4)
    if kind == 0:
        return np.eye(vocab_size, dtype=np.float32)[rng.integers(vocab_size)]
    weights = rng.dirichlet(np.full(vocab_size, 0.7))
    if kind == 1:
        weights[rng.random(vocab_size) < 0.4] = 0.0
        if weights.sum() == 0:
            weights[rng.integers(vocab_size)] = 1.0
    return (weights / weights.sum()).astype(np.float32)


def random_case(seed: int, num_rows: int, vocab_size: int):
    """Rows with 0..4 drafts each, drafts drawn from q; q == p at some positions, to reach the
    rule's empty-residual branch."""
    rng = np.random.default_rng(seed)
    p_rows, q_rows, ids, drafts = [], [], [], []
    for _ in range(num_rows):
        k = int(rng.integers(5))
        row_drafts = []
        for _ in range(k):
            p = random_distribution(rng, vocab_size)
            q = p.copy() if rng.random() < 0.15 else random_distribution(rng, vocab_size)
            q64 = q.astype(np.float64)
            d = int(rng.choice(vocab_size, p=q64 / q64.sum()))
            p_rows.append(p)
            q_rows.append(q)
            ids.append(d)
            row_drafts.append(d)
        # The bonus position: p only; q is zero there and its id is anything (as in spec_verify).
        p_rows.append(random_distribution(rng, vocab_size))
        q_rows.append(np.zeros(vocab_size, dtype=np.float32))
        ids.append(int(rng.integers(vocab_size)))
        drafts.append(row_drafts)
    num_positions = len(ids)
    uniforms = rng.random(num_positions).astype(np.float32)
    log_u = np.log(rng.uniform(1e-20, 1.0, size=(num_positions, vocab_size)).astype(np.float32))
    bonus = rng.integers(vocab_size, size=num_positions).tolist()
    return np.stack(p_rows), np.stack(q_rows), np.array(ids), drafts, uniforms, log_u, bonus


def run_rule(p, q, ids, drafts, uniforms, log_u, bonus):
    is_accepted, fallback = rejection_sample(torch.from_numpy(p.copy()), torch.from_numpy(q.copy()),
                                             torch.from_numpy(ids).to(torch.int64),
                                             torch.from_numpy(uniforms.copy()), torch.from_numpy(log_u.copy()))
    assert is_accepted.dtype == torch.bool and fallback.dtype == torch.int64
    assert is_accepted.shape == fallback.shape == (len(ids),)
    emitted = emit_from_rejection(is_accepted.tolist(), fallback.tolist(), bonus, drafts)
    return is_accepted.tolist(), fallback.tolist(), emitted


@pytest.mark.parametrize("seed", range(4))
def test_rule_equals_the_papers_reference_exactly(seed):
    p, q, ids, drafts, uniforms, log_u, bonus = random_case(seed, num_rows=150, vocab_size=8)
    is_accepted, fallback, emitted = run_rule(p, q, ids, drafts, uniforms, log_u, bonus)
    p64, q64, log_u64 = p.astype(np.float64), q.astype(np.float64), log_u.astype(np.float64)
    u64 = uniforms.astype(np.float64)
    start, num_rejections, num_full = 0, 0, 0
    for row_drafts, row_emitted in zip(drafts, emitted):
        k = len(row_drafts)
        span = slice(start, start + k + 1)
        expected = reference_row(p64[span], q64[span], row_drafts, u64[span], log_u64[span], bonus[start + k])
        assert row_emitted == expected, f"row at {start}: drafts {row_drafts}"
        for j, d in enumerate(row_drafts):  # every draft position, not only the first rejection
            i = start + j
            assert is_accepted[i] == bool(u64[i] < min(1.0, p64[i, d] / q64[i, d])), f"position {i}"
            assert fallback[i] == reference_residual_sample(p64[i], q64[i], log_u64[i]), f"position {i}"
        num_rejections += len(row_emitted) <= k
        num_full += len(row_emitted) == k + 1
        start += k + 1
    assert start == len(ids) and len(emitted) == len(drafts)
    assert num_rejections > 20 and num_full > 20  # both branches exercised


def test_rows_without_drafts_emit_their_bonus_token():
    p = np.full((3, 4), 0.25, dtype=np.float32)
    q = np.zeros((3, 4), dtype=np.float32)
    log_u = np.log(np.full((3, 4), 0.5, dtype=np.float32))
    _, _, emitted = run_rule(p, q, np.array([0, 3, 1]), [[], [], []], np.zeros(3, dtype=np.float32), log_u,
                             [2, 0, 3])
    assert emitted == [[2], [0], [3]]


# ---------------------------------------------------------------------------------------------------
# Exact edge cases.


def test_all_accepted_appends_the_bonus_token():
    # q == p: u * q(d) < p(d) for every u < 1, so every draft is accepted.
    p = np.array([[0.1, 0.6, 0.3], [0.5, 0.25, 0.25], [0.2, 0.2, 0.6],
                  [0.3, 0.3, 0.4], [0.9, 0.05, 0.05]], dtype=np.float32)
    drafts = [[1, 2], [0]]  # positions: row 0: 0 1 (bonus 2) | row 1: 3 (bonus 4)
    uniforms = np.array([0.999, 0.999, 0.5, 0.999, 0.5], dtype=np.float32)
    log_u = np.log(np.full((5, 3), 0.3, dtype=np.float32))
    bonus = [7, 7, 4, 7, 5]  # only the rows' last positions are read
    _, _, emitted = run_rule(p, p.copy(), np.array([1, 2, 0, 0, 0]), drafts, uniforms, log_u, bonus)
    assert emitted == [[1, 2, 4], [0, 5]]


def test_first_rejection_emits_one_residual_token():
    # p is one-hot on token 3, the draft is token 1 (p(1) = 0): rejected for every u, even u = 0;
    # the residual is max(0, p - q) = mass on 3 only.
    p = np.array([[0, 0, 0, 1], [0.25] * 4, [0.25] * 4], dtype=np.float32)
    q = np.array([[0.1, 0.7, 0.1, 0.1], [0.25] * 4, [0, 0, 0, 0]], dtype=np.float32)
    log_u = np.log(np.array([[0.9, 0.9, 0.9, 0.999]] * 3, dtype=np.float32))  # 3 has the largest E
    _, fallback, emitted = run_rule(p, q, np.array([1, 2, 0]), [[1, 2]], np.zeros(3, dtype=np.float32), log_u,
                                    [0, 0, 0])
    assert emitted == [[3]]
    assert fallback[0] == 3


def test_draft_with_zero_target_probability_is_never_accepted():
    p = np.array([[0.5, 0.5, 0.0], [1 / 3] * 3], dtype=np.float32)
    q = np.array([[0.0, 0.0, 1.0], [0, 0, 0]], dtype=np.float32)
    is_accepted, fallback, emitted = run_rule(p, q, np.array([2, 0]), [[2]], np.zeros(2, dtype=np.float32),
                                              np.log(np.full((2, 3), 0.5, dtype=np.float32)), [1, 1])
    assert is_accepted[0] is False and fallback[0] in (0, 1) and emitted == [[fallback[0]]]


def test_draft_with_p_at_least_q_is_always_accepted():
    # p(d) >= q(d): min(1, p/q) = 1, accepted for u arbitrarily close to 1.
    p = np.array([[0.2, 0.5, 0.3], [1 / 3] * 3], dtype=np.float32)
    q = np.array([[0.6, 0.3, 0.1], [0, 0, 0]], dtype=np.float32)
    uniforms = np.array([np.nextafter(np.float32(1), np.float32(0)), 0], dtype=np.float32)
    is_accepted, _, emitted = run_rule(p, q, np.array([1, 0]), [[1]], uniforms,
                                       np.log(np.full((2, 3), 0.5, dtype=np.float32)), [9, 2])
    assert is_accepted[0] is True and emitted == [[1, 2]]


def test_acceptance_threshold_is_p_over_q():
    # p(d) / q(d) = 0.2 / 0.8 = 0.25: accepted for u below it, rejected above.
    p = np.array([[0.2, 0.8]] * 4, dtype=np.float32)
    q = np.array([[0.8, 0.2]] * 4, dtype=np.float32)
    uniforms = np.array([0.0, 0.2499, 0.2501, 0.9], dtype=np.float32)
    is_accepted, fallback, _ = run_rule(p, q, np.zeros(4, dtype=np.int64), [[0], [0]], uniforms,
                                        np.log(np.full((4, 2), 0.5, dtype=np.float32)), [0] * 4)
    assert is_accepted == [True, True, False, False]
    assert fallback == [1, 1, 1, 1]  # the residual max(0, p - q) is on token 1 only


def test_residual_falls_back_to_p_when_p_equals_q():
    # p == q: max(0, p - q) is all zero; the residual draw must sample p (here one-hot on token 2),
    # not return an arbitrary index.
    p = np.array([[0, 0, 1, 0]] * 2 + [[0, 0.5, 0.5, 0]] * 2, dtype=np.float32)
    rng = np.random.default_rng(5)
    log_u = np.log(rng.uniform(1e-20, 1, size=(4, 4)).astype(np.float32))
    _, fallback, _ = run_rule(p, p.copy(), np.array([2, 2, 1, 2]), [[2], [1]], np.zeros(4, dtype=np.float32),
                              log_u, [0] * 4)
    assert fallback[0] == 2
    assert fallback[2] == 1 + int(log_u[2, 2] > log_u[2, 1])  # argmax 0.5 / E: the smaller E wins


def test_one_hot_target_equals_greedy_verification():
    # p one-hot at each position (a greedy target): whatever q, the noise or the drafts, the rule
    # emits what agreement with the argmax emits.
    rng = np.random.default_rng(11)
    vocab_size, drafts, p_rows, q_rows, ids = 5, [], [], [], []
    for _ in range(60):
        k = int(rng.integers(4))
        row = []
        for j in range(k + 1):
            q = rng.dirichlet(np.ones(vocab_size)).astype(np.float32) if j < k else np.zeros(vocab_size, np.float32)
            target = int(rng.integers(vocab_size))
            d = int(rng.integers(vocab_size)) if j < k else 0
            if j < k and rng.random() < 0.6:
                d = target  # agree often, so rows reach their bonus position
            p_rows.append(np.eye(vocab_size, dtype=np.float32)[target])
            q_rows.append(q)
            ids.append(d)
            if j < k:
                row.append(d)
        drafts.append(row)
    p, q = np.stack(p_rows), np.stack(q_rows)
    num_positions = len(ids)
    argmax = p.argmax(axis=1).tolist()
    uniforms = rng.random(num_positions).astype(np.float32)
    log_u = np.log(rng.uniform(1e-20, 1, size=(num_positions, vocab_size)).astype(np.float32))
    _, _, emitted = run_rule(p, q, np.array(ids), drafts, uniforms, log_u, argmax)
    assert emitted == accept_point_drafts(argmax, drafts)
    assert any(len(e) == len(d) + 1 and d for e, d in zip(emitted, drafts))


def test_emit_from_rejection_layout():
    drafts = [[10, 11], [12], [], [13, 14]]
    # positions:    row 0: 0 1 2 | row 1: 3 4 | row 2: 5 | row 3: 6 7 8
    is_accepted = [True, True, False, False, True, True, False, True, True]
    fallback = [20, 21, 22, 23, 24, 25, 26, 27, 28]
    bonus = [30, 31, 32, 33, 34, 35, 36, 37, 38]
    assert emit_from_rejection(is_accepted, fallback, bonus, drafts) == [[10, 11, 32], [23], [35], [26]]


def test_accept_point_drafts_layout():
    target = [5, 6, 7, 8, 1, 2, 3, 4, 4, 0]  # [N]: 4 + 1 + 2 + 3 positions
    drafts = [[5, 6, 9], [], [2], [9, 4]]
    # the emitted tokens are always a prefix of the row's target tokens
    assert accept_point_drafts(target, drafts) == [[5, 6, 7], [1], [2, 3], [4]]


# ---------------------------------------------------------------------------------------------------
# Laws: the emitted tokens follow p, whatever q.


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """(statistic, degrees of freedom); tokens with probability 0 must never be drawn."""
    probs = np.asarray(probs, dtype=np.float64)
    assert counts[probs == 0].sum() == 0, f"a token with p = 0 was emitted: {counts}"
    kept = probs > 0
    expected = probs[kept] / probs[kept].sum() * counts.sum()
    return float(((counts[kept] - expected) ** 2 / expected).sum()), int(kept.sum()) - 1


def assert_follows(tokens: list[int], probs: np.ndarray) -> None:
    counts = np.bincount(np.asarray(tokens, dtype=np.int64), minlength=len(probs))
    assert counts.sum() > 500  # enough for every expected count to be large (p >= 0.03 here)
    statistic, dof = chi2(counts, probs)
    if dof == 0:
        return  # one possible token, checked by chi2's zero-probability assertion
    assert statistic < CHI2_CRITICAL_0_001[dof], f"chi2 {statistic:.1f} (dof {dof}), counts {counts.tolist()}"


def assert_binomial(successes: int, trials: int, rate: float) -> None:
    sigma = math.sqrt(trials * rate * (1 - rate))
    assert abs(successes - trials * rate) <= 5 * sigma + 1e-9, f"{successes}/{trials}, expected rate {rate:.4f}"


def draw_and_verify(p: torch.Tensor, q: torch.Tensor, num_rows: int, seed: int):
    """num_rows independent rows, each with k = len(q) drafts d_j ~ q_j verified against p [k + 1, V]
    (distributions that do not depend on the prefix). Returns (drafts [R, k], emitted per row)."""
    g = torch.Generator().manual_seed(seed)
    k, vocab_size = q.shape
    drafts = torch.stack([torch.multinomial(q[j], num_rows, replacement=True, generator=g) for j in range(k)],
                         dim=1)  # [R, k]
    num_positions = num_rows * (k + 1)
    target_probs = p.repeat(num_rows, 1)  # [N, V]
    draft_probs = torch.cat([q, torch.zeros(1, vocab_size)]).repeat(num_rows, 1)  # [N, V]
    ids = torch.cat([drafts, torch.zeros(num_rows, 1, dtype=torch.int64)], dim=1).reshape(-1)  # [N]
    uniforms = torch.rand(num_positions, generator=g)
    log_u = torch.empty(num_positions, vocab_size).uniform_(1e-20, 1.0, generator=g).log_()
    bonus = exponential_race(target_probs.clone(), {}, g)  # the target's own sample at each position
    is_accepted, fallback = rejection_sample(target_probs, draft_probs, ids, uniforms, log_u)
    row_drafts = drafts.tolist()
    return row_drafts, emit_from_rejection(is_accepted.tolist(), fallback.tolist(), bonus.tolist(), row_drafts)


P = torch.tensor([[0.40, 0.25, 0.15, 0.10, 0.07, 0.03],
                  [0.05, 0.10, 0.50, 0.05, 0.30, 0.00],
                  [0.10, 0.20, 0.30, 0.20, 0.10, 0.10]])
Q_CASES = {
    "q_near_p": torch.tensor([[0.30, 0.30, 0.20, 0.10, 0.05, 0.05],
                              [0.10, 0.10, 0.40, 0.10, 0.20, 0.10]]),
    "q_far_from_p": torch.tensor([[0.00, 0.02, 0.03, 0.05, 0.40, 0.50],  # mass where p has little
                                  [0.45, 0.45, 0.00, 0.00, 0.00, 0.10]]),  # incl. token 5, p_1(5) = 0
    "q_equals_p": P[:2].clone(),
    "q_point_mass": torch.tensor([[0.0, 0.0, 1.0, 0.0, 0.0, 0.0],
                                  [0.0, 0.0, 0.0, 0.0, 1.0, 0.0]]),
}


@pytest.mark.parametrize("case", list(Q_CASES))
def test_emitted_tokens_follow_p(case):
    q = Q_CASES[case]
    num_rows = 30000
    drafts, emitted = draw_and_verify(P, q, num_rows, seed=sorted(Q_CASES).index(case))
    assert all(1 <= len(e) <= 3 and e[:len(e) - 1] == d[:len(e) - 1] for d, e in zip(drafts, emitted))
    assert_follows([e[0] for e in emitted], P[0].numpy())
    # the second token, given the first draft was accepted, follows p_1 (the prefix does not matter here)
    assert_follows([e[1] for e in emitted if len(e) >= 2], P[1].numpy())
    assert_follows([e[2] for e in emitted if len(e) == 3], P[2].numpy())
    # acceptance rate of the first draft: sum_x min(p_0(x), q_0(x)) (one minus the total variation)
    rate = float(torch.minimum(P[0], q[0]).sum())
    assert_binomial(sum(len(e) >= 2 for e in emitted), num_rows, min(rate, 1.0))
    if case == "q_equals_p":
        assert all(len(e) == 3 for e in emitted)


def test_first_token_given_the_draft_follows_the_papers_law():
    # Finer than the marginal: given draft d, the first token is d with probability min(1, p/q)(d),
    # else a sample of the residual. Checked per draft value for q far from p.
    q = Q_CASES["q_far_from_p"]
    drafts, emitted = draw_and_verify(P, q, 30000, seed=7)
    p0, q0 = P[0].double().numpy(), q[0].double().numpy()
    residual = np.maximum(0.0, p0 - q0)
    residual /= residual.sum()
    for d in range(6):
        rows = [e for row_d, e in zip(drafts, emitted) if row_d[0] == d]
        if q0[d] == 0:
            assert not rows
            continue
        accept = min(1.0, p0[d] / q0[d])
        assert_binomial(sum(len(e) >= 2 for e in rows), len(rows), accept)
        if accept < 1.0 and len(rows) * (1 - accept) > 1500:
            assert_follows([e[0] for e in rows if len(e) == 1], residual)


# ---------------------------------------------------------------------------------------------------
# Point-mass drafts (n-gram, greedy): keep d where the target's own sample equals it.


def test_point_drafts_follow_p_and_accept_at_rate_p_of_d():
    num_rows, k = 30000, 2
    g = torch.Generator().manual_seed(3)
    draft_law = torch.tensor([0.05, 0.30, 0.10, 0.25, 0.20, 0.10])
    drafts = torch.multinomial(draft_law, num_rows * k, replacement=True, generator=g).reshape(num_rows, k)
    target = exponential_race(P.repeat(num_rows, 1), {}, g).tolist()  # [R * (k + 1)], rows of p_0, p_1, p_2
    row_drafts = drafts.tolist()
    emitted = accept_point_drafts(target, row_drafts)
    assert all(e == target[i * (k + 1):i * (k + 1) + len(e)] for i, e in enumerate(emitted))
    assert_follows([e[0] for e in emitted], P[0].numpy())
    assert_follows([e[1] for e in emitted if len(e) >= 2], P[1].numpy())
    for d in range(6):  # accepted with probability p_0(d), whatever d's own law
        rows = [e for row_d, e in zip(row_drafts, emitted) if row_d[0] == d]
        assert_binomial(sum(len(e) >= 2 for e in rows), len(rows), float(P[0, d]))
    # on rejection, the emitted token follows p_0 without d: checked for the most frequent draft
    rejected = [e[0] for row_d, e in zip(row_drafts, emitted) if row_d[0] == 1 and len(e) == 1]
    without_d = P[0].clone()
    without_d[1] = 0
    assert_follows(rejected, without_d.numpy())
