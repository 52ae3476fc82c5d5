"""The sampler against math: filtered distributions computed independently in numpy, chi-square tests of the
keyed exponential race, and the batched path equal to the one-row path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare, kstest

from deepinfer.engine.sampler import exponential_from_bits_, keyed_exponential, sample_rows, sample_token
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import InvalidInputError


def expected_probs(logits: np.ndarray, p: SamplingParams) -> np.ndarray:
    """Temperature, top-k, top-p (smallest prefix reaching top_p, crossing token kept), min-p: by definition."""
    x = logits.astype(np.float64) / p.temperature
    keep = np.ones_like(x, dtype=bool)
    if 0 < p.top_k < len(x):
        keep &= x >= np.sort(x)[::-1][p.top_k - 1]
    order = np.argsort(-x, kind="stable")
    if p.top_p < 1.0:
        probs = np.where(keep, np.exp(x - x.max()), 0.0)
        probs /= probs.sum()
        mass = 0.0
        for i in order:
            if not keep[i]:
                continue
            if mass >= p.top_p:
                keep[i] = False
            mass += probs[i]
    probs = np.where(keep, np.exp(x - x.max()), 0.0)
    probs /= probs.sum()
    if p.min_p > 0:
        probs = np.where(probs >= p.min_p * probs.max(), probs, 0.0)
        probs /= probs.sum()
    return probs


CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6, top_k=4),
    SamplingParams(temperature=1.3, top_p=0.7),
    SamplingParams(temperature=0.9, top_k=6, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("case", range(len(CASES)))
def test_sampled_tokens_follow_the_filtered_distribution(case, gen):
    params = CASES[case]
    vocab, draws = 10, 6000
    logits = torch.randn(vocab, generator=gen) * 1.5
    want = expected_probs(logits.numpy(), params)
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    # The batched path: many positions of one request at once (each row its own keyed noise).
    tokens = sample_rows(logits.expand(draws, vocab), [params] * draws, [seed] * draws, list(range(draws)))
    counts = np.bincount(tokens, minlength=vocab)
    assert counts[want == 0].sum() == 0, "a filtered-out token was sampled"
    nz = want > 0
    if nz.sum() > 1:  # (one survivor: every draw is it, checked above)
        assert chisquare(counts[nz], want[nz] * draws).pvalue > 1e-4


def test_batched_rows_equal_one_row_at_a_time(gen):
    vocab = 50
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_k=5), SamplingParams(top_p=0.5),
              SamplingParams(temperature=1.2, min_p=0.1), SamplingParams(temperature=0.0), SamplingParams(top_k=1)]
    logits = torch.randn(len(params), vocab, generator=gen)
    seeds = torch.randint(0, 2**40, (len(params),), generator=gen).tolist()
    positions = torch.randint(0, 5000, (len(params),), generator=gen).tolist()
    batched = sample_rows(logits, params, seeds, positions)
    single = [sample_token(logits[i], p, seeds[i], positions[i], [], []) for i, p in enumerate(params)]
    assert batched == single
    assert batched[0] == int(logits[0].argmax()) and batched[5] == int(logits[5].argmax())
    # A row's draw does not depend on the rows beside it.
    order = list(reversed(range(len(params))))
    shuffled = sample_rows(logits[order], [params[i] for i in order], [seeds[i] for i in order], [positions[i] for i in order])
    assert shuffled == [batched[i] for i in order]


def test_keyed_noise_is_exponential_and_keyed(gen):
    seed = int(torch.randint(0, 2**62, (), generator=gen))
    noise = keyed_exponential([seed, seed, seed + 1], [7, 8, 7], 20000, "cpu")
    for row in noise:
        assert kstest(row.numpy(), "expon").pvalue > 1e-4
    assert not torch.equal(noise[0], noise[1]) and not torch.equal(noise[0], noise[2])
    # Neighbouring rows and columns are uncorrelated.
    assert abs(float(torch.corrcoef(noise[:2])[0, 1])) < 0.05
    assert abs(float(torch.corrcoef(torch.stack([noise[0, :-1], noise[0, 1:]]))[0, 1])) < 0.05
    assert torch.equal(keyed_exponential([seed], [7], 20000, "cpu")[0], noise[0])


def test_every_hash_value_gives_a_finite_positive_draw(gen):
    """The race divides by the draw: a draw of 0 makes p / 0 = inf for a kept token and 0 / 0 = NaN (which argmax
    takes) for a filtered one. Every one of the 2**23 values the draw depends on, at both ends of its bit range."""
    top = torch.arange(1 << 23, dtype=torch.int64)
    for low in (0, (1 << 9) - 1, int(torch.randint(0, 1 << 9, (), generator=gen))):
        draws = exponential_from_bits_((top << 9) | low)
        assert torch.isfinite(draws).all() and (draws > 0).all()
        assert draws.max() < 17.0 and draws.min() < 1e-6  # -log(2**-24) ~ 16.6 and -log(1 - 2**-24) ~ 6e-8


def test_filtered_tokens_are_never_sampled_over_a_large_vocabulary(gen):
    """Each row draws once per token: over 2**24 token draws a rare draw value would show up about once."""
    rows, vocab = 32, 1 << 19
    logits = torch.randn(rows, vocab, generator=gen)
    params = [SamplingParams(temperature=1.0, top_k=3) for _ in range(rows)]
    seeds = torch.randint(0, 2**40, (rows,), generator=gen).tolist()
    tokens = sample_rows(logits, params, seeds, list(range(rows)))
    allowed = logits.topk(3, dim=-1).indices
    assert all(t in allowed[r].tolist() for r, t in enumerate(tokens))


def test_penalties_and_suppression_on_the_one_row_path(gen):
    logits = torch.randn(30, generator=gen)
    top = int(logits.argmax())
    greedy = SamplingParams(temperature=0.0)
    assert sample_token(logits, greedy, 1, 0, [], [], suppressed_ids=[top]) != top
    penalised = SamplingParams(temperature=0.0, repetition_penalty=2.0)
    logits[top] = abs(float(logits.max())) + 0.1
    second = int(logits.clone().index_fill_(0, torch.tensor([top]), float("-inf")).argmax())
    if logits[top] / 2.0 < logits[second]:
        assert sample_token(logits, penalised, 1, 0, [top], []) == second


def test_logit_bias_shifts_the_distribution_by_its_bias(gen):
    """Seeded draws over many positions follow softmax((logits + bias) / T), computed in numpy; +100 forces a
    token under greedy decoding and -100 bans the top one; the bias comes before min_tokens suppression."""
    vocab, draws = 10, 6000
    logits = torch.randn(vocab, generator=gen) * 1.5
    tokens = torch.randperm(vocab, generator=gen)[:3].tolist()
    bias = {tokens[0]: 2.0, tokens[1]: -1.5, tokens[2]: 0.7}
    params = SamplingParams(temperature=0.8, logit_bias=bias)
    shifted = logits.numpy().astype(np.float64) + np.array([bias.get(t, 0.0) for t in range(vocab)])
    want = expected_probs(shifted, params)
    seed = int(torch.randint(0, 2**31, (), generator=gen))
    picks = [sample_token(logits, params, seed, pos, [], []) for pos in range(draws)]
    counts = np.bincount(picks, minlength=vocab)
    assert chisquare(counts, want * draws).pvalue > 1e-4
    unbiased = np.bincount([sample_token(logits, SamplingParams(temperature=0.8), seed, pos, [], [])
                            for pos in range(draws)], minlength=vocab)
    assert chisquare(unbiased, want * draws).pvalue < 1e-6  # the test sees a missing bias

    top, low = int(logits.argmax()), int(logits.argmin())
    assert sample_token(logits, SamplingParams(temperature=0.0, logit_bias={low: 100.0}), 1, 0, [], []) == low
    assert sample_token(logits, SamplingParams(temperature=0.0, logit_bias={top: -100.0}), 1, 0, [], []) != top
    forced = SamplingParams(temperature=0.0, logit_bias={low: 100.0})
    assert sample_token(logits, forced, 1, 0, [], [], suppressed_ids=[low]) != low


@pytest.mark.parametrize("bias,match", [({-1: 1.0}, "non-negative"), ({3: 100.5}, r"\[-100, 100\]"),
                                        ({3: "x"}, "numbers"), ([3], "dict"), ({True: 1.0}, "token ids")])
def test_logit_bias_is_checked(bias, match):
    with pytest.raises(InvalidInputError, match=match):
        SamplingParams(logit_bias=bias)
