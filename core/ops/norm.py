"""RMSNorm (alone or after a residual add) and SiLU-and-multiply, with float32 math."""

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


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual): the sum is rounded to x's dtype (PyTorch's float32 add and one
    rounding), and the norm reads that rounded sum, as the unfused pair of ops would."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("residual", residual, shape=list(x.shape), dtypes=(x.dtype,), device=x.device)
    check_tensor("weight", weight, ndim=1, shape=[x.shape[-1]], dtypes=FLOAT_DTYPES, device=x.device)
    summed = x + residual
    return rms_norm(summed, weight, eps), summed


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """[..., 2N] (gate then up) -> silu(gate) * up, [..., N]."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    if x.shape[-1] % 2:
        raise InvalidInputError(f"silu_and_mul needs an even last dimension, got {x.shape[-1]}")
    gate, up = x.float().chunk(2, dim=-1)
    return (F.silu(gate) * up).to(x.dtype)
