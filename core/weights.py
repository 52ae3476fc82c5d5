"""LinearWeight: a projection's weight in one of the formats backends' GEMMs accept."""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch

from deepinfer import quant
from deepinfer.errors import InvalidInputError


class WeightFormat(str, Enum):
    DENSE = "dense"  # bf16 / fp16 / fp32
    FP8_BLOCK = "fp8_block"  # float8_e4m3fn + fp32 scale_inv per 128x128 block
    NVFP4 = "nvfp4"  # packed E2M1 + e4m3 scale per 16 values + fp32 global scale


@dataclass(frozen=True, eq=False)
class LinearWeight:
    """Weight of y = x @ W^T with logical shape [..., N, K] (leading dims stack experts).

    data: dense [..., N, K]; fp8_block [..., N, K] float8_e4m3fn; nvfp4 [..., N, ceil(K/16)*8] uint8.
    scale: fp8_block [..., ceil(N/128), ceil(K/128)] fp32 (`weight_scale_inv`); nvfp4 [..., N, ceil(K/16)] e4m3.
    global_scale: nvfp4 only, fp32 [...] (0-d for one matrix, [E] for stacked experts).
    """

    data: torch.Tensor
    format: WeightFormat
    in_features: int
    scale: torch.Tensor | None = None
    global_scale: torch.Tensor | None = None

    @property
    def out_features(self) -> int:
        return self.data.shape[-2]

    @property
    def num_groups(self) -> int:
        """Number of stacked matrices (experts); 1 for a plain 2-D weight."""
        return 1 if self.data.dim() == 2 else int(self.data.shape[0])

    @property
    def device(self) -> torch.device:
        return self.data.device

    @classmethod
    def dense(cls, weight: torch.Tensor) -> LinearWeight:
        if weight.dtype not in (torch.float32, torch.bfloat16, torch.float16) or weight.dim() not in (2, 3):
            raise InvalidInputError(f"dense weight must be a 2-D or 3-D float tensor, got {weight.dtype} {tuple(weight.shape)}")
        return cls(weight, WeightFormat.DENSE, weight.shape[-1])

    @classmethod
    def fp8_block(cls, weight: torch.Tensor, scale_inv: torch.Tensor) -> LinearWeight:
        if weight.dtype != quant.FP8_DTYPE or weight.dim() not in (2, 3):
            raise InvalidInputError(f"fp8 weight must be a 2-D or 3-D float8_e4m3fn tensor, got {weight.dtype} {tuple(weight.shape)}")
        if not scale_inv.is_floating_point() or scale_inv.device != weight.device:
            raise InvalidInputError(f"weight_scale_inv must be a float tensor on {weight.device}, got {scale_inv.dtype} on {scale_inv.device}")
        n, k = weight.shape[-2:]
        want = (*weight.shape[:-2], quant.cdiv(n, quant.FP8_BLOCK), quant.cdiv(k, quant.FP8_BLOCK))
        if tuple(scale_inv.shape) != want:
            raise InvalidInputError(f"weight_scale_inv has shape {tuple(scale_inv.shape)}; expected {want} for weight {tuple(weight.shape)}")
        return cls(weight, WeightFormat.FP8_BLOCK, k, scale=scale_inv.float())

    @classmethod
    def nvfp4(cls, packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor, in_features: int) -> LinearWeight:
        kb = quant.cdiv(in_features, quant.NVFP4_BLOCK)
        if packed.dim() not in (2, 3):
            raise InvalidInputError(f"nvfp4 data must be 2-D or 3-D, got shape {tuple(packed.shape)}")
        if packed.dtype != torch.uint8 or packed.shape[-1] != kb * quant.NVFP4_BLOCK // 2:
            raise InvalidInputError(f"nvfp4 data must be uint8 [..., N, {kb * 8}], got {packed.dtype} {tuple(packed.shape)}")
        if block_scale.dtype != quant.FP8_DTYPE or tuple(block_scale.shape) != (*packed.shape[:-1], kb):
            raise InvalidInputError(f"nvfp4 block scale must be float8_e4m3fn {(*packed.shape[:-1], kb)}, got {block_scale.dtype} {tuple(block_scale.shape)}")
        if tuple(global_scale.shape) != tuple(packed.shape[:-2]):
            raise InvalidInputError(f"nvfp4 global scale must have shape {tuple(packed.shape[:-2])}, got {tuple(global_scale.shape)}")
        return cls(packed, WeightFormat.NVFP4, in_features, scale=block_scale, global_scale=global_scale.float())

    @classmethod
    def quantize(cls, weight: torch.Tensor, fmt: WeightFormat | str) -> LinearWeight:
        """Quantise a float weight into `fmt` (load-time `precision=` conversion)."""
        try:
            fmt = WeightFormat(fmt)
        except ValueError:
            raise InvalidInputError(f"unknown weight format {fmt!r}; expected one of {[f.value for f in WeightFormat]}") from None
        if fmt is WeightFormat.DENSE:
            return cls.dense(weight)
        if fmt is WeightFormat.FP8_BLOCK:
            return cls.fp8_block(*quant.quantize_fp8_block(weight))
        packed, block_scale, global_scale = quant.quantize_nvfp4(weight)
        return cls.nvfp4(packed, block_scale, global_scale, weight.shape[-1])

    def dequantize(self) -> torch.Tensor:
        """The weight as float32 [..., N, K]."""
        if self.format is WeightFormat.DENSE:
            return self.data.float()
        if self.format is WeightFormat.FP8_BLOCK:
            return quant.dequantize_fp8_block(self.data, self.scale)
        return quant.dequantize_nvfp4(self.data, self.scale, self.global_scale, self.in_features)

    def to(self, device: torch.device) -> LinearWeight:
        move = lambda t: None if t is None else t.to(device)  # noqa: E731
        return LinearWeight(self.data.to(device), self.format, self.in_features, move(self.scale), move(self.global_scale))
