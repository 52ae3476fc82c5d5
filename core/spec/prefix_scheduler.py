"""Verification length per request: fixed block, static confidence threshold, or the paper's Algorithm 1.

All three take calibrated conditional confidences c_{r,1..n_r} (the survival of token j given tokens < j
survived) and return prefix lengths. Each decides whether token j is verified from a_{r,1..j} only
(a_{r,j} = prod_{i<=j} c_{r,i} depends on the drafts before j, never on d_j itself), which is the
non-anticipating property that keeps rejection sampling lossless (paper sec. 3.2.2 and appendix A).

Algorithm 1 (hardware-aware prefix scheduler): the step sends B tokens to the target (prefill chunks and
anchors included) and expects tau accepted tokens (one per sampling sequence plus sum of admitted a_{r,j});
draft tokens are admitted across the whole batch in descending a_{r,j} while tau * SPS(B) keeps growing,
stopping at the first admission that does not raise it (the early stop is what keeps it causal). SPS(B)
comes from sps_profile.SPSCurve (or, as the engine profiles it, an SPSTable read at the step's sequence count:
along the path the sequences are fixed and only the tokens grow), whose time curve is made convex so that the
objective is unimodal and the early stop finds the same optimum a global search would (the paper's sec. 5.2 reaches jagged curves by an
asynchronous global search instead; this engine is synchronous, so it keeps the causal form). The profile
times the target forward alone; `overhead` adds the rest of an engine step (drafting, sampling, scheduling),
measured on past steps, so that SPS is the engine's steps per second as the paper defines it. A constant
added to a convex time keeps the objective unimodal.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from deepinfer.errors import ConfigError
from deepinfer.spec.sps_profile import SPSCurve, SPSTable


def survival(confidence: Sequence[float]) -> list[float]:
    out, a = [], 1.0
    for c in confidence:
        a *= c
        out.append(a)
    return out


def threshold_lengths(confidences: Sequence[Sequence[float]], threshold: float) -> list[int]:
    """Verify each request's drafts while its cumulative survival stays >= threshold (0 keeps the block)."""
    lengths = []
    for conf in confidences:
        n = 0
        for a in survival(conf):
            if a < threshold:
                break
            n += 1
        lengths.append(n)
    return lengths


def hardware_aware_lengths(confidences: Sequence[Sequence[float]], curve: SPSCurve, base_tokens: int,
                           base_accepts: float, overhead: float = 0.0) -> list[int]:
    """Algorithm 1. base_tokens: tokens of the step before any draft (>= 1); base_accepts: tokens the step
    yields for sure (one per sampling sequence); overhead: seconds a step spends outside the forward."""
    if base_tokens < 1:
        raise ConfigError(f"hardware-aware scheduling needs base_tokens >= 1, got {base_tokens}")
    candidates = []
    for r, conf in enumerate(confidences):
        for j, a in enumerate(survival(conf)):
            if not a > 0.0:
                break  # survival never grows again
            candidates.append((-a, r, j))
    candidates.sort()  # descending survival; ties by request then position, so prefixes stay prefixes
    lengths = [0] * len(confidences)
    batch, tau = base_tokens, float(base_accepts)

    def sps(tokens: int) -> float:
        return 1.0 / (curve.time(tokens) + overhead)

    best = tau * sps(batch)
    for neg_a, r, j in candidates:
        theta = (tau - neg_a) * sps(batch + 1)
        if not theta > best:
            break
        batch, tau, best = batch + 1, tau - neg_a, theta
        lengths[r] = j + 1
    return lengths


@dataclass(frozen=True)
class PrefixScheduler:
    """mode 'fixed' (verify every proposed token), 'threshold' or 'hardware' (Algorithm 1, needs a curve)."""

    mode: str
    threshold: float = 0.0
    curve: SPSCurve | SPSTable | None = None

    def __post_init__(self) -> None:
        if self.mode not in ("fixed", "threshold", "hardware"):
            raise ConfigError(f"prefix scheduler mode must be fixed, threshold or hardware, got {self.mode!r}")
        if self.mode == "threshold" and not (0.0 <= self.threshold <= 1.0 and math.isfinite(self.threshold)):
            raise ConfigError(f"confidence threshold must be in [0, 1], got {self.threshold}")
        if self.mode == "hardware" and self.curve is None:
            raise ConfigError("the hardware-aware prefix scheduler needs an SPS curve")

    def lengths(self, confidences: Sequence[Sequence[float] | None], proposed: Sequence[int], base_tokens: int,
                base_accepts: float, overhead: float = 0.0, num_seqs: int | None = None) -> list[int]:
        """Verification lengths; a request without confidences keeps its whole proposal. num_seqs: sequences in
        the step (reads an SPSTable's row; default: the requests given)."""
        if self.mode == "fixed":
            return list(proposed)
        scored = [i for i, c in enumerate(confidences) if c is not None]
        out = list(proposed)
        if not scored:
            return out
        conf = [confidences[i][: proposed[i]] for i in scored]
        if self.mode == "threshold":
            cut = threshold_lengths(conf, self.threshold)
        else:
            unscored = sum(proposed[i] for i in range(len(proposed)) if confidences[i] is None)
            curve = self.curve
            if isinstance(curve, SPSTable):
                curve = curve.for_seqs(max(1, num_seqs if num_seqs is not None else len(confidences)))
            cut = hardware_aware_lengths(conf, curve, base_tokens + unscored, base_accepts, overhead)
        for i, n in zip(scored, cut):
            out[i] = n
        return out
