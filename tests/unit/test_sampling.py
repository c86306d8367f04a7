"""Sampling: greedy cases, batched vs slow reference, seeded determinism, exactness."""

import math

import pytest
import torch

from specd.draws import draw_randomness, make_generator
from specd.logits import (
    argmax_rows,
    bias_row,
    counts_of_paths,
    logits_to_probs,
    onehot_probs,
    presence_of_paths,
    sparse_to_dense,
)
from specd.params import SamplingParams
from specd.sampling import greedy_round, rejection_sample


# -- greedy -------------------------------------------------------------------------------
def test_greedy_hand_made():
    argmax = [5, 6, 7, 8]
    assert greedy_round(argmax, [5, 6, 7]) == ([5, 6, 7, 8], 3, -1)  # all, then the bonus
    assert greedy_round(argmax, [5, 0, 7]) == ([5, 6], 1, -1)  # d_2 rejected: argmax there
    assert greedy_round(argmax, [1, 6, 7]) == ([5], 0, -1)  # a later match does not count
    assert greedy_round([9], []) == ([9], 0, -1)  # k = 0: plain decoding


def test_greedy_reads_the_bonus_after_its_own_k():
    assert greedy_round([1, 2], [1]) == ([1, 2], 1, -1)  # k = 1: the bonus is node 1's
    assert greedy_round([1, 2, 3], [1, 2]) == ([1, 2, 3], 2, -1)


# -- batched vs reference -------------------------------------------------------------------
def reference_round(p, drafts, q, k, u, noise):
    """One sequence, written as the paper states it; p [K+1, V], q [K, V]."""
    out = []
    for j in range(k):
        d = int(drafts[j])
        if u[j] < p[j, d] / q[j, d]:
            out.append(d)
            continue
        residual = torch.clamp(p[j] - q[j], min=0)
        if residual.sum() <= 0:
            residual = p[j]
        out.append(int((residual / residual.sum() / noise).argmax()))
        return out
    out.append(int((p[k] / noise).argmax()))
    return out


def test_batched_matches_reference():
    g = torch.Generator().manual_seed(0)
    n, k_max, v = 64, 5, 20
    p = torch.softmax(torch.randn(n, k_max + 1, v, generator=g) * 2, -1)
    q = torch.softmax(torch.randn(n, k_max, v, generator=g) * 2, -1)
    drafts = torch.multinomial(q.view(-1, v), 1, generator=g).view(n, k_max)
    k = torch.randint(0, k_max + 1, (n,), generator=g)
    u = torch.rand(n, k_max, generator=g)
    noise = torch.empty(n, v).exponential_(generator=g)
    tokens, a, _ = rejection_sample(p, drafts, q, k, u, noise)
    for i in range(n):
        ref = reference_round(p[i], drafts[i], q[i], int(k[i]), u[i], noise[i])
        assert tokens[i, : a[i] + 1].tolist() == ref
        assert (tokens[i, a[i] + 1 :] == -1).all()


def test_seeded_determinism():
    v, k = 50, 4
    p = torch.softmax(torch.randn(3, k + 1, v), -1)
    q = torch.softmax(torch.randn(3, k, v), -1)
    drafts = q.argmax(-1)

    def run(seeds):
        gens = [make_generator(s) for s in seeds]
        u, noise, _ = draw_randomness(gens, [k] * 3, v)
        return rejection_sample(p, drafts, q, torch.tensor([k] * 3), u, noise)[0]

    assert torch.equal(run([1, 2, 3]), run([1, 2, 3]))
    assert not torch.equal(run([1, 2, 3]), run([4, 5, 6]))
    # a request's draws do not depend on its neighbours in the batch
    assert torch.equal(run([7, 2, 3])[0], run([7, 8, 9])[0])


# -- transforms -----------------------------------------------------------------------------
def test_transforms():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    assert logits_to_probs(logits, SamplingParams(temperature=0)).tolist() == [[1, 0, 0, 0, 0]]
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert (p[0, 2:] == 0).all() and math.isclose(float(p.sum()), 1.0, rel_tol=1e-6)
    full = torch.softmax(logits, -1)[0]
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, top_p=float(full[0]) + 1e-3))
    assert (p[0] > 0).tolist() == [True, True, False, False, False]
    p = logits_to_probs(logits, SamplingParams(temperature=1.0, min_p=0.3))
    assert (p[0] > 0).tolist() == [True, True, False, False, False]  # e^-1 > 0.3 > e^-2
    seen = presence_of_paths([0], [[], [1]], 5)
    assert seen.tolist() == [[True, False, False, False, False], [True, True, False, False, False]]
    p = logits_to_probs(
        logits.repeat(2, 1), SamplingParams(temperature=0, repetition_penalty=4), seen
    )
    assert p.argmax(-1).tolist() == [1, 2]  # 3/4 < 2, then 2/4 < 1


