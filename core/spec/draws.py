"""Random draws of speculative decoding, keyed like the engine's sampler.

Every draw comes from a generator keyed by (completion seed, token position, purpose), never from a shared
stream: a request's drafts, acceptance tests and resamples depend on nothing else in the batch, and an
empty draft leaves the plain sampler's (seed, position) draw untouched.
"""

from __future__ import annotations

import hashlib

import torch

from deepinfer.engine.sampler import apply_filters
from deepinfer.engine.sampling_params import SamplingParams


def keyed_generator(seed: int, position: int, purpose: str) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{position}:{purpose}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))


def uniform(seed: int, position: int, purpose: str) -> float:
    return float(torch.rand((), generator=keyed_generator(seed, position, purpose)))


def draw_rows(probs: torch.Tensor, seeds: list[int], positions: list[int], purpose: str) -> list[int]:
    """A token from each row of probs [R, V] by inverse CDF with one keyed uniform per row (a vocabulary of
    exponentials per draft token, as the plain sampler's race uses, costs ~50x more on a CPU); zero-probability
    tokens are never drawn. The CDFs and searches run batched: per row they cost more than the uniform."""
    cdf = probs.double().cumsum(-1)
    total = cdf[:, -1:]
    u = torch.tensor([uniform(s, p, purpose) for s, p in zip(seeds, positions)], dtype=torch.float64, device=cdf.device)
    # u < 1, but u * total may round up to total: kept below it, the search lands where the CDF steps up, which
    # only a token of positive probability does (never past the end or on a zero-probability tail)
    x = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))
    return torch.searchsorted(cdf, x, right=True)[:, 0].tolist()


def draw(probs: torch.Tensor, seed: int, position: int, purpose: str) -> int:
    """draw_rows() for one distribution probs [V]."""
    return draw_rows(probs[None], [seed], [position], purpose)[0]


def draft_distribution(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The draft distribution q for a sampled request: the request's temperature and top-k/p/min-p applied to
    the drafter's logits (any q keeps verification lossless; matching the target's processing raises acceptance)."""
    return apply_filters(logits.float(), params).softmax(-1)


def choose(logits: torch.Tensor, params: SamplingParams, seed: int, position: int) -> tuple[int, torch.Tensor | None]:
    """Draft token at `position` from drafter logits [V]: argmax for greedy requests (no distribution needed),
    else a keyed draw from q, returned with q."""
    if params.greedy:
        return int(torch.argmax(logits)), None
    q = draft_distribution(logits, params)
    return draw(q, seed, position, "draft"), q


def temperature_only(params: SamplingParams) -> bool:
    """No top-k / top-p / min-p: the processed distribution is a plain softmax at the temperature."""
    return (params.top_k <= 0 or params.top_k == -1) and params.top_p >= 1.0 and params.min_p <= 0.0


def choose_rows(logits: torch.Tensor, params: list[SamplingParams], seeds: list[int],
                positions: list[int]) -> tuple[list[int], list[torch.Tensor | None]]:
    """choose() for each row of logits [R, V]; greedy rows take one batched argmax, temperature-only rows one
    batched softmax and draw (the uniforms stay keyed per row)."""
    tokens: list[int] = torch.argmax(logits, dim=-1).tolist()
    probs: list[torch.Tensor | None] = [None] * len(tokens)
    plain = [i for i, p in enumerate(params) if not p.greedy and temperature_only(p)]
    if plain:
        temps = torch.tensor([params[i].temperature for i in plain], dtype=torch.float32, device=logits.device)
        q = (logits[plain].float() / temps[:, None]).softmax(-1)
        drawn = draw_rows(q, [seeds[i] for i in plain], [positions[i] for i in plain], "draft")
        for j, i in enumerate(plain):
            probs[i], tokens[i] = q[j], drawn[j]
    for i, p in enumerate(params):
        if not p.greedy and not temperature_only(p):
            tokens[i], probs[i] = choose(logits[i], p, seeds[i], positions[i])
    return tokens, probs
