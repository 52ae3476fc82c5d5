"""Token sampling from float32 logits, one row per sequence.

Order, as in vLLM: penalties (repetition, frequency, presence) and min_tokens on the raw logits, then
temperature, top-k, top-p and min-p, then a draw. The draw is an exponential race (argmax p / E with
E ~ Exp(1)) whose noise comes from a generator keyed by (request seed, token position): a request's tokens
depend on nothing else in the batch, nor on preemption and recomputation. Log-probabilities reported to
the user are those of the raw model distribution.
"""

from __future__ import annotations

import hashlib
from collections import Counter
from collections.abc import Sequence

import torch

from deepinfer.engine.outputs import Logprob, PositionLogprobs
from deepinfer.engine.sampling_params import SamplingParams


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> torch.Tensor:
    """One row [V]: repetition penalty over prompt + output tokens, frequency and presence over output tokens."""
    if params.repetition_penalty == 1.0 and not params.frequency_penalty and not params.presence_penalty:
        return logits
    x = logits.clone()
    if params.repetition_penalty != 1.0:
        seen = torch.tensor(sorted(set(prompt_ids) | set(output_ids)), dtype=torch.long, device=x.device)
        vals = x[seen]
        x[seen] = torch.where(vals > 0, vals / params.repetition_penalty, vals * params.repetition_penalty)
    if output_ids and (params.frequency_penalty or params.presence_penalty):
        counts = Counter(output_ids)
        ids = torch.tensor(list(counts), dtype=torch.long, device=x.device)
        freq = torch.tensor(list(counts.values()), dtype=x.dtype, device=x.device)
        x[ids] -= params.frequency_penalty * freq + params.presence_penalty
    return x


def apply_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """One row [V] -> temperature-scaled, top-k / top-p / min-p filtered logits (-inf outside)."""
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


def position_generator(seed: int, position: int) -> torch.Generator:
    """A CPU generator keyed by (seed, position): the same draw whatever else runs."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def sample_token(
    logits: torch.Tensor,
    params: SamplingParams,
    seed: int,
    position: int,
    prompt_ids: Sequence[int],
    output_ids: Sequence[int],
    suppressed_ids: Sequence[int] = (),
) -> int:
    """Pick the token at `position` (its index in the whole sequence) from raw logits [V]."""
    x = apply_penalties(logits.float(), params, prompt_ids, output_ids)
    if suppressed_ids:  # min_tokens not reached: end-of-sequence and stop ids may not be chosen
        x = x.clone()
        x[torch.tensor(list(suppressed_ids), dtype=torch.long, device=x.device)] = float("-inf")
    if params.greedy:
        return int(torch.argmax(x))
    probs = apply_filters(x, params).softmax(-1)
    noise = torch.empty(probs.shape, dtype=torch.float32).exponential_(generator=position_generator(seed, position))
    return int(torch.argmax(probs / noise.to(probs.device)))


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
