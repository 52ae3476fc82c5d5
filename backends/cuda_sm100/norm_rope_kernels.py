"""Triton kernels of RMSNorm and rotary embedding, one launch each, with the reference's float32 math.

rms_norm: one program per block of rows; each row is loaded once, whole (D <= MAX_NORM_DIM), and computed as
core/ops/norm.py does: x.float(), sum of squares / D, rsqrt(. + eps), (x * r) * w.float(), one rounding to
x's dtype. The differences from the reference are the order of the row sum (a tree here) and, on the GPU,
which approximate rsqrt runs, so float32 results agree to a few ulp, not bit for bit.

apply_rope: one program per block of (token, head) rows of x viewed as [T, H, dim] with any token and head
strides (a q[..., nope:] slice needs no copy). Same math as core/ops/rope.py, in the same order: the cache
row [cos half | sin half] of each token's position, pairs (2i, 2i+1) or (i, i + dim/2), a*cos - b*sin and
b*cos + a*sin in float32 without FMA contraction, one rounding: bit-exact against the reference.

The launchers assume the callers' validation (CudaFusedOps runs the reference's checks first) and never read
device values back. A position outside the cache on the GPU (which is not checked there) gives NaN rows
instead of an out-of-bounds read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from deepinfer.backends.cuda_sm100.gemm import cdiv, interpreting, next_pow2
from deepinfer.backends.cuda_sm100.gemm_kernels import _cast

MAX_NORM_DIM = 16384  # a whole row stays in registers; wider rows go to the reference
_NORM_TILE = 4096  # elements per rms_norm program (rows are packed into a block up to this)
_ROPE_TILE = 2048  # pairs per rope program


@triton.jit(do_not_specialize=["R"])
def rms_norm_kernel(x_ptr, w_ptr, o_ptr, R, D, DF, stride_xr, stride_or, eps,
                    BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr, EXACT: tl.constexpr):
    """x [R, D] (row stride stride_xr, unit column stride) -> o [R, D] in o's dtype; DF = float(D)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.arange(0, BLOCK_D)
    mask = (rows[:, None] < R) & (cols[None, :] < D)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xr + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
    # mean as sum / D with a correctly rounded division (Triton's `/` is approximate on the GPU)
    ms = tl.math.div_rn(tl.sum(x * x, axis=1), DF)
    r = tl.math.rsqrt(ms + eps)
    y = (x * r[:, None]) * w[None, :]  # the reference's order: normalise, then scale
    tl.store(o_ptr + rows64[:, None] * stride_or + cols[None, :], _cast(y, o_ptr.dtype.element_ty, EXACT), mask=mask)


@triton.jit(do_not_specialize=["R"])
def rope_kernel(x_ptr, pos_ptr, cache_ptr, o_ptr, R, H, P, stride_xt, stride_xh, stride_p, stride_c,
                HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_R: tl.constexpr, INTERLEAVED: tl.constexpr,
                EXACT: tl.constexpr):
    """x [T, H, 2*HALF] (strided, unit last stride), rows r = t * H + h -> o [T*H, 2*HALF] contiguous."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    live = rows < R
    tok = (rows // H).to(tl.int64)
    head = (rows % H).to(tl.int64)
    pos = tl.load(pos_ptr + tok * stride_p, mask=live, other=0).to(tl.int64)
    i = tl.arange(0, HALF_P)
    cmask = i < HALF
    cs_mask = (live & (pos >= 0) & (pos < P))[:, None] & cmask[None, :]
    cs = cache_ptr + pos[:, None] * stride_c + i[None, :]
    cos = tl.load(cs, mask=cs_mask, other=float("nan")).to(tl.float32)
    sin = tl.load(cs + HALF, mask=cs_mask, other=float("nan")).to(tl.float32)
    if INTERLEAVED:
        ia, ib = 2 * i, 2 * i + 1
    else:
        ia, ib = i, i + HALF
    mask = live[:, None] & cmask[None, :]
    xrow = x_ptr + (tok * stride_xt + head * stride_xh)[:, None]
    a = tl.load(xrow + ia[None, :], mask=mask, other=0.0).to(tl.float32)
    b = tl.load(xrow + ib[None, :], mask=mask, other=0.0).to(tl.float32)
    out_a = a * cos - b * sin
    out_b = b * cos + a * sin
    orow = o_ptr + (rows.to(tl.int64) * (2 * HALF))[:, None]
    tl.store(orow + ia[None, :], _cast(out_a, o_ptr.dtype.element_ty, EXACT), mask=mask)
    tl.store(orow + ib[None, :], _cast(out_b, o_ptr.dtype.element_ty, EXACT), mask=mask)


def _rows_view(x: torch.Tensor, lead: int) -> torch.Tensor:
    """x viewed as [x.shape[:lead]..., -1, x.shape[-1]] with a unit last stride, copying only if it cannot be."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    shape = (*x.shape[:lead], -1, x.shape[-1])
    try:
        return x.view(shape)
    except RuntimeError:  # the middle dimensions do not collapse into one stride
        return x.contiguous().view(shape)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Validated x [..., D] (D <= MAX_NORM_DIM), weight [D] -> RMSNorm in x's dtype, one launch."""
    d = x.shape[-1]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    x2 = _rows_view(x, 0)
    o2 = out.view(-1, d)
    w = weight if weight.stride(0) == 1 else weight.contiguous()
    r = x2.shape[0]
    bd = next_pow2(d)
    br = max(1, min(next_pow2(r), _NORM_TILE // bd))
    warps = 4 if br * bd <= 2048 else 8 if br * bd <= 8192 else 16
    rms_norm_kernel[(cdiv(r, br),)](x2, w, o2, r, d, float(d), x2.stride(0), o2.stride(0), float(eps),
                                    BLOCK_R=br, BLOCK_D=bd, EXACT=interpreting(), num_warps=warps,
                                    enable_fp_fusion=False)
    return out


def apply_rope(x: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Validated x [T, ..., dim] (even dim, ndim >= 2), positions [T], cache [P, dim] -> rotated copy of x."""
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if x.numel() == 0:
        return out
    t, dim = x.shape[0], x.shape[-1]
    x3 = _rows_view(x, 1)
    heads = x3.shape[1]
    cache = cos_sin_cache if cos_sin_cache.stride(-1) == 1 else cos_sin_cache.contiguous()
    half = dim // 2
    half_p = next_pow2(half)
    rows = t * heads
    br = max(1, min(next_pow2(rows), _ROPE_TILE // half_p))
    # enable_fp_fusion=False: a*cos - b*sin must not become an FMA, so results match the reference's
    # separately rounded products bit for bit
    rope_kernel[(cdiv(rows, br),)](x3, positions, cache, out, rows, heads, cache.shape[0],
                                   x3.stride(0), x3.stride(1), positions.stride(0), cache.stride(0),
                                   HALF=half, HALF_P=half_p, BLOCK_R=br, INTERLEAVED=bool(interleaved),
                                   EXACT=interpreting(), num_warps=4, enable_fp_fusion=False)
    return out