def test_a_logit_bias_is_added_before_the_penalties_and_temperature():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]])
    params = SamplingParams(temperature=2.0, logit_bias=((4, 5.0), (0, -100.0), (4, 1.0)))
    bias = bias_row(params, 5)
    assert bias.tolist() == [[-100.0, 0.0, 0.0, 0.0, 6.0]]  # a repeated id adds up
    want = torch.softmax((logits + bias) / 2.0, -1)
    assert torch.allclose(logits_to_probs(logits, params, bias=bias), want)
    greedy = SamplingParams(logit_bias=((2, 2.5),))
    assert logits_to_probs(logits, greedy, bias=bias_row(greedy, 5)).argmax(-1).tolist() == [2]
    assert bias_row(SamplingParams(), 5) is None


def test_frequency_and_presence_penalties_count_the_output_and_each_rows_path():
    """OpenAI's rule on the generated tokens: logit - frequency * count - presence *
    [count > 0]; a tree's node counts its own path beside the output."""
    counts = counts_of_paths([0, 0, 2], [[], [1], [1, 0]], 5)
    assert counts.tolist() == [[2, 0, 1, 0, 0], [2, 1, 1, 0, 0], [3, 1, 1, 0, 0]]
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0, -1.0]]).repeat(3, 1)
    params = SamplingParams(temperature=1.0, presence_penalty=0.5, frequency_penalty=0.25)
    want = logits - 0.25 * counts - 0.5 * (counts > 0).float()
    assert torch.allclose(logits_to_probs(logits, params, counts=counts), torch.softmax(want, -1))
    greedy = SamplingParams(presence_penalty=-2.0)  # a negative penalty favours repeats
    assert logits_to_probs(logits, greedy, counts=counts).argmax(-1).tolist() == [0, 0, 0]
    greedy = SamplingParams(frequency_penalty=1.5)
    assert logits_to_probs(logits, greedy, counts=counts).argmax(-1).tolist() == [1, 1, 1]


# -- statistical exactness ------------------------------------------------------------------
V, T = 10, 3  # vocabulary, tokens generated per sample


def chain(params: SamplingParams, seed: int):
    """A toy target and drafter: next-token distributions depend on the last token."""
    g = torch.Generator().manual_seed(seed)
    target_logits = torch.randn(V, V, generator=g) * 1.5
    target = logits_to_probs(target_logits, params)  # [V, V] row = last token
    draft = torch.softmax(target_logits + torch.randn(V, V, generator=g), -1)
    return target, draft


def simulate(target, draft, k, q_kind, n, seed, corrupt=0.0):
    """Generate T tokens for n samples by speculation rounds; returns [n, T]."""
    g = torch.Generator().manual_seed(seed)
    out = torch.zeros(n, T + k + 1, dtype=torch.long)
    length = torch.zeros(n, dtype=torch.long)
    last = torch.zeros(n, dtype=torch.long)
    if q_kind == "sparse":  # the drafter samples from its top-4, renormalised
        vals, ids = draft.topk(4, -1)
        draft = sparse_to_dense(ids, vals / vals.sum(-1, keepdim=True), V)
    elif q_kind == "trimmed":  # a trimmed head: q's support is a fixed half of the vocab
        draft = draft * (torch.arange(V) % 2 == 0)
        draft = draft / draft.sum(-1, keepdim=True)
    while (length < T).any():
        drafts = torch.zeros(n, k, dtype=torch.long)
        prev = last
        for j in range(k):
            row = draft[prev]
            drafts[:, j] = (
                row.argmax(-1)
                if q_kind == "absent"
                else torch.multinomial(row, 1, generator=g)[:, 0]
            )
            prev = drafts[:, j]
        q = (
            onehot_probs(drafts, V)
            if q_kind == "absent"
            else draft[torch.cat([last[:, None], drafts[:, :-1]], 1)]
        )
        p = target[torch.cat([last[:, None], drafts], 1)]  # [n, k+1, V]
        u = torch.rand(n, k, generator=g)
        noise = torch.empty(n, V).exponential_(generator=g)
        tokens, a, _ = rejection_sample(p, drafts, q, torch.full((n,), k), u, noise)
        if corrupt:  # a deliberately wrong sampler: 1 emitted token in 100 is uniform
            flip = torch.rand(n, k + 1, generator=g) < corrupt
            tokens = torch.where(
                flip & (tokens >= 0), torch.randint(0, V, (n, k + 1), generator=g), tokens
            )
        cols = length[:, None] + torch.arange(k + 1)[None, :]
        keep = (torch.arange(k + 1)[None, :] <= a[:, None]) & (length < T)[:, None]
        out.scatter_(
            1,
            cols.clamp(max=out.shape[1] - 1),
            torch.where(keep, tokens, out.gather(1, cols.clamp(max=out.shape[1] - 1))),
        )
        last = torch.where(length < T, tokens[torch.arange(n), a], last)
        length = torch.where(length < T, length + a + 1, length)
    return out[:, :T]


