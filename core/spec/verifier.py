"""Lossless verification of one sequence's drafts against the target's logits of the same step.

rows[i] are the target's logits at the anchor (i = 0) and after draft i (i >= 1), so rows[i] scores the token
that follows d_1..d_i. Each row is processed exactly as the plain sampler would process it had d_1..d_i been
generated (penalties over the output so far plus the drafts, logit_bias, min_tokens suppression at that length).

Greedy requests keep the longest prefix of drafts equal to the target's argmax, then the target's own
token. Sampled requests use rejection sampling (Leviathan et al. 2023; Chen et al. 2023): accept d_i with
probability min(1, p_i(d_i) / q_i(d_i)); at the first rejection draw from the normalised residual
max(0, p_i - q_i); when every draft survives, the bonus token is the plain sampler's own keyed draw from
the last row, so an empty draft reproduces non-speculative decoding draw for draw.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from deepinfer.engine.sampler import apply_filters, apply_penalties, needs_row_processing, sample_token
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.spec.draws import draw, temperature_only, uniform
from deepinfer.spec.drafter import Proposal, SpeculativeError


@dataclass(frozen=True)
class VerifyContext:
    """What the plain sampler would know about the sequence: `position` is the index (in the whole sequence)
    of the first token this step adds; `suppressed(n)` the ids banned when the output has n tokens;
    `room` the most tokens the sequence may still take (max_len)."""

    params: SamplingParams
    seed: int
    position: int
    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    suppressed: Callable[[int], Sequence[int]]
    room: int
    trace: bool = False  # also compute every draft's expected survival (calibration data; costs more)


@dataclass(frozen=True)
class VerifyResult:
    tokens: list[int]  # accepted drafts, then the target's token (cut to the sequence's room)
    num_accepted: int  # drafts among `tokens`
    # With ctx.trace: per verified draft k, the probability that d_1..d_k all survive given the drafts
    # d_1..d_{k-1}: prod_{i<k} min(1, p_i(d_i) / q_i(d_i)) * sum_v min(p_k(v), q_k(v)).
    expected_survival: tuple[float, ...] = ()

    @property
    def num_target_tokens(self) -> int:
        return len(self.tokens) - self.num_accepted


def _processed(row: torch.Tensor, ctx: VerifyContext, drafts: list[int], i: int) -> torch.Tensor:
    """rows[i] with penalties and suppression as the sampler applies them after d_1..d_i."""
    out = list(ctx.output_ids) + drafts[:i]
    x = apply_penalties(row.float(), ctx.params, ctx.prompt_ids, out)
    banned = ctx.suppressed(len(ctx.output_ids) + i)
    if banned:
        x = x.clone()
        x[torch.tensor(list(banned), dtype=torch.long, device=x.device)] = float("-inf")
    return x


def _needs_processing(ctx: VerifyContext, n: int) -> bool:
    if needs_row_processing(ctx.params):
        return True
    return any(ctx.suppressed(len(ctx.output_ids) + i) for i in range(n + 1))


def _greedy(rows: torch.Tensor, drafts: list[int], ctx: VerifyContext) -> tuple[list[int], int, tuple[float, ...]]:
    n = len(drafts)
    if _needs_processing(ctx, n):
        picks = [int(torch.argmax(_processed(rows[i], ctx, drafts, i))) for i in range(n + 1)]
    else:
        picks = torch.argmax(rows[: n + 1], dim=-1).tolist()  # one batched argmax: the common case
    accepted = 0
    while accepted < n and drafts[accepted] == picks[accepted]:
        accepted += 1
    survival = tuple(float(accepted >= k) for k in range(1, n + 1)) if ctx.trace else ()
    return drafts[:accepted] + [picks[accepted]], accepted, survival


def _distributions(rows: torch.Tensor, proposal: Proposal, ctx: VerifyContext, i: int,
                   batched: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(p_i, q_i): the target's processed distribution after d_1..d_i and the draft's for d_{i+1}."""
    d = proposal.tokens[i]
    p = batched[i] if batched is not None else apply_filters(_processed(rows[i], ctx, proposal.tokens, i), ctx.params).softmax(-1)
    if proposal.probs is not None:
        q = proposal.probs[i].to(p.device, torch.float32)
    else:  # a deterministic draft is a point mass
        q = torch.zeros_like(p)
        q[d] = 1.0
    return p, q


def _expected_survival(rows, proposal, ctx, batched) -> tuple[float, ...]:
    out, prefix = [], 1.0
    for i, d in enumerate(proposal.tokens):
        p, q = _distributions(rows, proposal, ctx, i, batched)
        out.append(prefix * float(torch.minimum(p, q).sum()))
        prefix *= min(1.0, float(p[d]) / float(q[d]))
    return tuple(out)


def _rejection(rows: torch.Tensor, proposal: Proposal, ctx: VerifyContext) -> tuple[list[int], int, tuple[float, ...]]:
    drafts = proposal.tokens
    batched = None
    if drafts and temperature_only(ctx.params) and not _needs_processing(ctx, len(drafts)):
        batched = (rows[: len(drafts)].float() / ctx.params.temperature).softmax(-1)  # one op for every row
    survival = _expected_survival(rows, proposal, ctx, batched) if ctx.trace else ()
    for i, d in enumerate(drafts):
        pos = ctx.position + i
        p, q = _distributions(rows, proposal, ctx, i, batched)
        qd, pd = float(q[d]), float(p[d])
        if qd <= 0.0:
            raise SpeculativeError(f"draft token {d} at position {pos} has zero draft probability")
        if pd >= qd or uniform(ctx.seed, pos, "accept") * qd < pd:
            continue
        residual = (p - q).clamp_min(0.0)
        total = float(residual.sum())
        # total is 0 only when p == q, where rejection has probability 0; guard float round-off anyway.
        token = draw(residual / total if total > 0 else p, ctx.seed, pos, "residual")
        return drafts[:i] + [token], i, survival
    n = len(drafts)
    out = list(ctx.output_ids) + drafts
    bonus = sample_token(rows[n], ctx.params, ctx.seed, ctx.position + n, ctx.prompt_ids, out,
                         ctx.suppressed(len(ctx.output_ids) + n))
    return drafts + [bonus], n, survival


def verify(rows: torch.Tensor, proposal: Proposal, ctx: VerifyContext) -> VerifyResult:
    """rows: [len(drafts) + 1, vocab] target logits of this sequence's step."""
    n = len(proposal.tokens)
    if rows.shape[0] != n + 1:
        raise SpeculativeError(f"verification needs {n + 1} logit rows for {n} drafts, got {rows.shape[0]}")
    if ctx.room < 1:
        raise SpeculativeError("verify: the sequence has no room for another token")
    if ctx.params.greedy:
        tokens, accepted, survival = _greedy(rows, proposal.tokens, ctx)
    else:
        tokens, accepted, survival = _rejection(rows, proposal, ctx)
    tokens = tokens[: ctx.room]
    return VerifyResult(tokens, min(accepted, len(tokens) - 1), survival)
