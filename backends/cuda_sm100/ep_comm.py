"""Expert-parallel dispatch and combine over the EP group: one row per (token, destination rank), as DeepEP
sends them, not one per (token, expert) pair.

dispatch
1. For each token and rank: whether the token chose any of that rank's experts, hence whether its row goes
   there and where in the send buffer (a running count per rank).
2. Each sent row carries, after its hidden values, its k choices as local expert ids (-1: another rank's)
   and weights (0 there): one all_to_all_single moves rows and routing together.
3. The receiver lays out its (row, local expert) pairs by expert with the single-process dispatch
   (moe_comm), the other ranks' choices in an extra last group that is cut off.
Buffer sizes, two ways:
- exchanged (no capacity): rows and pairs per destination go first through an all_to_all of 2 * world ints
  that the host reads: one synchronisation per dispatch, buffers exactly as large as the traffic;
- fixed (a capacity every rank passes alike, up to FIXED_MAX_PAIRS received pairs): every rank sends
  `capacity` rows to every rank, unused ones marked by ids -1, so nothing is read back and the step can be
  captured in a CUDA graph (DeepEP's low-latency mode makes the same trade). The pairs then include padding
  past the sum of the group sizes, which the grouped GEMMs skip.
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


# The fixed-size path up to this many received (row, choice) pairs (world * capacity * top_k): padded buffers
# cost memory and bandwidth, which prefill-sized capacities would waste (DeepSeek-V3 at EP8, top-8: 256 tokens).
FIXED_MAX_PAIRS = 16384


def dispatch(ops, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, group: Any,
             validate: bool = True, capacity: int | None = None) -> Pending[Dispatched]:
    check_dispatch(x, topk_ids, topk_weights, num_experts, validate)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % world:
        raise InvalidInputError(f"num_experts={num_experts} must be divisible by the group's world size {world}")
    local = num_experts // world
    t, k = topk_ids.shape
    h = x.shape[1]
    dev = x.device
    fixed = capacity is not None and world * capacity * k <= FIXED_MAX_PAIRS
    if fixed and t > capacity:
        raise InvalidInputError(f"{t} tokens exceed the dispatch capacity {capacity} that every rank agreed on")

    # Step 1: per (token, rank) choice counts and send positions (rows per destination: exchanged or fixed).
    owner = topk_ids.long() // local  # [T, k]
    pairs = torch.zeros(t, world, dtype=torch.int32, device=dev).scatter_add_(1, owner, torch.ones_like(owner, dtype=torch.int32))
    is_sent = pairs > 0
    running = is_sent.to(torch.int32).cumsum(0, dtype=torch.int32)
    if fixed:
        send_splits = recv_splits = [capacity] * world
        recv_pairs = None
        start = torch.arange(0, world * capacity, capacity, dtype=torch.int32, device=dev)
    else:
        counts = torch.stack((is_sent.sum(0), pairs.sum(0)), 1).reshape(-1)  # [W * 2]: rows, pairs per destination
        recv_counts = torch.empty_like(counts)
        dist.all_to_all_single(recv_counts, counts, group=group)
        both = torch.cat((counts, recv_counts)).tolist()  # the one host synchronisation
        send_splits, recv_splits = both[0 : 2 * world : 2], both[2 * world :: 2]
        recv_pairs = sum(both[2 * world + 1 :: 2])
        start = torch.tensor([sum(send_splits[:r]) for r in range(world)], dtype=torch.int32).to(dev, non_blocking=True)
    send_row = torch.where(is_sent, running - 1 + start, -1).to(torch.int32)  # [T, W]
    slots = sum(send_splits)

    # Step 2: the send buffer: hidden row, then the k local ids and k weights as float32, viewed in x's dtype.
    # (token, rank) pairs not sent write a spare last slot; unused fixed slots keep ids -1 (nothing to do).
    slot = torch.where(is_sent, send_row, slots).reshape(-1).long()
    pair_of_slot = torch.full((slots + 1,), t * world, dtype=torch.int64, device=dev)
    pair_of_slot.scatter_(0, slot, torch.arange(t * world, device=dev))
    pair_of_slot = pair_of_slot[:slots]  # (token * W + rank) of each row, or T * W for an unused one
    used = pair_of_slot < t * world
    token, dest = torch.where(used, pair_of_slot // world, 0), pair_of_slot % world
    ids_of_slot = topk_ids.long().index_select(0, token) if t else torch.zeros(slots, k, dtype=torch.int64, device=dev)
    mine = ((ids_of_slot // local) == dest[:, None]) & used[:, None]
    chosen = topk_weights.index_select(0, token).float() if t else torch.zeros(slots, k, device=dev)
    meta = torch.cat((torch.where(mine, ids_of_slot - dest[:, None] * local, -1).to(torch.float32),
                      torch.where(mine, chosen, 0.0)), 1)
    rows = x.index_select(0, token) if t else x.new_zeros(slots, h)
    send = torch.cat((rows, meta.view(x.dtype)), 1)
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
        hidden = grouped.hidden if recv_pairs is None else grouped.hidden[:recv_pairs]
        return Dispatched(hidden, grouped.group_sizes[:local], rank * local, state)

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
