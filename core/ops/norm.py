"""RMSNorm and SiLU-and-multiply, with float32 math."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.errors import InvalidInputError


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x * rsqrt(mean(x^2) + eps) * weight over the last dimension; output in x's dtype."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("weight", weight, ndim=1, shape=[x.shape[-1]], dtypes=FLOAT_DTYPES, device=x.device)
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (y * weight.float()).to(x.dtype)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2N] (gate then up) -> silu(gate) * up, [..., N]."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.shape[-1] % 2:
        raise InvalidInputError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
