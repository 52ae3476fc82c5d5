"""Single-process MoE dispatch and combine on the device, with no host synchronisation.

Dispatch lays the (token, choice) pairs out by expert with the counting sort of CudaFusedOps.sort_tokens
(three small launches, where a general argsort costs ~25 us per layer at decode sizes) and gathers the
hidden rows. Up to SMALL_DISPATCH_MAX_PAIRS pairs (decode) the sort and the gather are one launch,
dispatch_small_kernel, with the same rows in the same order. Combine gathers each token's expert outputs
back, weights and sums them in one kernel. Expert-parallel groups use ep_comm, built on these two.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.backend import Dispatched, Pending
from deepinfer.backends.reference.comm import check_combine_add, check_dispatch
from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.ops import ExpertLayout, ExpertSum, check_layout
from deepinfer.quant import cdiv


@dataclass(frozen=True, eq=False)
class LocalState:
    row_of_pair: torch.Tensor  # [T, k] int32: the dispatched row holding each pair
    topk_weights: torch.Tensor  # [T, k]
    out_dtype: torch.dtype


# Each program of dispatch_small_kernel re-counts every pair (ids read from L2): cheap for a few thousand,
# and the one launch saves four (hist, scan, scatter, index_select: ~9 us per layer at one token on the H200).
SMALL_DISPATCH_MAX_PAIRS = 2048
_SMALL_MAX_EXPERTS = 1024  # one histogram bin per expert in registers
_HB = 512  # hidden columns per program of the small dispatch


def dispatch(ops, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             validate: bool = True, small_max_pairs: int = SMALL_DISPATCH_MAX_PAIRS,
             layout: ExpertLayout | None = None) -> Pending[Dispatched]:
    """small_max_pairs: the largest T * k taking the one-launch path (tests pin either path). With
    validate=False, ids outside [0, num_experts) are left out on either path: row -1 in row_of_pair, not
    counted, and the hidden rows end in padding past the sum of the group sizes (expert parallelism's
    receiver marks other ranks' choices so). layout (the router's, FusedOps.route_sorted): at one token every
    row is that token, so the rows are a stride-0 view of x and the dispatch launches nothing."""
    check_dispatch(x, topk_ids, topk_weights, num_experts, validate)
    t, top_k = topk_ids.shape
    if layout is not None:
        check_layout(layout, num_experts, topk_ids)
        if t == 1:
            state = LocalState(layout.row_of_pair, topk_weights.contiguous(), x.dtype)
            rows = x if x.stride(-1) == 1 else x.contiguous()
            return Pending.ready(Dispatched(rows.expand(top_k, x.shape[1]), layout.group_sizes, 0, state,
                                            hidden_is_input=rows is x))
    if t * top_k <= small_max_pairs and num_experts <= _SMALL_MAX_EXPERTS:
        rows, sizes, row_of_pair = _dispatch_small(x, topk_ids, num_experts)
    else:
        order = ops.sort_tokens(topk_ids, num_experts)
        rows, sizes, row_of_pair = x.index_select(0, order.token_of_row()), order.group_sizes, order.row_of_pair
    state = LocalState(row_of_pair, topk_weights.contiguous(), x.dtype)
    return Pending.ready(Dispatched(rows, sizes, 0, state))


def _dispatch_small(x: torch.Tensor, topk_ids: torch.Tensor, num_experts: int):
    """sort_tokens (contiguous) + the row gather in one launch -> (rows [P, H], group sizes [E] int64,
    row_of_pair [T, k] int32)."""
    from deepinfer.backends.cuda_sm100 import routing_kernels as RK
    from deepinfer.backends.cuda_sm100.gemm import interpreting, next_pow2
    from deepinfer.backends.cuda_sm100.pdl import launch_kwargs

    t, k = topk_ids.shape
    p, h = t * k, x.shape[1]
    dev = x.device
    ids = topk_ids.reshape(-1) if topk_ids.is_contiguous() else topk_ids.contiguous().reshape(-1)
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = torch.empty(p, h, dtype=x.dtype, device=dev)
    sizes = torch.empty(num_experts, dtype=torch.int64, device=dev)
    row_of_pair = torch.empty(p, dtype=torch.int32, device=dev)
    bp = 16 if p <= 256 else 64  # pairs per program: the in-block rank compares BP x BP
    bh = 8192 // bp  # a [BP, BH] tile per copy step
    grid = (max(1, cdiv(p, bp)), max(1, cdiv(h, _HB)))
    RK.dispatch_small_kernel[grid](ids, x, rows, sizes, row_of_pair, p, x.stride(0), rows.stride(0),
                                   E=num_experts, E_P=next_pow2(num_experts), TOPK=k, H=h, BP=bp, HB=_HB,
                                   BH=min(bh, _HB), CH=256 if p <= 256 else 1024, P_C=p if interpreting() else -1,
                                   num_warps=4, **launch_kwargs())
    return rows, sizes, row_of_pair.reshape(t, k)


def combine(dispatched: Dispatched, expert_out: torch.Tensor, add: torch.Tensor | None = None, defer: bool = False
            ) -> Pending[torch.Tensor | ExpertSum]:
    """defer: the sum unformed (ExpertSum), for CudaFusedOps.add_rms_norm to form in its launch (one fewer)."""
    state: LocalState = dispatched.state
    rows = dispatched.hidden.shape[0]
    check_tensor("expert_out", expert_out, ndim=2, shape=(rows, None), dtypes=FLOAT_DTYPES, device=dispatched.hidden.device)
    check_combine_add(add, state.row_of_pair.shape[0], expert_out.shape[1], expert_out.device)
    if defer:
        return Pending.ready(ExpertSum(expert_out, state.row_of_pair, state.topk_weights, state.out_dtype, add))
    return Pending.ready(weighted_gather(expert_out, state.row_of_pair, state.topk_weights, state.out_dtype, add))


def weighted_gather(y: torch.Tensor, row_of_pair: torch.Tensor, weights: torch.Tensor, out_dtype: torch.dtype,
                    add: torch.Tensor | None = None) -> torch.Tensor:
    """out[t] = sum_j weights[t, j] * y[row_of_pair[t, j]] (+ add[t]) in a float32 sum (row -1 adds nothing)
    -> [T, H] out_dtype."""
    from deepinfer.backends.cuda_sm100 import routing_kernels as RK
    from deepinfer.backends.cuda_sm100.gemm import cdiv, interpreting, next_pow2
    from deepinfer.backends.cuda_sm100.pdl import launch_kwargs

    t, k = row_of_pair.shape
    h = y.shape[1]
    out = torch.empty(t, h, dtype=out_dtype, device=y.device)
    if t and h:
        y = RK.gatherable_rows(y if y.stride(-1) == 1 else y.contiguous())
        if add is not None and add.stride(-1) != 1:
            add = add.contiguous()
        bh = min(1024, next_pow2(h))
        # One token a program on a GPU; the interpreter's cost is per program, so it takes 64 (800 tokens: 15.8 ->
        # 0.3 s on a CPU core, same sums).
        bt = 64 if interpreting() else 1
        RK.combine_kernel[(cdiv(t, bt), cdiv(h, bh))](
            y, row_of_pair, weights, out, out if add is None else add, t, h, y.stride(0), out.stride(0),
            0 if add is None else add.stride(0), K=k, BT=bt, BH=bh, ADD=add is not None, EXACT=interpreting(),
            num_warps=4, **launch_kwargs())
    return out
