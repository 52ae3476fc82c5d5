"""The drafter interface: what every speculative drafter (MTP, DSpark) offers the engine.

A step of speculative decoding, seen from the drafter:
  1. `propose` (after the scheduler has reserved lookahead cache slots): for each decoding sequence, draft
     up to `max_tokens` tokens after its anchor (the last token, not yet run through the target).
  2. the target verifies the drafts in one forward (each sequence its own draft length);
  3. `observe`: the target's hidden states (final, and any `capture_layers`) of every position the step
     computed and kept (prefill chunks, anchors and accepted drafts), with the token that follows each
     position, so the drafter can extend its own state (MTP cache entries, DSpark context features).
Drafters keep per-sequence state keyed by sequence id; `fork` and `release` keep it in step with the engine.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.errors import DeepInferError


class SpeculativeError(DeepInferError, RuntimeError):
    """Speculative decoding cannot run as configured (missing drafter files, no MTP layer, bad state)."""


@dataclass(frozen=True)
class DraftRequest:
    """One decoding sequence that may receive drafts this step."""

    seq_id: str
    anchor: int  # the sequence's last token, at `position`; its KV is written by this step's target forward
    position: int
    max_tokens: int  # draft at most this many tokens (lookahead slots, request cap, engine k)
    params: SamplingParams
    seed: int  # the completion's own seed (draft draws are keyed by it and the position)
    block_table: tuple[int, ...]


@dataclass
class Proposal:
    """Drafts for one sequence: tokens d_1..d_n; for a sampled request the distributions they were drawn
    from (q_1..q_n, [n, vocab] float32: the verifier's rejection test needs them); for a drafter with a
    confidence head the raw per-position confidences c_1..c_n (probability that d_k survives given d_<k did)."""

    tokens: list[int]
    probs: torch.Tensor | None = None
    confidence: list[float] | None = None

    def truncate(self, n: int) -> Proposal:
        return Proposal(self.tokens[:n], None if self.probs is None else self.probs[:n],
                        None if self.confidence is None else self.confidence[:n])


@dataclass(frozen=True)
class Observation:
    """Positions [start, start + n) of one sequence that this step computed and kept (n >= 1).

    rows: the index of `start` in the step's flattened token rows (hidden / captured tensors);
    next_ids: the token at position p + 1 for each kept position p (known once the step has sampled)."""

    seq_id: str
    start: int
    rows: int
    next_ids: tuple[int, ...]
    block_table: tuple[int, ...]

    @property
    def count(self) -> int:
        return len(self.next_ids)


class Drafter(ABC):
    """Proposes draft tokens; see the module docstring for the protocol."""

    name: str = "drafter"
    capture_layers: tuple[int, ...] = ()  # target layers whose outputs observe() needs
    has_confidence: bool = False  # proposals carry confidences (prefix scheduling applies)

    @property
    @abstractmethod
    def max_draft_tokens(self) -> int:
        """The longest draft this drafter makes."""

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[Proposal]:
        """One proposal per request, in order (possibly empty when the drafter has no state for it yet)."""

    @abstractmethod
    def observe(self, observations: list[Observation], hidden: torch.Tensor, captured: tuple[torch.Tensor, ...]) -> None:
        """Extend per-sequence state with this step's kept positions (rows of hidden / captured)."""

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> None:
        """A child sequence shares the parent's first num_tokens computed positions."""

    def release(self, seq_id: str) -> None:
        """Forget a finished, aborted or preempted sequence."""
