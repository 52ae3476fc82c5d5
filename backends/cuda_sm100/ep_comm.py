"""Expert-parallel dispatch and combine over the EP group: one row per (token, destination rank), as DeepEP
sends them, not one per (token, expert) pair.

dispatch
1. For each token and rank: how many of its choices that rank owns, hence whether its row goes there and
   where in the send buffer (a running count per rank). Rows and pairs per destination are exchanged with an
   all_to_all of 2 * world ints, read by the host once: the one synchronisation, which sizes the buffers.
2. Each sent row carries, after its hidden values, its k choices as local expert ids (-1: another rank's)
   and weights (0 there): one all_to_all_single moves rows and routing together.
3. The receiver lays out its (row, local expert) pairs by expert with the single-process dispatch
   (moe_comm), the other ranks' choices in an extra last group that is cut off.
combine
1. Each received row's expert outputs are weighted and summed here (moe_comm's combine kernel): one partial
   row per (token, rank), rounded to the activation dtype as DeepEP's combine does.
2. The partial rows go back by all_to_all_single, and each token sums its partials from every rank.
Bytes: a token whose k choices fall on d distinct ranks travels d times each way (top-6 of 64 experts over 2
ranks: at most 2 rows, against 6 for per-pair dispatch), and the weighted sum halves the return traffic too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from deepinfer.backend import Dispatched, Pending
from deepinfer.backends.cuda_sm100 import moe_comm
from deepinfer.backends.reference.comm import check_dispatch
from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.errors import InvalidInputError


@dataclass(frozen=True, eq=False)
class EPState:
    """What combine needs: where each received (row, choice) pair went, and each token's sent rows."""

    local_row_of_pair: torch.Tensor  # [R, k] int32: dispatched row of each received choice; -1 for another rank's
    local_weights: torch.Tensor  # [R, k] float32 (0 for another rank's choices)
    send_row: torch.Tensor  # [T, W] int32: each token's row in the send buffer per rank; -1 where not sent
    sent: torch.Tensor  # [T, W] float32: 1 where the row was sent (the final sum's weights)
    send_splits: list[int]
    recv_splits: list[int]
    out_dtype: torch.dtype
    group: Any


def dispatch(ops, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, group: Any,
             validate: bool = True) -> Pending[Dispatched]:
    check_dispatch(x, topk_ids, topk_weights, num_experts, validate)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % world:
        raise InvalidInputError(f"num_experts={num_experts} must be divisible by the group's world size {world}")
    local = num_experts // world
    t, k = topk_ids.shape
    h = x.shape[1]
    dev = x.device

    # Step 1: per (token, rank) choice counts, the rows and pairs each rank gets, and the send positions.
    owner = topk_ids.long() // local  # [T, k]
    pairs = torch.zeros(t, world, dtype=torch.int32, device=dev).scatter_add_(1, owner, torch.ones_like(owner, dtype=torch.int32))
    is_sent = pairs > 0
    counts = torch.stack((is_sent.sum(0), pairs.sum(0)), 1).reshape(-1)  # [W * 2]: rows, pairs per destination
    recv_counts = torch.empty_like(counts)
    dist.all_to_all_single(recv_counts, counts, group=group)
    both = torch.cat((counts, recv_counts)).tolist()  # the one host synchronisation
    send_splits, recv_splits = both[0 : 2 * world : 2], both[2 * world :: 2]
    recv_pairs = sum(both[2 * world + 1 :: 2])
    sent_total = sum(send_splits)
    start = torch.tensor([sum(send_splits[:r]) for r in range(world)], dtype=torch.int32).to(dev, non_blocking=True)
    running = is_sent.to(torch.int32).cumsum(0, dtype=torch.int32)
    send_row = torch.where(is_sent, running - 1 + start, -1).to(torch.int32)  # [T, W]

    # Step 2: the send buffer: hidden row, then the k local ids and k weights as float32, viewed in x's dtype.
    slot = torch.where(is_sent, send_row, sent_total).reshape(-1).long()  # unsent (token, rank) -> a spare slot
    pair_of_slot = torch.empty(sent_total + 1, dtype=torch.int64, device=dev)
    pair_of_slot.scatter_(0, slot, torch.arange(t * world, device=dev))
    pair_of_slot = pair_of_slot[:sent_total]  # (token * W + rank) of each sent row
    token, dest = pair_of_slot // world, pair_of_slot % world
    ids_of_slot = topk_ids.long().index_select(0, token)  # [S, k]
    mine = (ids_of_slot // local) == dest[:, None]
    meta = torch.cat((torch.where(mine, ids_of_slot - dest[:, None] * local, -1).to(torch.float32),
                      torch.where(mine, topk_weights.index_select(0, token).float(), 0.0)), 1)
    send = torch.cat((x.index_select(0, token), meta.view(x.dtype)), 1)
    recv = send.new_empty(sum(recv_splits), send.shape[1])
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)

    def finish() -> Dispatched:
        # Step 3: the received (row, choice) pairs by local expert; other ranks' choices go to group `local`.
        r = recv.shape[0]
        routing = recv[:, h:].contiguous().view(torch.float32)  # [R, 2k]
        lid = routing[:, :k].to(torch.int32)
        other = lid < 0
        lid = torch.where(other, local, lid)
        weights = routing[:, k:].contiguous()
        grouped = moe_comm.dispatch(ops, recv[:, :h], lid, weights, local + 1, validate=False).wait()
        row_of_pair = torch.where(other, -1, grouped.state.row_of_pair.reshape(r, k))
        state = EPState(row_of_pair, weights, send_row, is_sent.to(torch.float32), send_splits,
                        recv_splits, x.dtype, group)
        return Dispatched(grouped.hidden[:recv_pairs], grouped.group_sizes[:local], rank * local, state)

    # The closure keeps the send buffer alive until the collective finishes.
    return Pending(finish, (work,))


def combine(dispatched: Dispatched, expert_out: torch.Tensor) -> Pending[torch.Tensor]:
    state: EPState = dispatched.state
    rows = dispatched.hidden.shape[0]
    check_tensor("expert_out", expert_out, ndim=2, shape=(rows, None), dtypes=FLOAT_DTYPES, device=dispatched.hidden.device)
    partial = moe_comm.weighted_gather(expert_out, state.local_row_of_pair, state.local_weights, state.out_dtype)
    returned = partial.new_empty(sum(state.send_splits), partial.shape[1])
    work = dist.all_to_all_single(returned, partial, state.send_splits, state.recv_splits, group=state.group, async_op=True)
    return Pending(lambda: moe_comm.weighted_gather(returned, state.send_row, state.sent, state.out_dtype), (work,))
