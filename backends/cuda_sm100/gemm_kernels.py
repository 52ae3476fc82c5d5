"""Triton kernels of the cuda_sm100 GEMMs: FP8 block-scaled (DeepGEMM's recipe), bf16, NVFP4 weight-only,
grouped over experts (contiguous and masked layouts), and the per-token-group activation quantiser.

One tile kernel covers every variant through constexpr switches, so the numerics of the K loop (per-128
promotion of FP8 partial products) are written once:
  A_FP8   activations are e4m3 with fp32 scales per token per 128 channels (else float, cast in-kernel)
  B_KIND  0 dense float, 1 fp8 128x128 blocks, 2 nvfp4 (dequantised in registers, weight-only)
  LAYOUT  0 one matrix, 1 contiguous rows sorted by group (sizes on the device, no host sync),
          2 masked: A is [G, cap, K] with a row count per group (decode under CUDA graphs),
          3 strided groups: every group has cap rows, A / C / C-scale rows at g * stride_*g + row * stride_*m
            (per-head GEMMs reading [T, H, K] and writing [T, H, N] in place)
  FUSE_SILU  B holds [gate; up] (2I rows); the tile computes silu(gate) * up for I columns
  QUANT_OUT  the output (fused or not) is written as e4m3 + per-128 scales, ready for an FP8 GEMM
Every kernel runs under TRITON_INTERPRET=1 on CPU tensors too.
"""

from __future__ import annotations

import triton
import triton.language as tl

from deepinfer.backends.cuda_sm100.pdl import enter

FP8_MAX = tl.constexpr(448.0)


@triton.jit
def _round_e4m3(y):
    """Round float32 y (|y| <= 448) to the nearest e4m3 value, ties to even, as float32.

    The cast to float8e4nv afterwards is then exact. Done by hand because the interpreter's float32 -> e4m3
    conversion drops the carry when rounding crosses a binade (31.9 -> 16); on the GPU it costs a few
    integer ops in a memory-bound epilogue.
    """
    a = tl.abs(y)
    bits = a.to(tl.int32, bitcast=True)
    # Normal e4m3 (|y| >= 2^-6): keep 3 mantissa bits, round half to even on the 20 dropped bits.
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = kept.to(tl.float32, bitcast=True)
    # Subnormal e4m3: multiples of 2^-9; adding 1.5 * 2^23 rounds to an integer, half to even.
    sub = ((a * 512.0 + 12582912.0) - 12582912.0) * (1.0 / 512.0)
    r = tl.where(a >= 0.015625, normal, sub)
    return tl.where(y < 0, -r, r)


@triton.jit
def _cast(x, dtype: tl.constexpr, EXACT: tl.constexpr):
    """float32 -> dtype; EXACT (interpreter only) rounds to bf16 by hand: its own cast truncates."""
    if EXACT and dtype == tl.bfloat16:
        bits = x.to(tl.int32, bitcast=True)
        x = ((bits + 0x7FFF + ((bits >> 16) & 1)) & -65536).to(tl.float32, bitcast=True)
    return x.to(dtype)


@triton.jit
def _quantize_rows(x, mask):
    """[R, 128] float32 group tile -> (e4m3-valued float32 tile, fp32 scale per row), like quant.py."""
    amax = tl.max(tl.where(mask, tl.abs(x), 0.0), axis=1)
    scale = tl.math.div_rn(tl.maximum(amax, 1e-12), FP8_MAX)
    # Zeros (masked-off rows and columns, mostly) keep their value: div_rn sends a zero dividend to its slow path.
    nonzero = x != 0.0
    q = tl.where(nonzero, tl.math.div_rn(tl.where(nonzero, x, 1.0), scale[:, None]), x)
    q = tl.clamp(q, -FP8_MAX, FP8_MAX)
    return _round_e4m3(q), scale


