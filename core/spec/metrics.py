"""Speculative decoding counters, named after vLLM's (drafts, draft tokens, accepted tokens per position).

A "draft" is one sequence-step that speculated (even when the prefix scheduler cut it to nothing: the
round still produced its one target token). Proposed tokens are what the drafter made; draft (verified)
tokens are what the target checked after the prefix scheduler's cut. Mean accepted length counts the
target's own token (bonus or correction), as the DSpark paper and vLLM do.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class SpecDecodeStats:
    num_drafts: int
    num_proposed_tokens: int
    num_draft_tokens: int  # verified by the target
    num_accepted_tokens: int
    accepted_per_position: tuple[int, ...]  # drafts whose token k was accepted (k = 1..K)
    verified_per_position: tuple[int, ...]  # drafts whose token k was verified
    reached_per_position: tuple[int, ...]  # ... verified with tokens 1..k-1 accepted
    draft_seconds: float = 0.0  # wall time in the drafter (its forward passes and draws), summed over steps

    @property
    def mean_accepted_length(self) -> float:
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def verification_waste(self) -> float:
        """Rejected / verified draft tokens: target work spent on tokens that were thrown away."""
        return 1.0 - self.acceptance_rate if self.num_draft_tokens else 0.0

    @property
    def mean_verified_length(self) -> float:
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0

    def position_acceptance(self) -> list[float]:
        """vLLM's per-position acceptance rate: accepted at k / drafts."""
        return [a / self.num_drafts if self.num_drafts else 0.0 for a in self.accepted_per_position]

    def conditional_acceptance(self) -> list[float]:
        """The paper's position-wise conditional acceptance: accepted at k / reached k with 1..k-1 accepted."""
        return [a / r if r else 0.0 for a, r in zip(self.accepted_per_position, self.reached_per_position)]


@dataclass(frozen=True)
class DraftTrace:
    """One draft, for calibration and offline analysis: raw confidences of every proposed token, how many
    were verified and how many accepted."""

    confidence: tuple[float, ...]
    verified: int
    accepted: int
    expected_survival: tuple[float, ...] = ()  # per verified token (see verifier.VerifyResult)


@dataclass
class SpecDecodeMetrics:
    max_positions: int
    record_traces: bool = False
    num_drafts: int = 0
    num_proposed_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted: list[int] = field(default_factory=list)
    verified: list[int] = field(default_factory=list)
    reached: list[int] = field(default_factory=list)
    traces: list[DraftTrace] = field(default_factory=list)
    draft_seconds: float = 0.0

    def __post_init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        k = self.max_positions
        self.num_drafts = self.num_proposed_tokens = self.num_draft_tokens = self.num_accepted_tokens = 0
        self.accepted, self.verified, self.reached = [0] * k, [0] * k, [0] * k
        self.traces = []
        self.draft_seconds = 0.0

    def record_draft_time(self, seconds: float) -> None:
        """A step's drafting took `seconds` (what a round pays whatever its verification keeps)."""
        self.draft_seconds += seconds

    def record(self, proposed: int, verified: int, accepted: int, confidence: list[float] | None = None,
               expected_survival: tuple[float, ...] = ()) -> None:
        self.num_drafts += 1
        self.num_proposed_tokens += proposed
        self.num_draft_tokens += verified
        self.num_accepted_tokens += accepted
        for k in range(verified):
            self.verified[k] += 1
        for k in range(min(accepted + 1, verified)):
            self.reached[k] += 1
        for k in range(accepted):
            self.accepted[k] += 1
        if self.record_traces and confidence is not None:
            self.traces.append(DraftTrace(tuple(confidence), verified, accepted, tuple(expected_survival)))

    def snapshot(self) -> SpecDecodeStats:
        return SpecDecodeStats(self.num_drafts, self.num_proposed_tokens, self.num_draft_tokens,
                               self.num_accepted_tokens, tuple(self.accepted), tuple(self.verified),
                               tuple(self.reached), self.draft_seconds)
