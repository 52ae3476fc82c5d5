"""The speculator's pause: under Algorithm 1, steps decode without drafting while drafting does not pay (the
drafter's pass costs more than the expected extra tokens bring), with a doubling back-off between probe steps,
and drafting resumes as soon as a probe step pays. Plain Python: a drafter with fixed confidences, step times
from an affine SPS curve plus chosen overheads."""

from __future__ import annotations

import pytest

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.spec.drafter import Drafter, DraftRequest, Proposal
from deepinfer.spec.prefix_scheduler import PrefixScheduler, survival
from deepinfer.spec.speculator import MIN_TIMED_STEPS, PAUSE_MAX_STEPS, Speculator
from deepinfer.spec.sps_profile import SPSCurve

SEQS = 8


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class FixedDrafter(Drafter):
    """The same confidences for every draft; its pass takes `cost` seconds of the simulated clock."""

    name = "fixed-confidence"
    has_confidence = True

    def __init__(self, confidence: list[float], clock: Clock):
        self.confidence, self.clock, self.cost = confidence, clock, 0.0

    @property
    def max_draft_tokens(self) -> int:
        return len(self.confidence)

    def propose(self, requests):
        self.clock.now += self.cost
        return [Proposal([3] * r.max_tokens, None, self.confidence[: r.max_tokens]) for r in requests]

    def observe(self, observations, hidden, captured):
        pass


def requests():
    params = SamplingParams(max_tokens=64, temperature=0.0)
    return [DraftRequest(f"s{i}", 5, 10, 4, params, i, (0,)) for i in range(SEQS)]


def speculator(confidence: list[float], curve: SPSCurve) -> Speculator:
    clock = Clock()
    return Speculator(FixedDrafter(confidence, clock), PrefixScheduler("hardware", curve=curve), clock=clock)


def drive(spec: Speculator, curve: SPSCurve, draft_cost: float, other: float, steps: int) -> list[bool]:
    """Run `steps` engine steps of SEQS decoding sequences; a step costs the curve's forward time for its tokens,
    `other` seconds, and draft_cost more when it drafted. Returns whether each step drafted."""
    spec.drafter.cost = draft_cost
    drafted = []
    for _ in range(steps):
        drafts = spec.propose(requests(), SEQS, SEQS)
        tokens = SEQS + sum(len(d.proposal.tokens) for d in drafts.values())
        drafted.append(bool(drafts))
        spec.step_done(curve.time(tokens) + other + (draft_cost if drafts else 0.0), tokens)
    return drafted


@pytest.mark.parametrize("confidence", [[0.9, 0.8, 0.7, 0.6], [0.5, 0.5, 0.5, 0.5]])
def test_drafting_pauses_when_it_does_not_pay_and_backs_off(confidence):
    # The forward grows steeply with tokens and the drafter's pass is dear: plain decoding wins.
    curve = SPSCurve(tuple((b, 0.01 + 0.001 * b) for b in (1, 8, 16, 32, 64)))
    spec = speculator(confidence, curve)
    # Drafted steps until the overheads are measured (the judgement comes after a step's drafting), then
    # probes after pauses of 1, 2, 4, 8 steps.
    pattern = [True] * (MIN_TIMED_STEPS + 1) + [False] + [True] + [False] * 2 + [True] + [False] * 4 + [True] + [False] * 8
    drafted = drive(spec, curve, draft_cost=0.05, other=0.002, steps=len(pattern))
    assert drafted == pattern
    assert spec.metrics.snapshot().num_paused_steps == 1 + 2 + 4 + 8
    # The pause never grows past its cap.
    drafted = drive(spec, curve, draft_cost=0.05, other=0.002, steps=4 * PAUSE_MAX_STEPS)
    gaps = [len(run) for run in "".join("d" if d else "." for d in drafted).split("d") if run]
    assert max(gaps) == PAUSE_MAX_STEPS


def test_drafting_goes_on_while_it_pays_and_resumes_when_it_pays_again():
    curve = SPSCurve(tuple((b, 0.02 + 0.00002 * b) for b in (1, 8, 16, 32, 64)))  # verification nearly free
    spec = speculator([0.95, 0.9, 0.85, 0.8], curve)
    assert all(drive(spec, curve, draft_cost=0.004, other=0.002, steps=30))
    assert spec.metrics.snapshot().num_paused_steps == 0
    # The drafter turns dear (a loaded machine): drafting pauses; cheap again: the next probe resumes it.
    drafted = drive(spec, curve, draft_cost=0.2, other=0.002, steps=60)
    assert not all(drafted[-20:])
    drive_until_probe = drive(spec, curve, draft_cost=0.004, other=0.002, steps=2 * PAUSE_MAX_STEPS + 10)
    assert all(drive_until_probe[-10:])


def test_the_judgement_weighs_algorithm_1s_expectation():
    """The pause compares Algorithm 1's expected tokens per second with the plain step's, nothing else: at
    break-even costs one side of it pauses and the other does not."""
    curve = SPSCurve(tuple((b, 0.01 + 0.0005 * b) for b in (1, 8, 16, 32, 64)))
    conf = [0.9, 0.8, 0.7, 0.6]
    lengths = PrefixScheduler("hardware", curve=curve).lengths([conf] * SEQS, [4] * SEQS, SEQS, SEQS, 0.002)
    tokens, expected = SEQS + sum(lengths), SEQS + SEQS * sum(survival(conf[: lengths[0]]))
    # Drafting costs d: drafted rate expected / (T(tokens) + other + d) equals the plain rate at d = even.
    other = 0.002
    even = expected * (curve.time(SEQS) + other) / SEQS - curve.time(tokens) - other
    for draft_cost, pauses in ((even * 0.9, False), (even * 1.1, True)):
        spec = speculator(conf, curve)
        drafted = drive(spec, curve, draft_cost, other, steps=MIN_TIMED_STEPS + 2)
        assert (not drafted[-1]) == pauses
