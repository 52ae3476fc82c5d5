"""Small fused ops with reference (plain PyTorch, float32 math) implementations.

`FusedOps` bundles them; a backend that accelerates some returns a subclass from `Backend.ops`.
"""

from __future__ import annotations

import torch

from deepinfer import quant
from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.ops.norm import rms_norm, silu_and_mul
from deepinfer.ops.prefill_attention import prefill_attention
from deepinfer.ops.rope import RopeSpec, YarnScaling, apply_rope, yarn_mscale
from deepinfer.ops.routing import RoutingSpec, select_experts

__all__ = [
    "FusedOps", "RopeSpec", "YarnScaling", "RoutingSpec",
    "rms_norm", "silu_and_mul", "apply_rope", "select_experts", "yarn_mscale", "prefill_attention",
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

    def prefill_attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
        """Causal attention of q [Lq, H, dk], the last Lq positions, over k [Ls, H, dk] / v [Ls, H, dv]."""
        return prefill_attention(q, k, v, scale)

    def quantize_fp8_per_token_group(self, x: torch.Tensor, group: int = quant.FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
        """[..., K] -> (float8_e4m3fn [..., K], fp32 scales [..., ceil(K/group)])."""
        check_tensor("x", x, dtypes=FLOAT_DTYPES)
        return quant.quantize_fp8_per_token_group(x, group)