@triton.jit(do_not_specialize=["M"])
def quant_fp8_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sk,
                     BLOCK_M: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr = False):
    """x [M, K] float -> q [M, K] e4m3, s (strided, [M, ceil(K/GROUP)] logical) fp32; one group column per program."""
    enter(PDL)
    pid_m = tl.program_id(0)
    kb = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = kb * GROUP + tl.arange(0, GROUP)
    mask = (rows[:, None] < M) & (cols[None, :] < K)
    rows64 = rows.to(tl.int64)
    x = tl.load(x_ptr + rows64[:, None] * stride_xm + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    q, scale = _quantize_rows(x, mask)
    tl.store(q_ptr + rows64[:, None] * stride_qm + cols[None, :], q.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + rows64 * stride_sm + kb * stride_sk, scale, mask=rows < M)


@triton.jit
def _nvfp4_tile(p_ptrs, s_ptrs, kmask_p, kmask_s, BN: tl.constexpr, BK: tl.constexpr):
    """Packed E2M1 [BN, BK/2] + e4m3 scales [BN, BK/16] -> e2m1 * block scale as float32 [BN, BK] (exact).

    Each code becomes float32 by bit placement: sign to bit 31, the three magnitude bits to 24-22, which is the
    E2M1 value times 2^-126 (code 1, 0.5, lands as a denormal). Times the scale (a denormal product at worst,
    exact: five significant bits) and 2^126, it is e2m1 * scale exactly, in a few integer ops and two multiplies
    where decoding exponent and mantissa apart took selects and conversions per weight."""
    p = tl.load(p_ptrs, mask=kmask_p, other=0).to(tl.uint32)
    s = tl.load(s_ptrs, mask=kmask_s, other=0.0).to(tl.float32)
    lo = ((p & 0x8) << 28) | ((p & 0x7) << 22)
    hi = ((p & 0x80) << 24) | ((p & 0x70) << 18)
    codes = tl.reshape(tl.join(lo, hi), (BN, BK))  # element 2i is the low nibble
    val = tl.reshape(codes.to(tl.float32, bitcast=True), (BN, BK // 16, 16)) * s[:, :, None]
    return tl.reshape(val, (BN, BK)) * 8.507059173023462e37  # 2^126


@triton.jit
def _tile_rows(pid_m, sizes_ptr, M, G, cap, LAYOUT: tl.constexpr, BM: tl.constexpr, G_P: tl.constexpr,
               CG: tl.constexpr = False):
    """Map a virtual M-tile to (group, first row, end row); end <= first means "nothing to do". CG: the sizes are
    read from L2 (past a non-coherent L1), for a kernel reading them before its PDL wait."""
    if LAYOUT == 1:
        # Each group's rows are cut into ceil(size / BM) tiles; tile t belongs to the first group whose
        # cumulative tile count exceeds t. The grid has ceil(M / BM) + G tiles, an upper bound.
        offs = tl.arange(0, G_P)
        sizes = tl.load(sizes_ptr + offs, mask=offs < G, other=0, cache_modifier=".cg" if CG else "").to(tl.int32)
        sizes = tl.maximum(sizes, 0)
        tiles = (sizes + BM - 1) // BM
        tile_end = tl.cumsum(tiles, 0)
        row_end = tl.cumsum(sizes, 0)
        g = tl.sum((tile_end <= pid_m).to(tl.int32), 0)
        sel = offs == g
        first_tile = tl.sum(tl.where(sel, tile_end - tiles, 0), 0)
        g_end = tl.sum(tl.where(sel, row_end, 0), 0)
        g_start = g_end - tl.sum(tl.where(sel, sizes, 0), 0)
        row0 = g_start + (pid_m - first_tile) * BM
        end = tl.where(g < G, tl.minimum(g_end, M), 0)
        return g, row0, end
    else:
        tiles_per_group = (cap + BM - 1) // BM
        g = pid_m // tiles_per_group
        if LAYOUT == 3:  # every group full
            count = cap + pid_m * 0
        else:
            count = tl.load(sizes_ptr + g).to(tl.int32)
            count = tl.minimum(tl.maximum(count, 0), cap)
        row0 = g * cap + (pid_m % tiles_per_group) * BM
        return g, row0, g * cap + count


@triton.jit(do_not_specialize=["M", "G", "T"])
def group_tile_map_kernel(sizes_ptr, map_ptr, M, G, T, BM: tl.constexpr, G_P: tl.constexpr):
    """map [T, 3] int32: (group, first row, end row) of each of T virtual BM-row tiles of the contiguous layout
    (as _tile_rows maps them), for kernels that read it instead of computing it (gemm_gluon_kernels)."""
    t = tl.program_id(0)
    g, row0, end = _tile_rows(t, sizes_ptr, M, G, 0, 1, BM, G_P)
    tl.store(map_ptr + 3 * t, g)
    tl.store(map_ptr + 3 * t + 1, row0)
    tl.store(map_ptr + 3 * t + 2, end)


@triton.jit
def grouped_tile(tile, num_pid_n, m_tiles, GROUP_M: tl.constexpr):
    """Tile id -> (row tile, column tile) in grouped order: GROUP_M row tiles walk the N tiles together, so
    their B tiles stay in L2. Scalar arithmetic only, so gemm_gluon_kernels' Gluon kernel calls it too."""
    width = GROUP_M * num_pid_n
    first_m = (tile // width) * GROUP_M
    rows = tl.minimum(m_tiles - first_m, GROUP_M)
    return first_m + (tile % width) % rows, (tile % width) // rows


@triton.jit
def _prefetch_rows_l2(b_ptr, rows, N, k0, K, stride_bn, LINES: tl.constexpr):
    """prefetch.global.L2 of LINES 128-byte lines of each row (< N) from column k0 on (unit column stride)."""
    per_line: tl.constexpr = 1024 // b_ptr.dtype.element_ty.primitive_bitwidth
    cols = tl.minimum(k0 + tl.arange(0, LINES) * per_line, K - 1)
    ptrs = b_ptr + tl.minimum(rows, N - 1)[:, None].to(tl.int64) * stride_bn + cols[None, :]
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


# Row counts change every step: keep them out of the specialisation key (one compile serves every M).
@triton.jit(do_not_specialize=["M", "G", "cap", "stride_cw", "M_TILES", "SPLIT_K"])
def gemm_kernel(
    a_ptr, as_ptr, b_ptr, bs_ptr, bg_ptr, c_ptr, cs_ptr, sizes_ptr,
    M, N, K, G, cap,
    stride_am, stride_asm, stride_ask,
    stride_bg, stride_bn, stride_bk, stride_bsg, stride_bsn, stride_bsk,
    stride_cm, stride_csm, stride_csk, stride_cw, M_TILES, stride_ag, stride_cg, stride_csg,
    A_FP8: tl.constexpr, B_KIND: tl.constexpr, LAYOUT: tl.constexpr, FUSE_SILU: tl.constexpr,
    QUANT_OUT: tl.constexpr, SPLIT_K, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
    COMPUTE: tl.constexpr, IEEE: tl.constexpr, ROUND_OUT: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, GROUP_M: tl.constexpr, G_P: tl.constexpr,
    IMPRECISE: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr, K_ITERS: tl.constexpr, EXACT: tl.constexpr,
    SCALAR_BS: tl.constexpr, IS_SPLIT: tl.constexpr, PDL: tl.constexpr = False, PREFETCH: tl.constexpr = 0,
):
    """C = A @ B^T per tile. N is the number of output columns (I when FUSE_SILU: B then has 2N rows).

    With IS_SPLIT, program_id(1) takes one of SPLIT_K (a runtime value: no recompile per split) slices of
    the K blocks and writes float32 partials to c_ptr + pid_k * stride_cw (summed by splitk_reduce_kernel).
    PREFETCH > 0 (under PDL, one matrix): before waiting for the previous kernel, this CTA asks for its weight
    rows (PREFETCH 128-byte lines of each) in L2, which nothing before it writes.
    """
    pid = tl.program_id(0)
    pid_k = tl.program_id(1)
    pid_m, pid_n = grouped_tile(pid, tl.cdiv(N, BN), M_TILES, GROUP_M)
    # The launcher makes SPLIT_K divide the K blocks, so every split runs the same trip count.
    kb_lo = pid_k * (tl.cdiv(K, BK) // SPLIT_K)
    if PREFETCH > 0:
        _prefetch_rows_l2(b_ptr, pid_n * BN + tl.arange(0, BN), N, kb_lo * BK, K, stride_bn, PREFETCH)
    enter(PDL)

    if LAYOUT == 0:
        g = pid_m * 0
        row0 = pid_m * BM
        row_end = M + pid_m * 0
    else:
        g, row0, row_end = _tile_rows(pid_m, sizes_ptr, M, G, cap, LAYOUT, BM, G_P)
    if row0 >= row_end:
        return
    g64 = g.to(tl.int64)

    offs_m = row0 + tl.arange(0, BM)
    offs_n = pid_n * BN + tl.arange(0, BN)
    # Rows/columns past the end are read from a valid row (clamped) and never stored: the K loop stays unmasked.
    safe_m = tl.minimum(offs_m, row_end - 1).to(tl.int64)
    safe_n = tl.minimum(offs_n, N - 1)
    offs_k = tl.arange(0, BK)

    acc = tl.zeros((BM, BN), dtype=tl.float32)
    if FUSE_SILU:
        acc_up = tl.zeros((BM, BN), dtype=tl.float32)

    if not USE_TMA:  # with TMA, a_ptr / b_ptr are tensor descriptors
        if LAYOUT == 3:
            a_rows = a_ptr + g64 * stride_ag + (safe_m - g64 * cap)[:, None] * stride_am
        else:
            a_rows = a_ptr + safe_m[:, None] * stride_am
        b_rows = b_ptr + g64 * stride_bg + safe_n[:, None].to(tl.int64) * stride_bn
    up_off = tl.cast(N, tl.int64) * stride_bn  # B rows N.. 2N-1 are the up projection
    if A_FP8:
        as_rows = as_ptr + safe_m * stride_asm
    if B_KIND == 1:
        bs_cols = bs_ptr + g64 * stride_bsg + (safe_n // 128) * stride_bsn
        bs_up = bs_ptr + g64 * stride_bsg + ((safe_n + N) // 128) * stride_bsn
        bs_tile = bs_ptr + g64 * stride_bsg + (pid_n * BN // 128) * stride_bsn
        bs_tile_up = bs_ptr + g64 * stride_bsg + ((pid_n * BN + N) // 128) * stride_bsn
    if B_KIND == 2:
        offs_kp = tl.arange(0, BK // 2)
        offs_ks = tl.arange(0, BK // 16)
        bsc_rows = bs_ptr + g64 * stride_bsg + safe_n[:, None].to(tl.int64) * stride_bsn

    # K_ITERS > 0 only under the interpreter, whose loops need a Python int bound (it turns every assigned
    # value into a 1-element array, which range() rejects); on the GPU the trip count stays a runtime value.
    for it in tl.range(0, K_ITERS if K_ITERS > 0 else tl.cdiv(K, BK) // SPLIT_K, num_stages=STAGES, warp_specialize=WS):
        kb = kb_lo + it
        k0 = kb * BK
        kmask = (k0 + offs_k) < K
        # ---- A tile [BM, BK]
        if USE_TMA:
            a = a_ptr.load([row0, k0])
        elif EVEN_K:
            a = tl.load(a_rows + (k0 + offs_k)[None, :])
        else:
            a = tl.load(a_rows + (k0 + offs_k)[None, :], mask=kmask[None, :], other=0.0)
        if not A_FP8:
            a = a.to(COMPUTE)
        # ---- B tile(s) [BN, BK]
        if B_KIND == 2:
            kp = k0 // 2 + offs_kp
            ks = k0 // 16 + offs_ks
            pmask = (kp < (K + 1) // 2)[None, :]
            smask = (ks < (K + 15) // 16)[None, :]
            b = _nvfp4_tile(b_rows + kp[None, :] * stride_bk, bsc_rows + ks[None, :] * stride_bsk,
                            pmask, smask, BN, BK).to(COMPUTE)
            if FUSE_SILU:
                b2 = _nvfp4_tile(b_rows + up_off + kp[None, :] * stride_bk,
                                 bsc_rows + tl.cast(N, tl.int64) * stride_bsn + ks[None, :] * stride_bsk,
                                 pmask, smask, BN, BK).to(COMPUTE)
        else:
            if USE_TMA:
                # B viewed as [G * rows_per_group, K]; stride_bg // stride_bn = rows per group
                b_row = g * (stride_bg // stride_bn) + pid_n * BN
                b = b_ptr.load([b_row, k0])
                if FUSE_SILU:
                    b2 = b_ptr.load([b_row + N, k0])
            elif EVEN_K:
                b = tl.load(b_rows + (k0 + offs_k)[None, :] * stride_bk)
                if FUSE_SILU:
                    b2 = tl.load(b_rows + up_off + (k0 + offs_k)[None, :] * stride_bk)
            else:
                b = tl.load(b_rows + (k0 + offs_k)[None, :] * stride_bk, mask=kmask[None, :], other=0.0)
                if FUSE_SILU:
                    b2 = tl.load(b_rows + up_off + (k0 + offs_k)[None, :] * stride_bk, mask=kmask[None, :], other=0.0)
            if B_KIND == 0:
                b = b.to(COMPUTE)
                if FUSE_SILU:
                    b2 = b2.to(COMPUTE)
        # ---- multiply-accumulate
        if B_KIND == 1:
            # DeepSeek-V3 promotion: each 128-wide K block's partial product is scaled (token-group scale x
            # weight block scale) and summed in float32 registers.
            a_s = tl.load(as_rows + kb * stride_ask)
            part = tl.dot(a, tl.trans(b), max_num_imprecise_acc=IMPRECISE)
            if SCALAR_BS:  # the tile lies in one 128-row weight block: one scale, one FMA per element
                acc += part * (a_s * tl.load(bs_tile + kb * stride_bsk))[:, None]
            else:
                acc += part * (a_s[:, None] * tl.load(bs_cols + kb * stride_bsk)[None, :])
            if FUSE_SILU:
                part2 = tl.dot(a, tl.trans(b2), max_num_imprecise_acc=IMPRECISE)
                if SCALAR_BS:
                    acc_up += part2 * (a_s * tl.load(bs_tile_up + kb * stride_bsk))[:, None]
                else:
                    acc_up += part2 * (a_s[:, None] * tl.load(bs_up + kb * stride_bsk)[None, :])
        elif IEEE:
            acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
            if FUSE_SILU:
                acc_up = tl.dot(a, tl.trans(b2), acc_up, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(b), acc)
            if FUSE_SILU:
                acc_up = tl.dot(a, tl.trans(b2), acc_up)

    if B_KIND == 2:
        gs = tl.load(bg_ptr + g)
        acc = acc * gs
        if FUSE_SILU:
            acc_up = acc_up * gs

    row_ok = offs_m < row_end
    col_ok = offs_n < N
    out_mask = row_ok[:, None] & col_ok[None, :]
    offs_m64 = offs_m.to(tl.int64)
    if LAYOUT == 3:
        c_rows = g64 * stride_cg + (offs_m64 - g64 * cap) * stride_cm
        s_rows = g64 * stride_csg + (offs_m64 - g64 * cap) * stride_csm
    else:
        c_rows = offs_m64 * stride_cm
        s_rows = offs_m64 * stride_csm
    c_ptrs = c_ptr + c_rows[:, None] + offs_n[None, :]
    if IS_SPLIT:
        tl.store(c_ptrs + pid_k.to(tl.int64) * stride_cw, acc, mask=out_mask)
        return
    if FUSE_SILU:
        # Same roundings as the unfused path: GEMM output in the activation dtype, silu*up in float32,
        # rounded again to the activation dtype.
        gate = _cast(acc, ROUND_OUT, EXACT).to(tl.float32)
        up = _cast(acc_up, ROUND_OUT, EXACT).to(tl.float32)
        acc = _cast(gate / (1.0 + tl.exp(-gate)) * up, ROUND_OUT, EXACT).to(tl.float32)
    elif QUANT_OUT:  # the output as the activation dtype holds it, then quantised: as the unfused pair does
        acc = _cast(acc, ROUND_OUT, EXACT).to(tl.float32)
    if QUANT_OUT:
        # BN == 128 == the quantisation group, so each row of the tile is one token group.
        q, scale = _quantize_rows(acc, out_mask)
        tl.store(c_ptrs, q.to(tl.float8e4nv), mask=out_mask)
        tl.store(cs_ptr + s_rows + pid_n * stride_csk, scale, mask=row_ok)
        return
    tl.store(c_ptrs, _cast(acc, c_ptr.dtype.element_ty, EXACT), mask=out_mask)


@triton.jit(do_not_specialize=["MN"])
def splitk_reduce_kernel(w_ptr, c_ptr, MN, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr, EXACT: tl.constexpr,
                         PDL: tl.constexpr = False):
    """c = sum over the split-K partials w [SPLIT_K, M*N] (fixed order: deterministic)."""
    enter(PDL)
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < MN
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(w_ptr + s * MN + offs, mask=mask, other=0.0)
    tl.store(c_ptr + offs, _cast(acc, c_ptr.dtype.element_ty, EXACT), mask=mask)


@triton.jit
def silu_mul_kernel(x_ptr, o_ptr, R, N, stride_xr, stride_or, BLOCK_R: tl.constexpr, BLOCK_N: tl.constexpr,
                    QUANT: tl.constexpr, s_ptr, stride_sr, stride_sk, EXACT: tl.constexpr, PDL: tl.constexpr = False):
    """[R, 2N] (gate | up) -> silu(gate) * up [R, N] in o's dtype; with QUANT (BLOCK_N == 128) e4m3 + scales."""
    enter(PDL)
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (rows[:, None] < R) & (cols[None, :] < N)
    rows64 = rows.to(tl.int64)
    base = x_ptr + rows64[:, None] * stride_xr + cols[None, :]
    gate = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(base + N, mask=mask, other=0.0).to(tl.float32)
    h = gate / (1.0 + tl.exp(-gate)) * up
    if QUANT:
        h = _cast(h, x_ptr.dtype.element_ty, EXACT).to(tl.float32)
        q, scale = _quantize_rows(h, mask)
        tl.store(o_ptr + rows64[:, None] * stride_or + cols[None, :], q.to(tl.float8e4nv), mask=mask)
        tl.store(s_ptr + rows64 * stride_sr + tl.program_id(1) * stride_sk, scale, mask=rows < R)
    else:
        tl.store(o_ptr + rows64[:, None] * stride_or + cols[None, :], _cast(h, o_ptr.dtype.element_ty, EXACT), mask=mask)
