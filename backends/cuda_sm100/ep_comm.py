"""Expert-parallel dispatch and combine over the EP group: one row per (token, destination rank), as DeepEP
sends them, not one per (token, expert) pair.

dispatch
1. For each token and rank: whether the token chose any of that rank's experts, hence whether its row goes
   there and where in the send buffer (a running count per rank).
2. Each sent row carries, after its hidden values, its k choices as local expert ids (-1: another rank's)
   and weights (0 there): one all_to_all_single moves rows and routing together.
3. The receiver lays out its (row, local expert) pairs by expert with the single-process dispatch
   (moe_comm), leaving the other ranks' choices out.
Buffer sizes, two ways:
- exchanged (no capacity): rows and pairs per destination go first through an all_to_all of 2 * world ints
  that the host reads: one synchronisation per dispatch, buffers exactly as large as the traffic;
- fixed (a capacity every rank passes alike, up to FIXED_MAX_PAIRS received pairs): every rank sends
  `capacity` rows to every rank, unused ones marked by ids -1, so nothing is read back and the step can be
  captured in a CUDA graph (DeepEP's low-latency mode makes the same trade). The pairs then include padding
  past the sum of the group sizes, which the grouped GEMMs skip. Steps 1 and 2 are then one launch
  (ep_kernels.ep_pack_kernel) instead of ~20 torch ops: their host cost, not the link, bounds an eager dispatch.
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
from deepinfer.backends.reference.comm import check_combine_add, check_dispatch
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


# The fixed-size path up to this many received (row, choice) pairs (world * capacity * top_k), and always in a
# graph capture: padded buffers cost memory and bandwidth, which prefill-sized capacities would waste
# (DeepSeek-V3 at EP8, top-8: 256 tokens).
FIXED_MAX_PAIRS = 16384
# The receiver groups up to this many (row, choice) pairs in one launch (moe_comm's dispatch_small_kernel, whose
# programs each re-read every pair's id: 16 KiB from L2 at 4096), else with the three-launch sort and a gather
# (moe_comm.dispatch either way).
# Past moe_comm's 2048 for the fixed buffers of a decode step (2 ranks x 256 tokens x top-6: 3072); unmeasured.
EP_SMALL_MAX_PAIRS = 4096


def dispatch(ops, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, group: Any,
             validate: bool = True, capacity: int | None = None) -> Pending[Dispatched]:
    check_dispatch(x, topk_ids, topk_weights, num_experts, validate)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if num_experts % world:
        raise InvalidInputError(f"num_experts={num_experts} must be divisible by the group's world size {world}")
    local = num_experts // world
    t, k = topk_ids.shape
    h = x.shape[1]
    # Inside a graph capture nothing may wait for the host: fixed buffers whatever their size (every rank
    # captures the same graphs together, so they agree).
    capturing = x.is_cuda and torch.cuda.is_current_stream_capturing()
    fixed = capacity is not None and (world * capacity * k <= FIXED_MAX_PAIRS or capturing)
    if fixed and t > capacity:
        raise InvalidInputError(f"{t} tokens exceed the dispatch capacity {capacity} that every rank agreed on")
    if fixed and packs_in_one_launch(x):
        send, send_row, sent = pack_fixed(x, topk_ids, topk_weights, world, local, capacity)
        send_splits = recv_splits = [capacity] * world
        recv_pairs = None
    else:
        send, send_row, sent, send_splits, recv_splits, recv_pairs = pack(
            x, topk_ids, topk_weights, world, local, capacity if fixed else None, group)
    recv = send.new_empty(sum(recv_splits), send.shape[1])
    work = dist.all_to_all_single(recv, send, recv_splits, send_splits, group=group, async_op=True)

    def finish() -> Dispatched:
        # Step 3: the received (row, choice) pairs by local expert.
        routing = recv[:, h:].contiguous().view(torch.float32)  # [R, 2k]
        lid = routing[:, :k].to(torch.int32)  # -1: another rank's choice, which the grouping leaves out
        weights = routing[:, k:].contiguous()
        grouped = moe_comm.dispatch(ops, recv[:, :h], lid, weights, local, validate=False,
                                    small_max_pairs=EP_SMALL_MAX_PAIRS).wait()
        state = EPState(grouped.state.row_of_pair, weights, send_row, sent, send_splits, recv_splits, x.dtype, group)
        hidden = grouped.hidden if recv_pairs is None else grouped.hidden[:recv_pairs]
        return Dispatched(hidden, grouped.group_sizes, rank * local, state)

    # The closure keeps the send buffer alive until the collective finishes.
    return Pending(finish, (work,))


def pack(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, world: int, local: int,
         capacity: int | None, group: Any):
    """The send side in torch ops: (send buffer, send_row [T, W] int32, sent [T, W] float32, send splits,
    receive splits, pairs received or None). capacity=None: rows and pairs per destination exchanged first
    (the host reads them), buffers exactly that large; else `capacity` rows per destination, unused ones with
    ids -1. pack_fixed does the fixed case in one launch."""
    t, k = topk_ids.shape
    h, dev = x.shape[1], x.device
    # Per (token, rank) choice counts and send positions.
    owner = topk_ids.long() // local  # [T, k]
    pairs = torch.zeros(t, world, dtype=torch.int32, device=dev).scatter_add_(1, owner, torch.ones_like(owner, dtype=torch.int32))
    is_sent = pairs > 0
    running = is_sent.to(torch.int32).cumsum(0, dtype=torch.int32)
    if capacity is not None:
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

    # The send buffer: hidden row, then the k local ids and k weights as float32, viewed in x's dtype.
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
    return send, send_row, is_sent.to(torch.float32), send_splits, recv_splits, recv_pairs


def packs_in_one_launch(x: torch.Tensor) -> bool:
    """pack_fixed's layout needs the routing to start on a 4-byte boundary of each row (bf16: an even hidden)."""
    return (x.shape[1] * x.element_size()) % 4 == 0 and x.stride(-1) == 1


