"""Launchers of the MoE gate kernels (routing_kernels.py) for CudaFusedOps.

`select` routes from logits (any token count). `gate_route` is the whole gate for few tokens in one launch:
the float32 GEMV of the hidden states against the router weight and the selection. At one token the gate
was four launches before (x.float(), cuBLAS's GEMV as dot + reduce, the route kernel: ~8 us on the H200 for
V2-Lite); its weight read is small (E x H x 4 bytes) but latency-bound, so the kernel spreads the rows over
many programs and lets the last one route. Both take `shared`: folded shared experts appended to every
token's choices (ids E.., weight 1.0), written by the kernel rather than concatenated afterwards.

The callers (CudaFusedOps) have validated the inputs with the reference's checks.
"""

from __future__ import annotations

import torch

from deepinfer.errors import InvalidInputError
from deepinfer.ops import RoutingSpec

from deepinfer.backends.cuda_sm100 import routing_kernels as RK
from deepinfer.backends.cuda_sm100.gemm import cdiv, next_pow2
from deepinfer.backends.cuda_sm100.pdl import launch_kwargs

MAX_EXPERTS = 1024  # the gate keeps one token's experts in registers
# The one-launch gate recomputes nothing per token but reads the router weight once per token block: beyond a
# few dozen tokens cuBLAS's GEMM + route_kernel is the better split (the weight is then read from L2 anyway).
GATE_ROUTE_MAX_TOKENS = 32
GATE_ROUTE_TICKETS = GATE_ROUTE_MAX_TOKENS  # one ticket per token block; blocks hold >= 1 token


def _route_consts(spec: RoutingSpec, has_bias: bool, shared: int) -> dict:
    """route_kernel's constexprs for `spec` (selection, normalisation and scaling as deepinfer.ops.routing)."""
    e = spec.num_experts
    groups = spec.n_group if spec.grouped else 1
    per_group = e // groups
    if spec.topk_method == "noaux_tc":
        renorm, scale = spec.norm_topk_prob, spec.routed_scaling_factor
    elif spec.norm_topk_prob and spec.top_k > 1:
        renorm, scale = True, 1.0
    else:
        renorm, scale = False, spec.routed_scaling_factor
    return dict(E=e, EPG=per_group, G=groups, G_P=next_pow2(groups), EPG_P=next_pow2(per_group), TOPK=spec.top_k,
                SHARED=shared, K_P=next_pow2(spec.top_k), S_P=next_pow2(max(shared, 1)),
                TOPK_GROUP=spec.topk_group if spec.grouped else 1,
                SOFTMAX=spec.scoring_func == "softmax", GROUPED=spec.grouped,
                TOP2_SUM=spec.topk_method == "noaux_tc" and per_group >= 2, HAS_BIAS=has_bias, RENORM=renorm,
                SCALE=float(scale))


def _outputs(t: int, spec: RoutingSpec, shared: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    width = spec.top_k + shared
    return (torch.empty(t, width, dtype=torch.float32, device=device),
            torch.empty(t, width, dtype=torch.int64, device=device))


def _padded_experts(spec: RoutingSpec) -> int:
    groups = spec.n_group if spec.grouped else 1
    return next_pow2(groups) * next_pow2(spec.num_experts // groups)


def select(logits: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None, shared: int = 0):
    """logits [T, E] -> (weights, ids) [T, top_k + shared]: deepinfer.ops.select_experts plus the shared columns."""
    t = logits.shape[0]
    weights, ids = _outputs(t, spec, shared, logits.device)
    if t == 0:
        return weights, ids
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    bt = max(1, min(16, 2048 // _padded_experts(spec), next_pow2(t)))
    RK.route_kernel[(cdiv(t, bt),)](logits, bias if bias is not None else logits, weights, ids, t, logits.stride(0),
                                    **_route_consts(spec, bias is not None, shared), BT=bt, num_warps=4,
                                    **launch_kwargs())
    return weights, ids


def gate_route_fits(x: torch.Tensor, gate: torch.Tensor, spec: RoutingSpec) -> bool:
    """Whether gate_route takes this call: few tokens, a float32 [E, H] router weight, at most MAX_EXPERTS."""
    return (0 < x.shape[0] <= GATE_ROUTE_MAX_TOKENS and x.dim() == 2 and gate.dim() == 2
            and gate.dtype == torch.float32 and gate.is_contiguous() and spec.num_experts <= MAX_EXPERTS)


def gate_route(x: torch.Tensor, gate: torch.Tensor, spec: RoutingSpec, bias: torch.Tensor | None,
               tickets: torch.Tensor, shared: int = 0, layout: bool = False):
    """select(x.float() @ gate^T, ...) in one launch for gate_route_fits() calls -> (weights, ids, group sizes,
    row_of_pair); the last two are None unless `layout` (one token only): the choices' contiguous layout over
    E + shared experts (ops.ExpertLayout), written by the routing program as well.

    tickets: int32 [GATE_ROUTE_TICKETS] zeros on x's device, owned by the caller and kept between calls (the
    kernel leaves them at 0); launches sharing it must run in stream order, as one model's layers do.
    """
    t, h = x.shape
    e = spec.num_experts
    x = x if x.stride(-1) == 1 else x.contiguous()
    weights, ids = _outputs(t, spec, shared, x.device)
    logits = torch.empty(t, e, dtype=torch.float32, device=x.device)  # written and read inside the launch
    # Tokens per block: the routing half keeps BT x (padded experts) values in registers, as select() does.
    bt = max(1, min(8, 2048 // _padded_experts(spec), next_pow2(t)))
    # Expert rows per program: at least ~64 programs over the router weight (V2-Lite: 64 x 8 KiB; V3: 128 x 56 KiB).
    be = max(1, min(4, next_pow2(e) // 128))
    bh = min(next_pow2(h), max(64, 8192 // (bt * be)))  # the [BT, BE, BH] float32 accumulator: 64 per thread
    n_eb = cdiv(e, be)
    if layout and t != 1:
        raise InvalidInputError("gate_route writes a layout for one token only")
    k = spec.top_k + shared
    sizes = torch.empty(e + shared, dtype=torch.int64, device=x.device) if layout else None
    row_of_pair = torch.empty(t, k, dtype=torch.int32, device=x.device) if layout else None
    RK.gate_route_kernel[(cdiv(t, bt), n_eb)](
        x, gate, logits, tickets, bias if bias is not None else gate, weights, ids, t, x.stride(0),
        sizes if layout else ids, row_of_pair if layout else ids,
        H=h, BE=be, BH=bh, N_EB=n_eb, **_route_consts(spec, bias is not None, shared), BT=bt, LAYOUT=layout,
        P_P=next_pow2(k), EN_P=next_pow2(e + shared), num_warps=4, **launch_kwargs())
    return weights, ids, sizes, row_of_pair
