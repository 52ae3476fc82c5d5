"""FP8 block-scaled GEMM of a decode step's few E4M3 rows, with the weight rows as the MMA's M ("weights as M").

At decode sizes a projection reads its whole weight for 1-32 rows. gemm_kernel's 16-row tile makes the rows the
MMA's M, and a Hopper wgmma needs 64 there, so Triton runs it on mma.sync, which has no E4M3 form on sm_90: every
weight is converted to float16 first (sm_90 PTX: 96 cvt.rn.f16x2.e4m3x2 a K step of a 16 x 64 x 128 gate/up tile).
Transposed, out^T = W x^T, the weight tile [BN, 128] is the M of an m64n16k32 E4M3 wgmma read straight from
shared memory and the rows (padded to 16) its N: no per-weight instruction remains.

Numerics are gemm_kernel's A_FP8 / B_KIND 1 path: each 128-wide K block's partial product (four k32 wgmmas) is
scaled by its row's activation scale times the weight block's scale and summed in float32 registers (DeepSeek-V3's
promotion). The rows come quantised (quant_fp8_kernel's, or the caller's): quantising them here, in every program
of the grid, cost more than the separate launch (H200: 31 against 16 us for a batch-1 expert gate/up).
GATED: the weight holds [gate; up] (2N rows) and the output is silu(gate) * up with gemm_kernel's roundings.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.backends.cuda_sm100.gemm_kernels import _cast, _prefetch_rows_l2, _tile_rows
from deepinfer.backends.cuda_sm100.pdl import enter

BK = tl.constexpr(128)  # one weight scale block along K a step


@triton.jit(do_not_specialize=["M", "G"])
def fp8_wm_kernel(x_ptr, xs_ptr, w_ptr, ws_ptr, o_ptr, sizes_ptr, M, N, G, stride_xm, stride_xsm, stride_xsk,
                  stride_wg, stride_wn, stride_wsg, stride_wsn, stride_om, K: tl.constexpr, BN: tl.constexpr,
                  BM: tl.constexpr, GROUPED: tl.constexpr, G_P: tl.constexpr, GATED: tl.constexpr,
                  STAGES: tl.constexpr, EXACT: tl.constexpr, PREFETCH: tl.constexpr = 0, PDL: tl.constexpr = False):
    """x [M, K] E4M3 with scales xs [M, K / 128] (any strides) -> o [M, N]. Program (j, t): output columns
    j * BN .. + BN of row tile t. GROUPED: rows sorted by group, group sizes
    [G] on the device, tile t as gemm_kernel's contiguous layout maps it (its group's weight; tiles past the
    last do nothing); else one weight and rows t * BM .. + BM. K (a multiple of 128) and BN (a divisor of 128;
    GATED: of N too) keep every tile in one 128-row scale block. PREFETCH (one matrix, under PDL): that many
    128-byte lines of each weight row asked into L2 before the wait for the previous kernel (nothing before it
    writes weights)."""
    pid_n = tl.program_id(0)
    pid_r = tl.program_id(1)
    rn = pid_n * BN + tl.arange(0, BN)
    safe_n = tl.minimum(rn, N - 1)
    if GROUPED:
        enter(PDL)
        g, row0, end = _tile_rows(pid_r, sizes_ptr, M, G, 0, 1, BM, G_P)
        if row0 >= end:
            return
    else:
        if PREFETCH > 0:
            _prefetch_rows_l2(w_ptr, safe_n, N, 0, K, stride_wn, PREFETCH)
        enter(PDL)
        g = pid_r * 0
        row0 = pid_r * BM
        end = M + pid_r * 0
    g64 = g.to(tl.int64)
    rows = row0 + tl.arange(0, BM)
    rmask = rows < end
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    xs_rows = xs_ptr + rows.to(tl.int64) * stride_xsm
    w_rows = w_ptr + g64 * stride_wg + safe_n.to(tl.int64)[:, None] * stride_wn + tl.arange(0, BK)[None, :]
    ws_tile = ws_ptr + g64 * stride_wsg + (pid_n * BN // 128) * stride_wsn
    u_rows = w_rows + tl.cast(N, tl.int64) * stride_wn  # GATED: rows N .. 2N - 1 are the up projection
    us_tile = ws_ptr + g64 * stride_wsg + ((pid_n * BN + N) // 128) * stride_wsn

    acc = tl.zeros((BN, BM), dtype=tl.float32)
    if GATED:
        acc_up = tl.zeros((BN, BM), dtype=tl.float32)
    for kb in tl.range(0, K // BK, num_stages=STAGES):
        xq_t = tl.trans(tl.load(x_rows + kb * BK + tl.arange(0, BK)[None, :], mask=rmask[:, None], other=0.0))
        xs = tl.load(xs_rows + kb * stride_xsk, mask=rmask, other=1.0)
        w = tl.load(w_rows + kb * BK)
        acc += tl.dot(w, xq_t) * (tl.load(ws_tile + kb) * xs)[None, :]
        if GATED:
            u = tl.load(u_rows + kb * BK)
            acc_up += tl.dot(u, xq_t) * (tl.load(us_tile + kb) * xs)[None, :]

    out_ty: tl.constexpr = o_ptr.dtype.element_ty
    if GATED:  # gemm_kernel's FUSE_SILU: gate and up rounded to the output dtype, silu * up in float32
        gate = _cast(acc, out_ty, EXACT).to(tl.float32)
        up = _cast(acc_up, out_ty, EXACT).to(tl.float32)
        acc = gate / (1.0 + tl.exp(-gate)) * up
    o_ptrs = o_ptr + rows.to(tl.int64)[None, :] * stride_om + rn[:, None]
    tl.store(o_ptrs, _cast(acc, out_ty, EXACT), mask=rmask[None, :] & (rn < N)[:, None])