def pack_fixed(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, world: int, local: int,
               capacity: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """pack() with fixed buffers in one launch (ep_kernels.ep_pack_kernel): (send [W * capacity, H + m],
    send_row [T, W] int32, sent [T, W] float32), the same values; unused rows' hidden values are left unset."""
    from deepinfer.backends.cuda_sm100 import ep_kernels as EK
    from deepinfer.backends.cuda_sm100.gemm import interpreting, next_pow2
    from deepinfer.backends.cuda_sm100.pdl import launch_kwargs
    from deepinfer.quant import cdiv

    t, k = topk_ids.shape
    h, dev = x.shape[1], x.device
    m = 2 * k * 4 // x.element_size()  # routing columns in x's dtype
    send = torch.empty(world * capacity, h + m, dtype=x.dtype, device=dev)
    meta = send.view(torch.float32)
    send_row = torch.empty(t, world, dtype=torch.int32, device=dev)
    sent = torch.empty(t, world, dtype=torch.float32, device=dev)
    hb = 512  # hidden columns per program
    EK.ep_pack_kernel[(max(1, cdiv(t, 16)), cdiv(h, hb))](
        topk_ids.contiguous(), topk_weights.contiguous(), x, send, meta, send_row, sent, t, capacity,
        x.stride(0), send.stride(0), meta.stride(0), META_OFF=h * x.element_size() // 4, L=local, W=world,
        W_P=next_pow2(world), K=k, K_P=next_pow2(k), H=h, BT=16, CT=64, HB=hb, BH=128, CS=64,
        T_C=t if interpreting() else -1, CAP_C=capacity if interpreting() else -1, num_warps=4, **launch_kwargs())
    return send, send_row, sent


def combine(dispatched: Dispatched, expert_out: torch.Tensor, add: torch.Tensor | None = None) -> Pending[torch.Tensor]:
    state: EPState = dispatched.state
    rows = dispatched.hidden.shape[0]
    check_tensor("expert_out", expert_out, ndim=2, shape=(rows, None), dtypes=FLOAT_DTYPES, device=dispatched.hidden.device)
    check_combine_add(add, state.send_row.shape[0], expert_out.shape[1], expert_out.device)
    partial = moe_comm.weighted_gather(expert_out, state.local_row_of_pair, state.local_weights, state.out_dtype)
    returned = partial.new_empty(sum(state.send_splits), partial.shape[1])
    work = dist.all_to_all_single(returned, partial, state.send_splits, state.recv_splits, group=state.group, async_op=True)
    return Pending(lambda: moe_comm.weighted_gather(returned, state.send_row, state.sent, state.out_dtype, add), (work,))
