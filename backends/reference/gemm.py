"""Reference GEMMs with float32 accumulation: dense, FP8 block-scaled (DeepSeek-V3) and NVFP4 (weight-only).

FP8 follows DeepSeek-V3: activations are quantised per token per 128 channels, each 128-wide K block's
partial product is computed from the FP8 values and then promoted with that block's two scales
(token-group scale x weight block scale_inv) before being summed in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from deepinfer import quant
from deepinfer.checks import FLOAT_DTYPES, check_tensor
from deepinfer.errors import InvalidInputError
from deepinfer.weights import LinearWeight, WeightFormat

INT_DTYPES = (torch.int32, torch.int64)
# Bound the FP8 path's [K blocks, rows, N] float32 partial products (~256 MiB) so real shapes fit a device.
_FP8_CHUNK_ELEMS = 1 << 26


def _check_weight(weight: object, ndim: int) -> LinearWeight:
    if not isinstance(weight, LinearWeight):
        raise InvalidInputError(f"weight must be a LinearWeight, got {type(weight).__name__}")
    if weight.data.dim() != ndim:
        what = "a 2-D [N, K]" if ndim == 2 else "a stacked 3-D [E, N, K]"
        raise InvalidInputError(f"weight must be {what} weight, got data of shape {tuple(weight.data.shape)}")
    return weight


def _check_x(x: object, weight: LinearWeight, ndim: int | None = None) -> torch.Tensor:
    check_tensor("x", x, ndim=ndim, dtypes=FLOAT_DTYPES, device=weight.device)
    if x.dim() < 1 or x.shape[-1] != weight.in_features:
        raise InvalidInputError(f"x has shape {list(x.shape)}; its last dimension must be in_features={weight.in_features}")
    return x


def check_fp8_activations(x: quant.Fp8Activations, weight: LinearWeight) -> None:
    """Pre-quantised activations fit this weight: an fp8_block weight on their device, K = in_features."""
    if weight.format is not WeightFormat.FP8_BLOCK:
        raise InvalidInputError(f"FP8 activations need an fp8_block weight, got a {weight.format.value} one")
    if x.device != weight.device:
        raise InvalidInputError(f"FP8 activations are on {x.device}, the weight on {weight.device}")
    if x.shape[-1] != weight.in_features:
        raise InvalidInputError(f"FP8 activations have shape {list(x.shape)}; their last dimension must be "
                                f"in_features={weight.in_features}")


def _pad_k(t: torch.Tensor, k: int) -> torch.Tensor:
    return F.pad(t, (0, k - t.shape[-1])) if t.shape[-1] != k else t


def _fp8_matmul(x: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
    """x [M, K] float @ one fp8_block weight -> [M, N] float32, with per-(token-group, block) promotion."""
    if x.shape[0] == 0:  # quantize_fp8_per_token_group cannot reshape an empty batch
        return torch.empty(0, weight.out_features, dtype=torch.float32, device=x.device)
    return _fp8_matmul_quantised(*quant.quantize_fp8_per_token_group(x, quant.FP8_BLOCK), weight)


def _fp8_matmul_quantised(xq: torch.Tensor, xs: torch.Tensor, weight: LinearWeight) -> torch.Tensor:
    """Quantised activations (e4m3 [M, K], fp32 scales [M, KB]) @ one fp8_block weight -> [M, N] float32."""
    b = quant.FP8_BLOCK
    m, k = xq.shape
    n = weight.out_features
    kb = quant.cdiv(k, b)
    xs = xs.float()
    # Zero padding of K to whole blocks adds nothing to any block's partial product.
    xb = _pad_k(xq.float(), kb * b).view(m, kb, b).transpose(0, 1)  # [KB, M, b]
    wb = _pad_k(weight.data.float(), kb * b).view(n, kb, b).permute(1, 2, 0)  # [KB, b, N]
    ws = weight.scale.float().repeat_interleave(b, dim=0)[:n].t()  # [KB, N]: scale_inv of each output row's block
    out = torch.empty(m, n, dtype=torch.float32, device=xq.device)
    rows = max(1, _FP8_CHUNK_ELEMS // max(1, kb * n))
    for s in range(0, m, rows):  # chunks only bound memory; each row's math is independent of the chunking
        part = torch.bmm(xb[:, s : s + rows], wb)  # [KB, r, N] per-block partial products
        out[s : s + rows] = (part * xs[s : s + rows].t()[:, :, None] * ws[:, None, :]).sum(0)
    return out


def _per_row(fn, row_wise: bool, *rows: torch.Tensor) -> torch.Tensor:
    """fn(*rows), or in batch-invariant mode (row_wise) one call per row, so that a row's reduction never
    depends on how many other rows share the call (BLAS picks kernels and blockings by M)."""
    if row_wise and rows[0].shape[0] > 1:
        return torch.cat([fn(*(t[i : i + 1] for t in rows)) for i in range(rows[0].shape[0])])
    return fn(*rows)


def _matmul(x: torch.Tensor, weight: LinearWeight, row_wise: bool = False) -> torch.Tensor:
    """x [M, K] @ one 2-D weight^T -> [M, N] float32; row_wise: one GEMV per row (_per_row)."""
    if row_wise:
        return _per_row(lambda r: _matmul(r, weight), True, x)
    if weight.format is WeightFormat.FP8_BLOCK:
        return _fp8_matmul(x, weight)
    # Dense, and NVFP4 weight-only: activations stay in float, the weight is dequantised.
    return x.float() @ weight.dequantize().t()


def _expert(weight: LinearWeight, g: int) -> LinearWeight:
    """Matrix g of a stacked weight (already validated as a whole, so built without re-checking)."""
    pick = lambda t: None if t is None else t[g]  # noqa: E731
    return LinearWeight(weight.data[g], weight.format, weight.in_features, pick(weight.scale), pick(weight.global_scale))


def linear(x: torch.Tensor | quant.Fp8Activations, weight: LinearWeight, row_wise: bool = False) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype; x may be Fp8Activations (fp8_block weights only)."""
    weight = _check_weight(weight, 2)
    if isinstance(x, quant.Fp8Activations):
        check_fp8_activations(x, weight)
        out = _per_row(lambda q, s: _fp8_matmul_quantised(q, s, weight), row_wise, x.data, x.scale)
        return out.to(x.dtype)
    x = _check_x(x, weight)
    out = _matmul(x.reshape(-1, weight.in_features), weight, row_wise)
    return out.to(x.dtype).reshape(*x.shape[:-1], weight.out_features)


def grouped_linear(x: torch.Tensor, weight: LinearWeight, group_sizes: torch.Tensor, row_wise: bool = False) -> torch.Tensor:
    """x [M, K] with rows sorted by group; group g's group_sizes[g] rows use weight[g] -> [M, N] in x's dtype."""
    weight = _check_weight(weight, 3)
    x = _check_x(x, weight, ndim=2)
    num_groups = weight.num_groups
    check_tensor("group_sizes", group_sizes, shape=(num_groups,), dtypes=INT_DTYPES, device=x.device)
    sizes = group_sizes.tolist()  # host sync: fine for the reference
    if any(s < 0 for s in sizes) or sum(sizes) != x.shape[0]:
        raise InvalidInputError(f"group_sizes must be non-negative and sum to x's {x.shape[0]} rows, got {sizes}")
    out = torch.zeros(x.shape[0], weight.out_features, dtype=torch.float32, device=x.device)
    start = 0
    for g, size in enumerate(sizes):
        if size:
            # FP8 activation quantisation is per token, so quantising each group's rows alone is exact.
            out[start : start + size] = _matmul(x[start : start + size], _expert(weight, g), row_wise)
        start += size
    return out.to(x.dtype)
