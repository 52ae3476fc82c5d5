"""Overlapped scheduling: step N+1 is scheduled and launched before step N's sampled tokens reach the host.

A deferred step samples on the device and starts a non-blocking copy of its tokens to pinned host memory;
the engine appends a PENDING_TOKEN to each sampled sequence so the scheduler can plan the next step (which
reads those tokens straight from the device tensor), and resolves the placeholders from the host copy once
that next step is on the GPU. A sequence that stopped at step N was still computed in step N+1: that row is
discarded, the price of never waiting.

Requested logprobs travel with the tokens (computed on the device in the same step), and penalties and
min_tokens count the pending token on the device. Steps that need the sampled values on the host before
the next one (speculative decoding, prompt logprobs, the first token of an n > 1 request) run synchronously, as does everything under expert
parallelism, whose ranks step in lockstep.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from deepinfer.transfer import to_device


@dataclass
class InFlightStep:
    """A launched step whose sampled tokens are still being copied to the host."""

    plan: object  # the SchedulerOutput it ran
    draws: list  # (request, completion index, sequence) per sampled row, in row order
    tokens: torch.Tensor  # [len(draws)] int64 on the device: the next step's inputs read it directly
    host: tuple[torch.Tensor, ...]  # pinned host copies of tokens and extras (the tensors themselves on a CPU)
    ready: torch.cuda.Event | None  # recorded after the copies; None on a CPU
    row_of: dict[str, int] = field(default_factory=dict)  # seq_id -> index in tokens
    logprob_rows: tuple[int, ...] = ()  # draws whose logprobs the extras hold, in order

    @classmethod
    def launch(cls, plan, draws: list, tokens: torch.Tensor, extras: tuple[torch.Tensor, ...] = (),
               logprob_rows: tuple[int, ...] = ()) -> InFlightStep:
        tensors = (tokens, *extras)
        if tokens.device.type == "cuda":
            host = tuple(torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors)
            for h, t in zip(host, tensors):
                h.copy_(t, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record()
        else:
            host, ready = tensors, None
        return cls(plan, draws, tokens, host, ready, {seq.seq_id: i for i, (_, _, seq) in enumerate(draws)},
                   logprob_rows)

    def wait(self) -> list[list]:
        """The sampled tokens, then the extras, as lists; waits only for this step's copies."""
        if self.ready is not None:
            self.ready.synchronize()
        return [h.tolist() for h in self.host]


def pending_input(row: int) -> int:
    """How a step's input_ids name "the token sampled in row `row` of the step in flight"."""
    return -1 - row


def resolve_inputs(input_ids: Sequence[int], pending: torch.Tensor | None, device: torch.device | str) -> torch.Tensor:
    """input_ids (host ints) on the device, pending_input() entries replaced by the in-flight step's sampled
    tokens. Decided on the host, so that a decode step does no more device work than it must (at batch 1
    each small op is a few microseconds of a ~2 ms step): every input pending, in row order (an overlapped
    decode step whose batch did not change), is a view of the pending tokens, with no copy or kernel; every
    input pending in another order, one gather; no input pending, one copy; only a mix takes the select."""
    if pending is None or not pending.numel() or not input_ids or min(input_ids) >= 0:
        return to_device(input_ids, torch.int64, device)
    if max(input_ids) < 0:  # every input pending
        rows = [pending_input(i) for i in input_ids]  # pending_input is its own inverse
        if rows == list(range(len(rows))):
            return pending[: len(rows)]
        return pending.index_select(0, to_device(rows, torch.int64, device))
    ids = to_device(input_ids, torch.int64, device)
    return torch.where(ids < 0, pending[(-1 - ids).clamp(min=0)], ids)
