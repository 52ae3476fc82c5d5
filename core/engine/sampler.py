"""Token sampling from float32 logits, one row per sequence.

Order, as in vLLM: penalties (repetition, frequency, presence), logit_bias and min_tokens on the raw logits, then
temperature, top-k, top-p and min-p, then a draw. The draw is an exponential race (argmax p / E with
E ~ Exp(1)) whose noise is a counter-based hash of (request seed, token position, token id), computed on the
logits' device: a request's tokens depend on nothing else in the batch, nor on preemption and recomputation,
and a whole batch samples with one copy to the host. Log-probabilities reported to
the user are those of the raw model distribution.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence

import torch

from deepinfer.engine.outputs import Logprob, PositionLogprobs
from deepinfer.engine.sampling_params import SamplingParams
from deepinfer.transfer import to_device

Argmax = Callable[[torch.Tensor], torch.Tensor]


def _torch_argmax(x: torch.Tensor) -> torch.Tensor:
    return torch.argmax(x, dim=-1)


def apply_penalties(logits: torch.Tensor, params: SamplingParams, prompt_ids: Sequence[int], output_ids: Sequence[int]) -> torch.Tensor:
    """One row [V]: repetition penalty over prompt + output tokens, frequency and presence over output tokens."""
    return apply_penalties_rows(logits[None], [params], [prompt_ids], [output_ids], None, [()])[0]


def apply_penalties_rows(logits: torch.Tensor, params: Sequence[SamplingParams], prompt_ids: Sequence[Sequence[int]],
                         output_ids: Sequence[Sequence[int]], pending: torch.Tensor | None,
                         suppressed: Sequence[Sequence[int]]) -> torch.Tensor:
    """Penalties, then logit_bias, then min_tokens suppression (suppressed ids to -inf), for every row of float32
    logits [R, V] at once, on their device: repetition over prompt + output tokens (x / p where x > 0, else
    x * p), then x - (frequency * count + presence * [count > 0]) over output tokens, then x + bias. A row's
    output is output_ids[r] plus, where pending[r] >= 0, one token still on the device (overlapped scheduling)."""
    rows = [r for r, p in enumerate(params) if needs_row_processing(p) or suppressed[r]]
    if not rows:
        return logits
    device, vocab = logits.device, logits.shape[-1]
    x = logits.clone()
    sub = x[rows]
    n = len(rows)
    pairs = [(i, t) for i, r in enumerate(rows) for t in output_ids[r]]
    counts = torch.zeros(n, vocab, dtype=x.dtype, device=device)
    if pairs:
        index = to_device([v for pair in pairs for v in pair], torch.int64, device).view(-1, 2)
        counts.index_put_((index[:, 0], index[:, 1]), torch.ones(len(pairs), dtype=x.dtype, device=device),
                          accumulate=True)
    if pending is not None:
        tok = pending.index_select(0, to_device(rows, torch.int64, device))
        counts.scatter_add_(1, tok.clamp(min=0)[:, None], (tok >= 0).to(x.dtype)[:, None])
    seen = counts > 0
    prompt = [(i, t) for i, r in enumerate(rows) for t in prompt_ids[r]]
    if prompt:
        index = to_device([v for pair in prompt for v in pair], torch.int64, device).view(-1, 2)
        seen[index[:, 0], index[:, 1]] = True
    column = lambda values: to_device(values, x.dtype, device)[:, None]  # noqa: E731
    rep = column([params[r].repetition_penalty for r in rows])
    sub = torch.where(seen & (rep != 1.0), torch.where(sub > 0, sub / rep, sub * rep), sub)
    freq, pres = column([params[r].frequency_penalty for r in rows]), column([params[r].presence_penalty for r in rows])
    sub = sub - (freq * counts + pres * (counts > 0).to(x.dtype))
    biased = [(i, t, b) for i, r in enumerate(rows) for t, b in params[r].logit_bias.items()]
    if biased:
        index = to_device([v for i, t, _ in biased for v in (i, t)], torch.int64, device).view(-1, 2)
        sub = sub.index_put((index[:, 0], index[:, 1]), to_device([b for _, _, b in biased], x.dtype, device),
                            accumulate=True)
    banned = [(i, t) for i, r in enumerate(rows) for t in suppressed[r]]
    if banned:
        index = to_device([v for pair in banned for v in pair], torch.int64, device).view(-1, 2)
        sub[index[:, 0], index[:, 1]] = float("-inf")
    x[rows] = sub
    return x


def apply_filters(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits [V] (or [R, V], every row with these params) -> temperature-scaled, top-k / top-p / min-p
    filtered logits (-inf outside)."""
    rows = logits if logits.dim() == 2 else logits[None]
    out = apply_filters_rows(rows, [params] * rows.shape[0])
    return out if logits.dim() == 2 else out[0]


