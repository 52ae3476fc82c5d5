"""Weight and activation quantisation formats, as plain PyTorch math.

- FP8 block (DeepSeek-V3): float8_e4m3fn weights, one fp32 `weight_scale_inv` per 128x128 block;
  dequantised weight = block * scale_inv. Activations: per token, per 128 channels.
- NVFP4: E2M1 values packed two per byte (element 2i in the low nibble), one float8_e4m3fn scale per
  16 values along K, one fp32 global scale; dequantised value = e2m1 * block_scale * global_scale.

Dimensions that are not multiples of the block are allowed: the last block is partial (padded with zeros
inside these functions only).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.errors import InvalidInputError

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0
FP8_BLOCK = 128
NVFP4_BLOCK = 16
FP4_MAX = 6.0
# The eight non-negative E2M1 values, indexed by the 3-bit magnitude code.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1): block sizes for kernel launches."""
    return 1 << max(0, n - 1).bit_length()


def _pad_to(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    size = x.shape[dim]
    extra = cdiv(size, multiple) * multiple - size
    if extra == 0:
        return x
    pad = [0, 0] * (x.dim() - 1 - (dim % x.dim())) + [0, extra]
    return torch.nn.functional.pad(x, pad)


def quantize_fp8_block(weight: torch.Tensor, block: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., N, K] float weight -> (float8_e4m3fn [..., N, K], fp32 scale_inv [..., ceil(N/b), ceil(K/b)])."""
    n, k = weight.shape[-2:]
    w = _pad_to(_pad_to(weight.float(), -1, block), -2, block)
    lead = w.shape[:-2]
    nb, kb = w.shape[-2] // block, w.shape[-1] // block
    blocks = w.reshape(*lead, nb, block, kb, block)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12)
    scale_inv = amax / FP8_MAX
    q = (blocks / scale_inv[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    q = q.reshape(*lead, nb * block, kb * block)[..., :n, :k].to(FP8_DTYPE)
    return q.contiguous(), scale_inv.contiguous()


def dequantize_fp8_block(q: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """Inverse of quantize_fp8_block, in float32."""
    n, k = q.shape[-2:]
    scale = scale_inv.float().repeat_interleave(block, dim=-2).repeat_interleave(block, dim=-1)
    return q.float() * scale[..., :n, :k]


def quantize_fp8_per_token_group(x: torch.Tensor, group: int = FP8_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., K] activations -> (float8_e4m3fn [..., K], fp32 scales [..., ceil(K/group)]); x ~= q * scale."""
    k = x.shape[-1]
    xp = _pad_to(x.float(), -1, group)
    g = xp.reshape(*xp.shape[:-1], xp.shape[-1] // group, group)
    scale = g.abs().amax(dim=-1).clamp(min=1e-12) / FP8_MAX
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).reshape(xp.shape)[..., :k].to(FP8_DTYPE)
    return q.contiguous(), scale.contiguous()


@dataclass(frozen=True)
class Fp8Activations:
    """Activations already quantised per token per 128 channels, as an FP8-weight linear would quantise them:
    data float8_e4m3fn [T, K], scale float32 [T, ceil(K/128)] (any strides), and the dtype the GEMM's output
    takes. ops.add_rms_norm(..., quantize=True) makes them for a norm whose only readers are FP8 projections,
    so the quantisation rides in the norm's launch; Backend.linear takes them in place of x."""

    data: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        check_tensor("activations", self.data, ndim=2, dtypes=(FP8_DTYPE,))
        t, k = self.data.shape
        check_tensor("activation scales", self.scale, shape=(t, cdiv(k, FP8_BLOCK)), dtypes=(torch.float32,),
                     device=self.data.device)
        if self.dtype not in FLOAT_DTYPES:
            raise InvalidInputError(f"FP8 activations need a float output dtype, got {self.dtype}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device


def dequantize_fp8_per_token_group(q: torch.Tensor, scale: torch.Tensor, group: int = FP8_BLOCK) -> torch.Tensor:
    k = q.shape[-1]
    return q.float() * scale.float().repeat_interleave(group, dim=-1)[..., :k]


def _e2m1_codes(x: torch.Tensor) -> torch.Tensor:
    """Round float32 values (already scaled into [-6, 6]) to the nearest E2M1 code (sign bit 3)."""
    values = torch.tensor(E2M1_VALUES, device=x.device)
    mag = x.abs().clamp(max=FP4_MAX)
    code = (mag[..., None] - values).abs().argmin(dim=-1).to(torch.uint8)
    return code | ((x < 0).to(torch.uint8) << 3)


def quantize_nvfp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[..., N, K] float weight -> (uint8 [..., N, ceil(K/16)*8], e4m3 scales [..., N, ceil(K/16)], fp32 global).

    The global scale is per weight (a 0-d tensor, or one per leading index for stacked experts) so that every
    block scale fits E4M3's range.
    """
    w = _pad_to(weight.float(), -1, NVFP4_BLOCK)
    lead = w.shape[:-2]
    amax = w.abs().flatten(-2).amax(dim=-1).clamp(min=1e-12)  # [...]
    global_scale = amax / (FP4_MAX * FP8_MAX)
    blocks = w.reshape(*w.shape[:-1], w.shape[-1] // NVFP4_BLOCK, NVFP4_BLOCK)
    block_amax = blocks.abs().amax(dim=-1)
    gs = global_scale.reshape(*lead, 1, 1)
    block_scale = (block_amax / FP4_MAX / gs).clamp(max=FP8_MAX).to(FP8_DTYPE)
    effective = block_scale.float() * gs
    scaled = torch.where(effective[..., None] > 0, blocks / effective[..., None].clamp(min=1e-30), 0.0)
    codes = _e2m1_codes(scaled).reshape(w.shape)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed.contiguous(), block_scale.contiguous(), global_scale.contiguous()


def dequantize_nvfp4(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor, k: int) -> torch.Tensor:
    """Inverse of quantize_nvfp4, in float32, cut back to K columns."""
    values = torch.tensor(E2M1_VALUES, device=packed.device)
    codes = torch.stack([packed & 0xF, packed >> 4], dim=-1).reshape(*packed.shape[:-1], -1)
    mag = values[(codes & 0x7).long()]
    vals = torch.where((codes & 0x8) != 0, -mag, mag)
    lead = packed.shape[:-2]
    gs = global_scale.float().reshape(*lead, 1, 1)
    scale = block_scale.float().repeat_interleave(NVFP4_BLOCK, dim=-1) * gs
    return (vals * scale)[..., :k]
