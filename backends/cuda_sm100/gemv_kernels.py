"""Decode-step GEMV: out[r, n] = sum_k x[r, k] w[n, k] for the one row of a batch-1 decode step, for each of a
few rows sorted by expert (a batch-1 step's routed and shared experts, each row its own expert's weight), or for
each head's row with its own matrix (MLA's absorbed projections at one token).

At batch 1 a projection reads its whole weight for one row, so all that counts is keeping HBM busy. A GEMM tile
pads the row to an MMA's 16 and pipelines narrow K steps; here each program takes BN weight rows and loads BK
columns of them at once (its whole slab when K <= BK), multiplies them by the row in fp32 on the FMA units and
reduces once per K step. One matrix under PDL: the first K step of the weight (which no earlier kernel writes)
is loaded before the wait for the previous kernel, so its streaming overlaps that kernel's tail; x is read only
after the wait (per-head matrices alike). Grouped rows need their group sizes first, so they wait at once, unless
the sizes are settled (SIZES_EARLY: an earlier launch already read them, so their writer is at least two launches
back and done once this kernel can start); then they too load their first slab before the wait.

Weights are 16-bit, or E4M3 with a float32 scale per 128 x 128 block (W_FP8); x is 16-bit (quantised in the
kernel when the weight is E4M3, with quant_fp8_kernel's own helper), or E4M3 with a scale per 128 columns
(X_FP8, quant.Fp8Activations). Tiles are [BN, BK / 128, 128] so that each 128-column group's sum meets its
scales before the groups are added. GATED: the weight holds [gate; up] (2N rows) and the output is
silu(gate) * up, with gemm_kernel's roundings.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.backends.cuda_sm100.gemm_kernels import _cast, _quantize_rows, _tile_rows
from deepinfer.backends.cuda_sm100.pdl import enter


@triton.jit
def _load_slab(w_rows, ws_rows, k0, K: tl.constexpr, rmask, GK: tl.constexpr, W_FP8: tl.constexpr):
    """Weight columns k0 .. k0 + 128 GK of the program's rows (w_rows, rmask [BN, 1]) as [BN, GK, 128] (zero past
    K), and their block scales [BN, GK] (W_FP8; else a placeholder)."""
    g = k0 // 128 + tl.arange(0, GK)
    cols = (g * 128)[None, :, None] + tl.arange(0, 128)[None, None, :]
    w = tl.load(w_rows[:, :, None] + cols, mask=rmask[:, :, None] & (cols < K), other=0.0)
    if W_FP8:
        ws = tl.load(ws_rows + g[None, :], mask=rmask & (g < tl.cdiv(K, 128))[None, :], other=0.0)
    else:
        ws = 0.0
    return w, ws


@triton.jit
def _load_row(x_row, xs_row, stride_xsk, k0, K: tl.constexpr, GK: tl.constexpr, W_FP8: tl.constexpr,
              X_FP8: tl.constexpr):
    """Columns k0 .. k0 + 128 GK of one row as float32 [GK, 128] (zero past K), and their scales [GK] when the
    products need them (E4M3 x, or a 16-bit x quantised here to meet E4M3 weights; else a placeholder)."""
    g = k0 // 128 + tl.arange(0, GK)
    cols = (g * 128)[:, None] + tl.arange(0, 128)[None, :]
    x = tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)
    xs = 0.0
    if X_FP8:
        xs = tl.load(xs_row + g * stride_xsk, mask=g < tl.cdiv(K, 128), other=0.0)
    elif W_FP8:
        x, xs = _quantize_rows(x, cols < K)
    return x, xs


@triton.jit
def _slab_dot(x, xs, w, ws, W_FP8: tl.constexpr, X_FP8: tl.constexpr):
    """[BN] fp32: the row part x [GK, 128] times the slab w [BN, GK, 128], each group's sum scaled."""
    part = tl.sum(w.to(tl.float32) * x[None, :, :], axis=2)  # [BN, GK]
    if X_FP8 or W_FP8:
        part = part * xs[None, :]
    if W_FP8:
        part = part * ws
    return tl.sum(part, axis=1)


