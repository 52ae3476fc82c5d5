"""Single-process MoE dispatch and combine on the device, with no host synchronisation.

Dispatch lays the (token, choice) pairs out by expert with the counting sort of CudaFusedOps.sort_tokens
(three small launches, where a general argsort costs ~25 us per layer at decode sizes) and gathers the
hidden rows; combine gathers each token's expert outputs back, weights and sums them in one kernel.
Expert-parallel groups keep the reference all-to-all path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.backend import Dispatched, Pending
from deepinfer.backends.reference.comm import check_dispatch
from deepinfer.checks import FLOAT_DTYPES, check_tensor


@dataclass(frozen=True, eq=False)
class LocalState:
    row_of_pair: torch.Tensor  # [T, k] int32: the dispatched row holding each pair
    topk_weights: torch.Tensor  # [T, k]
    out_dtype: torch.dtype


def dispatch(ops, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, num_experts: int,
             validate: bool = True) -> Pending[Dispatched]:
    check_dispatch(x, topk_ids, topk_weights, num_experts, validate)
    top_k = topk_ids.shape[1]
    order = ops.sort_tokens(topk_ids, num_experts)
    rows = x.index_select(0, order.pair_of_row // top_k)
    state = LocalState(order.row_of_pair, topk_weights.contiguous(), x.dtype)
    return Pending.ready(Dispatched(rows, order.group_sizes, 0, state))


def combine(dispatched: Dispatched, expert_out: torch.Tensor) -> Pending[torch.Tensor]:
    from deepinfer.backends.cuda_sm100 import routing_kernels as RK
    from deepinfer.backends.cuda_sm100.gemm import cdiv, next_pow2

    state: LocalState = dispatched.state
    rows = dispatched.hidden.shape[0]
    check_tensor("expert_out", expert_out, ndim=2, shape=(rows, None), dtypes=FLOAT_DTYPES, device=dispatched.hidden.device)
    t, k = state.row_of_pair.shape
    h = expert_out.shape[1]
    out = torch.empty(t, h, dtype=state.out_dtype, device=expert_out.device)
    if t and h:
        y = expert_out if expert_out.stride(-1) == 1 else expert_out.contiguous()
        bh = min(1024, next_pow2(h))
        RK.combine_kernel[(t, cdiv(h, bh))](y, state.row_of_pair, state.topk_weights, out, h, y.stride(0), out.stride(0),
                                            K=k, BH=bh, num_warps=4)
    return Pending.ready(out)