def chi_square_fails(counts: torch.Tensor, expected_p: torch.Tensor, n: int) -> bool:
    """Chi-square goodness of fit at p = 1e-4; tokens of probability 0 must never occur."""
    if (counts[expected_p == 0] > 0).any():
        return True
    expected = expected_p * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum().view(1)])
    exp = torch.cat([expected[big], expected[~big].sum().view(1)])
    obs, exp = obs[exp > 0], exp[exp > 0]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = len(obs) - 1
    z = 3.719  # one-sided 1e-4; Wilson-Hilferty approximation of the chi-square quantile
    crit = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return stat > crit


def exact_distributions(target):
    p1 = target[0]  # context's last token is 0
    pair = p1[:, None] * target  # [V, V] joint of tokens 1 and 2
    p3 = pair.sum(0) @ target
    return p1, pair.flatten(), p3


def fails_exactness(samples, target) -> bool:
    """samples [n, 3] generated after the token 0 by a Markov target [V, V]."""
    n, v = samples.shape[0], target.shape[0]
    p1, pair, p3 = exact_distributions(target)
    c1 = torch.bincount(samples[:, 0], minlength=v).float()
    c12 = torch.bincount(samples[:, 0] * v + samples[:, 1], minlength=v * v).float()
    c3 = torch.bincount(samples[:, 2], minlength=v).float()
    return any(chi_square_fails(c, e, n) for c, e in ((c1, p1), (c12, pair), (c3, p3)))


N = 200_000
CASES = [
    (k, q_kind, params)
    for k in (1, 2, 3, 4)
    for q_kind in ("dense", "sparse", "absent", "trimmed")
    for params in (
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.7, top_k=4),
        SamplingParams(temperature=1.2, top_p=0.8),
    )
    if q_kind == "dense" or params.top_k or k in (1, 3)
]


@pytest.mark.parametrize(
    "k,q_kind,params", CASES, ids=[f"k{k}-{q}-k{p.top_k}-p{p.top_p}" for k, q, p in CASES]
)
def test_emitted_tokens_follow_the_target(k, q_kind, params):
    target, draft = chain(params, seed=k)
    samples = simulate(target, draft, k, q_kind, N, seed=100 + k)
    assert not fails_exactness(samples, target)


@pytest.mark.parametrize("k", [1, 4])
def test_a_one_percent_wrong_sampler_is_caught(k):
    target, draft = chain(SamplingParams(temperature=1.0), seed=k)
    samples = simulate(target, draft, k, "dense", N, seed=7, corrupt=0.01)
    assert fails_exactness(samples, target)


def test_argmax_rows_is_torchs_argmax():
    """The greedy verification's argmax (numpy on the CPU) answers as torch.argmax: the
    first of tied largest values, NaN counting as the largest, strided rows."""
    g = torch.Generator().manual_seed(4)
    rows = torch.randn(6, 1000, generator=g)
    rows[1, [10, 500]] = 9.0  # a tie: the first
    rows[2, 700] = float("nan")
    rows[3] = float("-inf")
    rows[4, :] = 0.0
    for x in (rows, rows[::2], rows[:, 3:]):
        assert torch.equal(argmax_rows(x), x.argmax(-1))
    assert argmax_rows(rows)[1] == 10 and argmax_rows(rows)[2] == 700
