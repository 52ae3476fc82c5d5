"""Small fused ops with reference (plain PyTorch, float32 math) implementations.

`FusedOps` bundles them; a backend that accelerates some returns a subclass from `Backend.ops`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from deepinfer import quant
from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.ops.norm import rms_norm, silu_and_mul
from deepinfer.ops.prefill_attention import prefill_attention
from deepinfer.ops.rope import RopeSpec, YarnScaling, apply_rope, yarn_mscale
from deepinfer.ops.routing import RoutingSpec, append_shared_experts, select_experts
from deepinfer.weights import LinearWeight

__all__ = [
    "FusedOps", "RopeSpec", "YarnScaling", "RoutingSpec",
    "rms_norm", "silu_and_mul", "apply_rope", "select_experts", "append_shared_experts", "yarn_mscale",
    "prefill_attention",
]


class FusedOps:
    """Reference implementations; each method validates its inputs and raises InvalidInputError."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor:
        return silu_and_mul(x)

    def apply_rope(self, x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool,
                   validate: bool = True) -> torch.Tensor:
        return apply_rope(x, positions, cos_sin_cache, interleaved, validate)

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

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of q [Lq, H, dk], the last Lq positions, over k [Ls, H, dk] / v [Ls, H, dv]."""
        return prefill_attention(q, k, v, scale)

    def quantize_fp8_per_token_group(self, x: torch.Tensor, group: int = quant.FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., K] -> (float8_e4m3fn [..., K], fp32 scales [..., ceil(K/group)])."""
        check_tensor("x", x, dtypes=FLOAT_DTYPES)
        return quant.quantize_fp8_per_token_group(x, group)
