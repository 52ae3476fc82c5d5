"""Small fused ops with reference (plain PyTorch, float32 math) implementations.

`FusedOps` bundles them; a backend that accelerates some returns a subclass from `Backend.ops`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer import quant
from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.errors import InvalidInputError
from deepinfer.ops.expert_sum import ExpertSum
from deepinfer.ops.norm import add_rms_norm, rms_norm, silu_and_mul
from deepinfer.ops.prefill_attention import prefill_attention
from deepinfer.ops.rope import RopeSpec, YarnScaling, apply_rope, check_mla_rope_and_norm, yarn_mscale
from deepinfer.ops.routing import ExpertLayout, RoutingSpec, append_shared_experts, check_layout, select_experts
from deepinfer.weights import LinearWeight

__all__ = [
    "FusedOps", "RopeSpec", "YarnScaling", "RoutingSpec",
    "rms_norm", "add_rms_norm", "silu_and_mul", "apply_rope", "select_experts", "append_shared_experts", "yarn_mscale",
    "prefill_attention", "check_argmax", "ExpertLayout", "check_layout", "ExpertSum",
]


class FusedOps:
    """Reference implementations; each method validates its inputs and raises InvalidInputError."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(self, x: torch.Tensor | ExpertSum, residual: torch.Tensor, weight: torch.Tensor, eps: float, *,
                     quantize: bool = False) -> tuple[torch.Tensor | quant.Fp8Activations, torch.Tensor]:
        """-> (rms_norm(summed), summed) with summed = x + residual in x's dtype (residual: x's shape and dtype).
        quantize (x [T, D]): the norm comes back quantised, as Fp8Activations (quantize_fp8_per_token_group), for
        FP8 projections (a backend may quantise in the norm's own launch; the values are the same).
        x may be an ExpertSum (an MoE's deferred combine): the same as its evaluate() as x, where a backend may
        form the sum in the norm's launch."""
        if isinstance(x, ExpertSum):
            x = x.evaluate()
        if quantize:
            check_tensor("x", x, ndim=2)
        normed, summed = add_rms_norm(x, residual, weight, eps)
        if quantize:
            return quant.Fp8Activations(*self.quantize_fp8_per_token_group(normed), x.dtype), summed
        return normed, summed

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool,
                   validate: bool = True) -> torch.Tensor:
        return apply_rope(x, positions, cos_sin_cache, interleaved, validate)

    def mla_rope_and_norm(self, q_pe: torch.Tensor, kv: torch.Tensor, kv_norm_weight: torch.Tensor, eps: float,
                          positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool, *,
                          validate: bool = True) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """MLA's step between the projections and the cache: q_pe [T, H, rope] and kv [T, R + rope] (the kv_a
        projection; R = kv_norm_weight.shape[0]), either may be a strided view -> (apply_rope(q_pe),
        rms_norm(kv[:, :R]), apply_rope(kv[:, R:])), new tensors in their inputs' dtypes. A backend may do all
        three in one launch."""
        check_mla_rope_and_norm(q_pe, kv, kv_norm_weight, positions, cos_sin_cache)
        r = kv_norm_weight.shape[0]
        c_kv = self.rms_norm(kv[:, :r], kv_norm_weight, eps)
        q_pe = self.apply_rope(q_pe, positions, cos_sin_cache, interleaved, validate)
        k_pe = self.apply_rope(kv[:, r:], positions, cos_sin_cache, interleaved, validate)
        return q_pe, c_kv, k_pe

    def select_experts(
        self, router_logits: torch.Tensor, spec: RoutingSpec, correction_bias: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        return select_experts(router_logits, spec, correction_bias)

    def route(self, x: torch.Tensor, gate: LinearWeight, spec: RoutingSpec, correction_bias: torch.Tensor | None = None,
              *, linear: Callable[[torch.Tensor, LinearWeight], torch.Tensor], shared: int = 0
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """The MoE gate from hidden states x [T, H]: select_experts(linear(x.float(), gate), spec, correction_bias).

        gate: the router weight [E, H], float32 for DeepSeek (near-tied scores decide experts); linear: the
        backend's GEMM. `shared` > 0 appends that many folded shared experts to every token's choices (ids
        E, E+1, ... with weight 1.0). -> (weights [T, k + shared] float32, ids [T, k + shared] int64).
        A backend may fuse the GEMM and the selection (few tokens, one launch).
        """
        weights, ids = self.select_experts(linear(x.float(), gate), spec, correction_bias)
        return append_shared_experts(weights, ids, spec.num_experts, shared)

    def route_sorted(self, x: torch.Tensor, gate: LinearWeight, spec: RoutingSpec,
                     correction_bias: torch.Tensor | None = None, *,
                     linear: Callable[[torch.Tensor, LinearWeight], torch.Tensor], shared: int = 0
                     ) -> tuple[torch.Tensor, torch.Tensor, ExpertLayout | None]:
        """route(), and the choices' ExpertLayout over num_experts + shared experts where the backend's router
        computes it on the way (else None): handed to Backend.dispatch, it spares the dispatch its sort."""
        return (*self.route(x, gate, spec, correction_bias, linear=linear, shared=shared), None)

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                          q_rope: torch.Tensor | None = None, k_rope: torch.Tensor | None = None) -> torch.Tensor:
        """Causal attention of q [Lq, H, dk], the last Lq positions, over k [Ls, H, dk] / v [Ls, H, dv]. With
        q_rope [Lq, H, dr] and k_rope [Ls, H, dr] (any strides: MLA passes one rope key shared by every head as
        a stride-0 view) the keys are (q | q_rope) and (k | k_rope); a backend may read the parts in place."""
        return prefill_attention(q, k, v, scale, q_rope, k_rope)

    def argmax(self, x: torch.Tensor) -> torch.Tensor:
        """x [R, V] float (V >= 1) -> int64 [R]: each row's first index of its largest value, a NaN counting as
        larger than anything (torch.argmax over the last dimension): greedy decoding's token choice."""
        check_argmax(x)
        return torch.argmax(x, dim=-1)

    def quantize_fp8_per_token_group(self, x: torch.Tensor, group: int = quant.FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., K] -> (float8_e4m3fn [..., K], fp32 scales [..., ceil(K/group)])."""
        check_tensor("x", x, dtypes=FLOAT_DTYPES)
        return quant.quantize_fp8_per_token_group(x, group)


def check_argmax(x: object) -> None:
    check_tensor("x", x, ndim=2, dtypes=FLOAT_DTYPES)
    if x.shape[1] == 0:
        raise InvalidInputError("argmax needs at least one column")