@triton.jit
def gemv_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, o_ptr, sizes_ptr, M, N, G, stride_xm, stride_xsm, stride_xsk,
                stride_wg, stride_wn, stride_wsg, stride_wsn, stride_om, K: tl.constexpr, BN: tl.constexpr,
                BK: tl.constexpr, W_FP8: tl.constexpr, X_FP8: tl.constexpr, GROUPED: tl.constexpr, G_P: tl.constexpr,
                GATED: tl.constexpr, EXACT: tl.constexpr, SIZES_EARLY: tl.constexpr = False, TAIL: tl.constexpr = 0,
                PDL: tl.constexpr = False, EARLY: tl.constexpr = False):
    """Program (r, j): BN outputs of row r (GROUPED: of the r-th row of the rows sorted by group, its group's
    weight; grid rows past M do nothing). K (a weight's width: a few values a model) is constant, so the K loop
    is bound on the host, which the interpreter needs. BK: a multiple of 128.
    TAIL > 0 (GROUPED, the grid's M rows exactly): the last TAIL rows are one row each of the last TAIL groups,
    and x was written at least two launches back (Backend.gated_linear's settled_tail). Their programs need no
    sizes and compute their outputs before the PDL wait, storing after it; the grid is then (N tiles, rows),
    rows taken last first, so that those programs are the first to be scheduled. EARLY: pdl.enter's (per-head
    matrices)."""
    GK: tl.constexpr = BK // 128
    if TAIL > 0:
        pid_r = M - 1 - tl.program_id(1)
        pid_n = tl.program_id(0)
    else:
        pid_r = tl.program_id(0)
        pid_n = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    rmask = (rn < N)[:, None]
    early = False  # (TAIL: a runtime flag) this program computes before the wait
    if TAIL > 0:
        early = pid_r >= M - TAIL
    if GROUPED:
        if early:
            g = G - M + pid_r
            row = pid_r
        else:
            if not SIZES_EARLY:
                enter(PDL, EARLY)
            g, row, end = _tile_rows(pid_r, sizes_ptr, M, G, 0, 1, 1, G_P, SIZES_EARLY)
            if row >= end:
                if SIZES_EARLY:
                    enter(PDL, EARLY)
                return
    else:
        row = pid_r
        g = row  # row r's own matrix (per head); one matrix for every row where stride_wg = stride_wsg = 0
    g64 = g.to(tl.int64)
    w_rows = w_ptr + g64 * stride_wg + rn[:, None].to(tl.int64) * stride_wn
    ws_rows = ws_ptr + g64 * stride_wsg + (rn // 128)[:, None] * stride_wsn
    u_rows = w_rows + tl.cast(N, tl.int64) * stride_wn  # GATED: rows N .. 2N - 1 are the up projection
    us_rows = ws_ptr + g64 * stride_wsg + ((rn + N) // 128)[:, None] * stride_wsn
    w, ws = _load_slab(w_rows, ws_rows, 0, K, rmask, GK, W_FP8)  # one matrix: before the wait (weights only)
    if GATED:
        u, us = _load_slab(u_rows, us_rows, 0, K, rmask, GK, W_FP8)
    if not GROUPED or SIZES_EARLY:
        if not early:
            enter(PDL, EARLY)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    xs_row = xs_ptr + row.to(tl.int64) * stride_xsm
    x, xs = _load_row(x_row, xs_row, stride_xsk, 0, K, GK, W_FP8, X_FP8)
    acc = _slab_dot(x, xs, w, ws, W_FP8, X_FP8)
    if GATED:
        acc_up = _slab_dot(x, xs, u, us, W_FP8, X_FP8)
    for k0 in range(BK, K, BK):
        w, ws = _load_slab(w_rows, ws_rows, k0, K, rmask, GK, W_FP8)
        if GATED:
            u, us = _load_slab(u_rows, us_rows, k0, K, rmask, GK, W_FP8)
        x, xs = _load_row(x_row, xs_row, stride_xsk, k0, K, GK, W_FP8, X_FP8)
        acc += _slab_dot(x, xs, w, ws, W_FP8, X_FP8)
        if GATED:
            acc_up += _slab_dot(x, xs, u, us, W_FP8, X_FP8)
    if early:
        enter(PDL, EARLY)
    out_ty: tl.constexpr = o_ptr.dtype.element_ty
    if GATED:  # as gemm_kernel's FUSE_SILU: gate and up rounded to the output dtype, silu * up in float32
        gate = _cast(acc, out_ty, EXACT).to(tl.float32)
        up = _cast(acc_up, out_ty, EXACT).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(o_ptr + row.to(tl.int64) * stride_om + rn, _cast(acc, out_ty, EXACT), mask=rn < N)
