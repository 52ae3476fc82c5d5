"""Token sampling from float32 logits: greedy, temperature, top-k, top-p, min-p, per-request seeds, logprobs.

Randomness is drawn per request from its own generator (exponential-race sampling: argmax p / E with
E ~ Exp(1)), so a seeded request's tokens do not depend on what else is in the batch.
"""

from __future__ import annotations

import torch

from deepinfer.engine.outputs import Logprob, PositionLogprobs
from deepinfer.engine.sampling_params import SamplingParams


def apply_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row's logits [V] -> temperature-scaled, top-k / top-p / min-p filtered logits (-inf outside)."""
    x = logits / params.temperature
    vocab = x.shape[-1]
    if 0 < params.top_k < vocab:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_x, order = torch.sort(x, descending=True)
        probs = sorted_x.softmax(-1)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing the threshold included).
        drop = probs.cumsum(-1) - probs >= params.top_p
        drop[0] = False
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if params.min_p > 0.0:
        probs = x.softmax(-1)
        x = x.masked_fill(probs < params.min_p * probs.max(), float("-inf"))
    return x


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> int:
    if params.greedy:
        return int(torch.argmax(logits))
    probs = apply_filters(logits.float(), params).softmax(-1)
    noise = torch.empty_like(probs, device="cpu").exponential_(generator=generator).to(probs.device)
    return int(torch.argmax(probs / noise))


def position_logprobs(logprobs_row: torch.Tensor, chosen: int, top_n: int) -> PositionLogprobs:
    """The chosen token's log-probability and rank, plus the top_n most likely tokens."""
    chosen_lp = logprobs_row[chosen]
    rank = int((logprobs_row > chosen_lp).sum()) + 1
    out = {chosen: Logprob(float(chosen_lp), rank)}
    if top_n:
        values, ids = torch.topk(logprobs_row, top_n)
        for r, (v, i) in enumerate(zip(values.tolist(), ids.tolist()), start=1):
            out.setdefault(i, Logprob(v, r))
    return out