_MASK32 = 0xFFFFFFFF
_MIX = 0x45D9F3B  # a 32-bit integer-hash multiplier below 2**31: products stay exact in int64


def _mix32_(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche hash of int64 values in [0, 2**32) (two xor-shift-multiply rounds), in place: x is a
    temporary of [R, vocab] values, and allocating each step's result again made the hash ~2.5x slower (CPU)."""
    for _ in range(2):
        x.bitwise_xor_(x >> 16).mul_(_MIX).bitwise_and_(_MASK32)
    return x.bitwise_xor_(x >> 16)


def position_keys(seeds: Sequence[int], positions: Sequence[int]) -> list[tuple[int, int]]:
    """Two 32-bit keys per (seed, position): a cryptographic hash on the host, so nearby seeds and positions
    give unrelated noise."""
    keys = []
    for seed, position in zip(seeds, positions):
        digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
        keys.append((int.from_bytes(digest[:4], "little"), int.from_bytes(digest[4:], "little")))
    return keys


def keyed_exponential(seeds: Sequence[int], positions: Sequence[int], vocab: int, device: torch.device | str) -> torch.Tensor:
    """Exp(1) noise [R, vocab], row r a pure function of (seeds[r], positions[r]) computed on `device` (a
    counter-based hash, no generator state): the same draws on any device and in any batch."""
    keys = to_device([k for pair in position_keys(seeds, positions) for k in pair], torch.int64, device).view(-1, 2)
    index = torch.arange(vocab, dtype=torch.int64, device=device)
    return exponential_from_bits_(_mix32_(_mix32_(index[None, :] ^ keys[:, :1]).bitwise_xor_(keys[:, 1:])))


def exponential_from_bits_(bits: torch.Tensor) -> torch.Tensor:
    """int64 hash values in [0, 2**32) -> Exp(1) float32 draws -log(u), u = (top 23 bits + 0.5) / 2**23, in
    place where it can. u is exact in float32 and lies in [2**-24, 1 - 2**-24]: never 0 or 1, so every draw is
    finite and positive. (With 24 bits the top value plus 0.5 rounded to 2**24, u to 1 and the draw to 0: the
    race's p / E was then inf for any token, and 0 / 0 = NaN, which argmax takes, for a filtered one, one
    token in 2**24 a row: ~0.6% of draws over a 102400-token vocabulary.)"""
    uniform = (bits >> 9).float().add_(0.5).mul_(1.0 / (1 << 23))
    return uniform.log_().neg_()


def apply_filters_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Each row of logits [R, V] with its own params: temperature, then top-k, then top-p (the smallest prefix
    whose mass reaches top_p, the token crossing it included), then min-p; one pass of batched ops."""
    device, vocab = logits.device, logits.shape[-1]
    temps = torch.tensor([p.temperature for p in params], dtype=logits.dtype, device=device)
    x = logits / temps[:, None]
    top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    top_p = [p.top_p for p in params]
    if min(top_k) < vocab or min(top_p) < 1.0:
        sorted_x, order = torch.sort(x, dim=-1, descending=True)
        drop = torch.zeros_like(sorted_x, dtype=torch.bool)
        if min(top_k) < vocab:
            k = torch.tensor(top_k, dtype=torch.int64, device=device)
            kth = sorted_x.gather(1, (k - 1)[:, None])
            x = x.masked_fill(x < kth, float("-inf"))
            sorted_x = sorted_x.masked_fill(sorted_x < kth, float("-inf"))
        if min(top_p) < 1.0:
            probs = sorted_x.softmax(-1)
            p = torch.tensor(top_p, dtype=probs.dtype, device=device)
            drop = probs.cumsum(-1) - probs >= p[:, None]
            drop[:, 0] = False
            x = x.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    min_p = [p.min_p for p in params]
    if max(min_p) > 0.0:
        probs = x.softmax(-1)
        m = torch.tensor(min_p, dtype=probs.dtype, device=device)
        x = x.masked_fill(probs < m[:, None] * probs.max(-1, keepdim=True).values, float("-inf"))
    return x


def needs_row_processing(params: SamplingParams) -> bool:
    """Penalties read each sequence's own history, and a logit_bias is the request's own: such rows go through
    apply_penalties_rows (and sample_token one by one)."""
    return (params.repetition_penalty != 1.0 or bool(params.frequency_penalty) or bool(params.presence_penalty)
            or bool(params.logit_bias))


def sample_rows(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                positions: Sequence[int], argmax: Argmax | None = None) -> list[int]:
    """Tokens for the rows of logits [R, V] (penalties already applied): greedy rows by one argmax, the
    others by the keyed exponential race over their filtered distributions; one copy to the host in all.
    argmax: [R, V] -> int64 [R], torch.argmax's choices (a backend's FusedOps.argmax); torch.argmax if None."""
    if not len(params):
        return []
    return sample_rows_device(logits, params, seeds, positions, argmax).tolist()


def sample_rows_device(logits: torch.Tensor, params: Sequence[SamplingParams], seeds: Sequence[int],
                       positions: Sequence[int], argmax: Argmax | None = None) -> torch.Tensor:
    """sample_rows() as an int64 tensor on the logits' device, without waiting for it."""
    x = logits.float()
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    pick = argmax or _torch_argmax
    if not sampled:
        return pick(x)
    if len(sampled) == len(params):  # every row sampled: no greedy argmax over the rows, and no gather
        rows, sub = None, x
    else:
        rows = to_device(sampled, torch.int64, x.device)
        sub = x.index_select(0, rows)
    probs = apply_filters_rows(sub, [params[i] for i in sampled]).softmax(-1)
    noise = keyed_exponential([seeds[i] for i in sampled], [positions[i] for i in sampled], x.shape[-1], x.device)
    raced = pick(probs / noise)
    return raced if rows is None else pick(x).index_copy(0, rows, raced)


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
    # suppressed_ids: min_tokens not reached, so end-of-sequence and stop ids may not be chosen
    x = apply_penalties_rows(logits.float()[None], [params], [prompt_ids], [output_ids], None, [suppressed_ids])
    return sample_rows(x, [params], [seed], [position])[0]


