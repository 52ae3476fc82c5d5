"""Rotary position embedding with DeepSeek's YaRN scaling, in interleaved or half-split layout.

Interleaved (DeepSeek's own weights): pairs (x[2i], x[2i+1]) rotate by position * inv_freq[i].
Half-split (NeoX / HF rotate_half): pairs (x[i], x[i + d/2]) rotate by the same angle.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.errors import InvalidInputError


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


@dataclass(frozen=True)
class YarnScaling:
    factor: float
    original_max_position_embeddings: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0
    truncate: bool = True

    @property
    def attention_factor(self) -> float:
        """Multiplier of cos/sin: mscale(factor, mscale) / mscale(factor, mscale_all_dim) where both are set."""
        if self.mscale and self.mscale_all_dim:
            return yarn_mscale(self.factor, self.mscale) / yarn_mscale(self.factor, self.mscale_all_dim)
        return yarn_mscale(self.factor)

    @property
    def softmax_mscale(self) -> float:
        """Extra factor of the softmax scale: mscale(factor, mscale_all_dim)^2 (DeepSeek's MLA)."""
        return yarn_mscale(self.factor, self.mscale_all_dim) ** 2 if self.mscale_all_dim else 1.0


@dataclass(frozen=True)
class RopeSpec:
    dim: int
    theta: float
    interleaved: bool = True
    yarn: YarnScaling | None = None

    def inv_freq(self) -> torch.Tensor:
        """[dim/2] float32 inverse frequencies (YaRN blends interpolated and extrapolated ones)."""
        d = self.dim
        base = self.theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
        extrapolated = 1.0 / base
        if self.yarn is None:
            return extrapolated.float()
        y = self.yarn
        interpolated = 1.0 / (y.factor * base)

        def correction_dim(rotations: float) -> float:
            return d * math.log(y.original_max_position_embeddings / (rotations * 2 * math.pi)) / (2 * math.log(self.theta))

        low, high = correction_dim(y.beta_fast), correction_dim(y.beta_slow)
        if y.truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, d - 1)
        if low == high:
            high += 0.001
        ramp = ((torch.arange(d // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
        keep_extrapolated = 1 - ramp
        return (interpolated * (1 - keep_extrapolated) + extrapolated * keep_extrapolated).float()

    @property
    def attention_factor(self) -> float:
        return 1.0 if self.yarn is None else self.yarn.attention_factor

    @property
    def softmax_mscale(self) -> float:
        return 1.0 if self.yarn is None else self.yarn.softmax_mscale

    def cos_sin_cache(self, max_positions: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """[max_positions, dim] float32: cos of each pair's angle in the first half, sin in the second."""
        # Angles in float64: position * inv_freq loses ~1e-3 rad in float32 at 100k positions.
        t = torch.arange(max_positions, dtype=torch.float64)
        freqs = torch.outer(t, self.inv_freq().double())
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1) * self.attention_factor
        return cache.to(device=device, dtype=torch.float32)


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool,
               validate: bool = True) -> torch.Tensor:
    """Rotate x [T, ..., dim] by positions [T]; returns a new tensor in x's dtype. validate=False skips the
    range check of positions (a read-back) for callers that checked them on the host, as the model does."""
    check_tensor("x", x, dtypes=FLOAT_DTYPES)
    check_tensor("positions", positions, ndim=1, shape=[x.shape[0]], dtypes=(torch.int32, torch.int64), device=x.device)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, shape=[None, x.shape[-1]], device=x.device)
    if validate and x.numel() and (positions.min() < 0 or positions.max() >= cos_sin_cache.shape[0]):
        raise InvalidInputError(f"positions must lie in [0, {cos_sin_cache.shape[0]}) (the rope cache's length)")
    half = x.shape[-1] // 2
    cs = cos_sin_cache.index_select(0, positions.long()).float()
    shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (half,)
    cos, sin = cs[:, :half].reshape(shape), cs[:, half:].reshape(shape)
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack([a * cos - b * sin, b * cos + a * sin], dim=-1).flatten(-2)
    else:
        a, b = xf[..., :half], xf[..., half:]
        out = torch.cat([a * cos - b * sin, b * cos + a * sin], dim=-1)
    return out.to(x.dtype)


def check_mla_rope_and_norm(q_pe: torch.Tensor, kv: torch.Tensor, kv_norm_weight: torch.Tensor,
                            positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> None:
    """Metadata checks of FusedOps.mla_rope_and_norm (its position range check is apply_rope's)."""
    check_tensor("q_pe", q_pe, ndim=3, dtypes=FLOAT_DTYPES)
    t, rope = q_pe.shape[0], q_pe.shape[-1]
    check_tensor("kv_norm_weight", kv_norm_weight, ndim=1, dtypes=FLOAT_DTYPES, device=q_pe.device)
    check_tensor("kv", kv, ndim=2, shape=[t, kv_norm_weight.shape[0] + rope], dtypes=FLOAT_DTYPES, device=q_pe.device)
    check_tensor("positions", positions, ndim=1, shape=[t], dtypes=(torch.int32, torch.int64), device=q_pe.device)
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, shape=[None, rope], device=q_pe.device)
