"""Reference expert-parallel communication: dispatch/combine over all_to_all_single, and all_reduce.

Experts are split evenly and in order over the ranks of the group: rank r owns experts
[r * E/W, (r + 1) * E/W). In a single process (torch.distributed not initialised, or a world of one)
dispatch is a local sort of the (token, slot) rows by expert and nothing is communicated.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.backend import Dispatched, Pending
from deepinfer.checks import FLOAT_DTYPES, check_same_length, check_tensor
from deepinfer.errors import InvalidInputError

INT_DTYPES = (torch.int32, torch.int64)


@dataclass(frozen=True, eq=False)
class _State:
    """What combine needs to return each expert output row to its (token, slot)."""

    order: torch.Tensor  # [T*k]: flat (token, slot) index of each sent row; rows are sent sorted by expert
    topk_weights: torch.Tensor  # [T, k]
    out_dtype: torch.dtype
    group: Any = None
    # Multi-rank only: rows per peer rank (what this rank sent / received) and, for each local row
    # (sorted by local expert), its position among the received rows.
    send_splits: list[int] | None = None
    recv_splits: list[int] | None = None
    recv_order: torch.Tensor | None = None


def _world(group: Any) -> tuple[int, int]:
    """(world size, rank) of `group`; (1, 0) when torch.distributed is not in use."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def check_dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
                   validate: bool) -> None:
    """dispatch()'s argument checks, shared by backends; validate=False skips reading the ids' values back."""
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    check_tensor("topk_ids", topk_ids, ndim=2, dtypes=INT_DTYPES, device=x.device)
    check_tensor("topk_weights", topk_weights, shape=tuple(topk_ids.shape), dtypes=FLOAT_DTYPES, device=x.device)
    check_same_length("x", x, "topk_ids", topk_ids)
    if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts <= 0:
        raise InvalidInputError(f"num_experts must be a positive int, got {num_experts!r}")
    # Bad ids would silently misroute rows (validate=False: ids from the model's own router).
    if validate and topk_ids.numel() and (int(topk_ids.min()) < 0 or int(topk_ids.max()) >= num_experts):
        raise InvalidInputError(f"topk_ids must lie in [0, {num_experts}), got values in [{int(topk_ids.min())}, {int(topk_ids.max())}]")


def dispatch(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, group: Any = None,
             validate: bool = True) -> Pending[Dispatched]:
    check_dispatch(x, topk_ids, topk_weights, num_experts, validate)
    world, rank = _world(group)
    if num_experts % world:
        raise InvalidInputError(f"num_experts={num_experts} must be divisible by the group's world size {world}")

    top_k = topk_ids.shape[1]
    ids = topk_ids.reshape(-1).long()
    order = torch.argsort(ids, stable=True)  # grouped by expert, hence by owning rank (owners are contiguous)
    rows = x.index_select(0, order // top_k)
    if world == 1:
        # scatter_add, not bincount: bincount reads the maximum back to the host, which graphs forbid.
        sizes = torch.zeros(num_experts, dtype=torch.int64, device=x.device).scatter_add_(0, ids, torch.ones_like(ids))
        state = _State(order, topk_weights, x.dtype)
        return Pending.ready(Dispatched(rows, sizes, 0, state))

    local = num_experts // world
    first = rank * local
    send_ids = ids.index_select(0, order)
    send_counts = torch.bincount(send_ids // local, minlength=world)
    recv_counts = torch.empty_like(send_counts)
    dist.all_to_all_single(recv_counts, send_counts, group=group)  # sizes are needed to allocate the receive buffers
    send_splits, recv_splits = send_counts.tolist(), recv_counts.tolist()
    recv_rows = rows.new_empty((sum(recv_splits), x.shape[1]))
    recv_ids = send_ids.new_empty((sum(recv_splits),))
    works = (
        dist.all_to_all_single(recv_rows, rows, recv_splits, send_splits, group=group, async_op=True),
        dist.all_to_all_single(recv_ids, send_ids, recv_splits, send_splits, group=group, async_op=True),
    )

    def finish() -> Dispatched:
        local_ids = recv_ids - first
        recv_order = torch.argsort(local_ids, stable=True)  # received rows come by source rank; regroup by expert
        sizes = torch.bincount(local_ids, minlength=local)
        state = _State(order, topk_weights, x.dtype, group, send_splits, recv_splits, recv_order)
        return Dispatched(recv_rows.index_select(0, recv_order), sizes, first, state)

    # The closure keeps the send buffers alive until the collectives finish.
    return Pending(finish, works)


def check_combine_add(add: torch.Tensor | None, tokens: int, hidden: int, device: torch.device) -> None:
    """combine's `add` (the shared experts' output) must be one [tokens, hidden] float row per token."""
    if add is not None:
        check_tensor("add", add, ndim=2, shape=(tokens, hidden), dtypes=FLOAT_DTYPES, device=device)


def _weighted_sum(state: _State, rows: torch.Tensor, add: torch.Tensor | None) -> torch.Tensor:
    """rows [T*k, H] in dispatch's send order -> out[t] = sum_k w[t, k] * y[t, k] (+ add[t]), float32 math."""
    t, k = state.topk_weights.shape
    y = torch.empty(t * k, rows.shape[1], dtype=torch.float32, device=rows.device)
    y.index_copy_(0, state.order, rows.float())
    out = (y.view(t, k, rows.shape[1]) * state.topk_weights.float()[..., None]).sum(1)
    if add is not None:
        out += add.float()
    return out.to(state.out_dtype)


def combine(dispatched: Dispatched, expert_out: torch.Tensor, add: torch.Tensor | None = None) -> Pending[torch.Tensor]:
    if not isinstance(dispatched, Dispatched) or not isinstance(dispatched.state, _State):
        raise InvalidInputError("combine needs the Dispatched returned by this backend's dispatch")
    state = dispatched.state
    rows = dispatched.hidden.shape[0]
    check_tensor("expert_out", expert_out, ndim=2, shape=(rows, None), dtypes=FLOAT_DTYPES, device=dispatched.hidden.device)
    check_combine_add(add, state.topk_weights.shape[0], expert_out.shape[1], expert_out.device)
    if state.recv_order is None:
        return Pending.ready(_weighted_sum(state, expert_out, add))
    back = expert_out.new_empty(expert_out.shape)  # contiguous, as all_to_all_single needs
    back.index_copy_(0, state.recv_order, expert_out)  # undo the local sort: rows in received order
    returned = expert_out.new_empty((sum(state.send_splits), expert_out.shape[1]))
    work = dist.all_to_all_single(returned, back, state.send_splits, state.recv_splits, group=state.group, async_op=True)
    return Pending(lambda: _weighted_sum(state, returned, add), (work,))


def all_reduce(x: torch.Tensor, group: Any = None) -> torch.Tensor:
    check_tensor("x", x)
    if _world(group)[0] > 1:
        dist.all_reduce(x, group=group)
    return x
