"""Decode-step GEMV: out[n] = sum_k x[k] w[n, k] for the one row of a batch-1 decode step.

At batch 1 a dense projection reads its whole weight for one row, so all that counts is keeping HBM busy. A
GEMM tile pads the row to an MMA's 16 and pipelines narrow K steps; here each program takes BN weight rows and
loads BK columns of them at once (its whole slab when K <= BK), multiplies them by x in fp32 on the FMA units
and reduces once per K step. Under PDL the first K step of the weight (which no earlier kernel writes) is
loaded before the wait for the previous kernel, so its streaming overlaps that kernel's tail; x is read only
after the wait.

Weights are 16-bit, or E4M3 with a float32 scale per 128 x 128 block (W_FP8); x is 16-bit (quantised in the
kernel when the weight is E4M3), or E4M3 with a scale per 128 columns (X_FP8, quant.Fp8Activations). Tiles are
[BN, BK / 128, 128] so that each 128-column group's sum meets its scales before the groups are added.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.backends.cuda_sm100.gemm_kernels import _quantize_rows
from deepinfer.backends.cuda_sm100.pdl import enter


@triton.jit
def _load_slab(w_rows, ws_rows, k0, K: tl.constexpr, rmask, G: tl.constexpr, W_FP8: tl.constexpr):
    """Weight columns k0 .. k0 + 128 G of the program's rows (w_rows, rmask [BN, 1]) as [BN, G, 128] (zero past
    K), and their block scales [BN, G] (W_FP8; else a placeholder)."""
    g = k0 // 128 + tl.arange(0, G)
    c = tl.arange(0, 128)
    cols = (g * 128)[None, :, None] + c[None, None, :]
    w = tl.load(w_rows[:, :, None] + cols, mask=rmask[:, :, None] & (cols < K), other=0.0)
    if W_FP8:
        ws = tl.load(ws_rows + g[None, :], mask=rmask & (g < tl.cdiv(K, 128))[None, :], other=0.0)
    else:
        ws = 0.0
    return w, ws


@triton.jit
def _slab_dot(x_ptr, xs_ptr, stride_xsk, k0, K: tl.constexpr, w, ws, G: tl.constexpr, W_FP8: tl.constexpr,
              X_FP8: tl.constexpr):
    """[BN] fp32: x's columns k0 .. k0 + 128 G times the slab w [BN, G, 128], each group's sum scaled. A 16-bit
    x meeting FP8 weights is quantised here per 128 columns, as quant_fp8_kernel would (DeepSeek's recipe)."""
    g = k0 // 128 + tl.arange(0, G)
    cols = (g * 128)[:, None] + tl.arange(0, 128)[None, :]
    x = tl.load(x_ptr + cols, mask=cols < K, other=0.0).to(tl.float32)
    if W_FP8 and not X_FP8:
        x, xs = _quantize_rows(x, cols < K)
    part = tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)  # [BN, G]
    if X_FP8:
        part = part * tl.load(xs_ptr + g * stride_xsk, mask=g < tl.cdiv(K, 128), other=0.0)[None, :]
    elif W_FP8:
        part = part * xs[None, :]
    if W_FP8:
        part = part * ws
    return tl.sum(part, axis=1)


@triton.jit
def gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, o_ptr, N, stride_xsk, stride_wn, stride_wsn, K: tl.constexpr,
                BN: tl.constexpr, BK: tl.constexpr, W_FP8: tl.constexpr, X_FP8: tl.constexpr, PDL: tl.constexpr = False):
    """One program: BN outputs. K (a weight's width: a few values a model) is constant, so the K loop is bound
    on the host, which the interpreter needs. BK: a multiple of 128."""
    G: tl.constexpr = BK // 128
    rn = tl.program_id(0) * BN + tl.arange(0, BN)
    rmask = (rn < N)[:, None]
    w_rows = w_ptr + rn[:, None].to(tl.int64) * stride_wn
    ws_rows = ws_ptr + (rn // 128)[:, None] * stride_wsn
    w, ws = _load_slab(w_rows, ws_rows, 0, K, rmask, G, W_FP8)  # before the wait: weights only
    enter(PDL)
    acc = _slab_dot(x_ptr, xs_ptr, stride_xsk, 0, K, w, ws, G, W_FP8, X_FP8)
    for k0 in range(BK, K, BK):
        w, ws = _load_slab(w_rows, ws_rows, k0, K, rmask, G, W_FP8)
        acc += _slab_dot(x_ptr, xs_ptr, stride_xsk, k0, K, w, ws, G, W_FP8, X_FP8)
    tl.store(o_ptr + rn, acc.to(o_ptr.dtype.element_ty), mask=rn < N)