def position_logprobs(logprobs_row: torch.Tensor, chosen: int, top_n: int) -> PositionLogprobs:
    """The chosen token's log-probability and rank, plus the top_n most likely tokens (one row, indexed by
    a host int: no index tensor to copy to the device)."""
    chosen_lp = logprobs_row[chosen]
    rank = int((logprobs_row > chosen_lp).sum()) + 1
    values, ids = torch.topk(logprobs_row, top_n) if top_n else (logprobs_row[:0], logprobs_row[:0])
    return assemble_logprobs(chosen, float(chosen_lp), rank, values.tolist(), ids.tolist(), top_n)


def logprob_stats(logprobs: torch.Tensor, chosen: torch.Tensor, top_k: int):
    """Rows of log-probabilities [R, V] and the chosen token of each [R] -> (chosen log-prob [R], its rank [R],
    top_k values [R, top_k], their ids [R, top_k]) on the device: a whole step's logprobs in one transfer."""
    chosen_lp = logprobs.gather(1, chosen.long()[:, None])
    rank = (logprobs > chosen_lp).sum(-1) + 1
    values, ids = torch.topk(logprobs, top_k, dim=-1) if top_k else (logprobs[:, :0], chosen[:, None][:, :0])
    return chosen_lp[:, 0], rank, values, ids


def assemble_logprobs(chosen: int, chosen_lp: float, rank: int, values: list[float], ids: list[int],
                      top_n: int) -> PositionLogprobs:
    """The chosen token's entry, then the top_n most likely (values and ids in descending order, at least top_n)."""
    out = {chosen: Logprob(float(chosen_lp), int(rank))}
    for r, (v, i) in enumerate(zip(values[:top_n], ids[:top_n]), start=1):
        out.setdefault(int(i), Logprob(float(v), r))
    return out
