"""Lossless verification: greedy prefix matching, and rejection sampling whose output distribution is the
target's (chi-square on a small-vocabulary toy target/draft pair, fixed seeds: deterministic)."""

from __future__ import annotations

import collections
import itertools

import pytest
import torch
from scipy.stats import chisquare

from deepinfer.engine.sampler import sample_token
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.spec.draws import draw
from deepinfer.spec.drafter import Proposal, SpeculativeError
from deepinfer.spec.prefix_scheduler import survival
from deepinfer.spec.verifier import VerifyContext, verify

V = 4
GEN = torch.Generator().manual_seed(0)
# A toy Markov target and a deliberately different Markov draft: p(next | previous token).
TARGET = torch.randn(V, V, generator=GEN) * 1.5
DRAFT = torch.randn(V, V, generator=GEN) * 1.5
CONF = torch.rand(V, generator=GEN) * 0.6 + 0.3  # a confidence head: c_k from the previous token only


def ctx(params, seed, position, output=(), suppressed=lambda n: (), room=100):
    return VerifyContext(params, seed, position, [0], list(output), suppressed, room)


def speculative_sample(seed: int, params: SamplingParams, k: int, cut, length: int = 3) -> tuple[int, ...]:
    """Speculative decoding of `length` tokens of the toy chain from token 0."""
    out: list[int] = []
    while len(out) < length:
        prev = out[-1] if out else 0
        pos = 1 + len(out)
        drafts, qs, last = [], [], prev
        for i in range(k):
            q = torch.softmax(DRAFT[last] / params.temperature, -1)
            d = draw(q, seed, pos + i, "draft")
            drafts.append(d)
            qs.append(q)
            last = d
        n = cut(prev, drafts)
        rows = torch.stack([TARGET[t] for t in [prev] + drafts[:n]])
        result = verify(rows, Proposal(drafts[:n], torch.stack(qs[:n]) if n else None), ctx(params, seed, pos, out))
        assert 1 <= len(result.tokens) <= n + 1 and result.tokens[: result.num_accepted] == drafts[: result.num_accepted]
        out += result.tokens
    return tuple(out[:length])


def target_joint(params: SamplingParams, length: int = 3) -> dict[tuple[int, ...], float]:
    probs = {}
    for seq in itertools.product(range(V), repeat=length):
        p, prev = 1.0, 0
        for t in seq:
            p *= float(torch.softmax(TARGET[prev] / params.temperature, -1)[t])
            prev = t
        probs[seq] = p
    return probs


def chi_square_pvalue(samples: list[tuple[int, ...]], probs: dict[tuple[int, ...], float]) -> float:
    counts = collections.Counter(samples)
    n = len(samples)
    cells = sorted(probs, key=lambda c: probs[c])
    obs, exp, pool_o, pool_e = [], [], 0, 0.0
    for c in cells:  # pool rare cells so every expected count is >= 5
        if probs[c] * n < 5:
            pool_o, pool_e = pool_o + counts[c], pool_e + probs[c] * n
            continue
        obs.append(counts[c])
        exp.append(probs[c] * n)
    if pool_e:
        obs.append(pool_o)
        exp.append(pool_e)
    total = sum(exp)
    return float(chisquare(obs, [e * n / total for e in exp]).pvalue)


def threshold_cut(threshold):
    """Non-anticipating: token j is verified iff prod_{i<=j} c(d_{i-1}) >= threshold (c_j sees d_{j-1} only)."""
    def cut(prev, drafts):
        conf = [float(CONF[t]) for t in [prev] + drafts[:-1]]
        return sum(1 for a in survival(conf) if a >= threshold)
    return cut


SAMPLES = 6000


@pytest.mark.parametrize("name,k,cut,temperature", [
    ("whole block", 3, lambda prev, d: len(d), 1.0),
    ("threshold cut", 3, threshold_cut(0.3), 1.0),
    ("no drafts", 2, lambda prev, d: 0, 0.8),
])
def test_rejection_sampling_reproduces_the_target_distribution(name, k, cut, temperature):
    params = SamplingParams(temperature=temperature)
    samples = [speculative_sample(seed, params, k, cut) for seed in range(SAMPLES)]
    assert chi_square_pvalue(samples, target_joint(params)) > 1e-3, name


def test_expected_survival_is_the_mean_of_observed_survival():
    """The calibration label: prod_{i<k} min(1, p/q)(d_i) * (1 - TV_k) averages to the observed survival."""
    params = SamplingParams(temperature=1.0)
    expected, observed = torch.zeros(3), torch.zeros(3)
    n = 4000
    for seed in range(n):
        drafts, qs, last = [], [], 0
        for i in range(3):
            q = torch.softmax(DRAFT[last], -1)
            drafts.append(draw(q, seed, 1 + i, "draft"))
            qs.append(q)
            last = drafts[-1]
        rows = torch.stack([TARGET[t] for t in [0] + drafts])
        c = VerifyContext(params, seed, 1, [0], [], lambda m: (), 100, trace=True)
        r = verify(rows, Proposal(drafts, torch.stack(qs)), c)
        expected += torch.tensor(r.expected_survival)
        observed += (torch.arange(1, 4) <= r.num_accepted).float()
    assert torch.allclose(expected / n, observed / n, atol=0.02)


def test_an_anticipating_cut_is_biased_and_the_test_sees_it():
    """The paper's appendix A: admitting d_1 only when d_1 itself looks good skews the output distribution."""
    params = SamplingParams(temperature=1.0)
    favourite = int(torch.argmax(torch.softmax(DRAFT[0], -1)))
    samples = [speculative_sample(seed, params, 1, lambda prev, d: int(d[0] == favourite), length=1)
               for seed in range(SAMPLES)]
    assert chi_square_pvalue(samples, target_joint(params, 1)) < 1e-6


def test_bonus_token_is_the_plain_samplers_draw():
    params = SamplingParams(temperature=0.9, seed=5)
    rows = torch.randn(1, 50)
    plain = sample_token(rows[0], params, 5, 7, [0], [3])
    assert verify(rows, Proposal([]), ctx(params, 5, 7, [3])).tokens == [plain]


def test_greedy_keeps_the_matching_prefix_then_the_targets_token():
    params = SamplingParams(temperature=0.0)
    rows = torch.full((4, 10), -5.0)
    for i, best in enumerate([3, 4, 9, 1]):
        rows[i, best] = 5.0
    assert verify(rows, Proposal([3, 4, 9]), ctx(params, 0, 10)).tokens == [3, 4, 9, 1]  # all + bonus
    r = verify(rows, Proposal([3, 5, 9]), ctx(params, 0, 10))
    assert (r.tokens, r.num_accepted) == ([3, 4], 1)
    r = verify(rows, Proposal([3, 4, 9]), ctx(params, 0, 10, room=2))  # max_len cuts the accepted tokens
    assert (r.tokens, r.num_accepted) == ([3, 4], 1)


def test_greedy_applies_penalties_and_min_tokens_per_position():
    """Row i is processed as the sampler would after d_1..d_i: the repetition penalty sees the drafts, and
    min_tokens suppression follows the output length."""
    params = SamplingParams(temperature=0.0, repetition_penalty=2.0, min_tokens=2, stop_token_ids=[7])
    rows = torch.randn(4, 12, generator=torch.Generator().manual_seed(1))
    rows[:, 7] += 3.0
    banned = lambda n: [7] if n < params.min_tokens else []  # noqa: E731
    out, drafts = [2], []
    for i in range(3):
        drafts.append(sample_token(rows[i], params, 0, 5 + i, [0], out + drafts, banned(len(out) + i)))
    r = verify(rows, Proposal(drafts), ctx(params, 0, 5, out, banned))
    assert r.num_accepted == 3
    assert r.tokens[-1] == sample_token(rows[3], params, 0, 8, [0], out + drafts, banned(4))


def test_bad_inputs_raise_typed_errors():
    params = SamplingParams(temperature=1.0)
    with pytest.raises(SpeculativeError):
        verify(torch.randn(2, 5), Proposal([1, 2]), ctx(params, 0, 1))
    with pytest.raises(SpeculativeError):
        verify(torch.randn(1, 5), Proposal([]), ctx(params, 0, 1, room=0))
    q = torch.zeros(1, 5)
    q[0, 2] = 1.0
    with pytest.raises(SpeculativeError):
        verify(torch.randn(2, 5), Proposal([1], q), ctx(params, 0, 1))


def test_keyed_draws_follow_the_distribution_and_skip_zero_mass():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.2, 0.3, 0.0])
    picks = [draw(probs, seed, 3, "draft") for seed in range(3000)]
    counts = collections.Counter(picks)
    assert set(counts) == {1, 3, 4}
    assert chisquare([counts[1], counts[3], counts[4]], [1500, 600, 900]).pvalue > 1e-3
    assert picks == [draw(probs, seed, 3, "draft") for seed in range(3000)]  # keyed: reproducible
