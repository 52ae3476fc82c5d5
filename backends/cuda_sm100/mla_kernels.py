"""Triton kernels for MLA over the paged latent cache: fused cache write, split-KV attention, combine.

Imported only when a cuda_sm100 attention op runs (never by the package's __init__), since importing
triton is not free. The launch logic and the host-side schedule live in attention.py.

Cache views. The kernels take typed views of one layer's cache: `lat` (bf16 latent, or float8_e4m3fn for
the FP8 layout), `scl` (float32 view of the same bytes, FP8 only: per-token scales at `scale_off`) and
`rope` (bf16 view: the rope key at `rope_off`). Strides are in each view's elements, so one kernel serves
the bf16 [c_kv | k_pe] rows and DeepSeek's 656-byte FP8 rows alike.

Latent dimension. kv_lora_rank is processed as NC chunks of CH columns (CH = 128 = the FP8 scale group
when rank > 128, else the next power of two), written out chunk by chunk (acc0..acc3) because Triton
has no arrays of tensors; rank <= 512 is therefore the kernels' limit (attention.py falls back above).
"""


import triton
import triton.language as tl

from deepinfer.backends.cuda_sm100 import norm_rope_kernels as NRK
from deepinfer.backends.cuda_sm100.gemm_kernels import _cast
from deepinfer.backends.cuda_sm100.pdl import enter

LOG2E = 1.4426950408889634  # host side: softmax_scale * LOG2E is the kernels' qk_scale (exp2 domain)
_LN2 = tl.constexpr(0.6931471805599453)
_LOG2E = tl.constexpr(1.4426950408889634)


# --- exact rounding under the interpreter ---------------------------------------------------------------
# The Triton interpreter truncates float downcasts (fp32 -> bf16 / e4m3); the GPU rounds to nearest even.
# Cache writes must match torch bit for bit, so under the interpreter they round explicitly.


@triton.jit
def _to_bf16_rne(x, EXACT: tl.constexpr):
    if EXACT:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16, fp_downcast_rounding="rtne")


@triton.jit
def _to_e4m3_rne(x, EXACT: tl.constexpr):
    """x already clamped to [-448, 448]."""
    if EXACT:
        # Round onto the E4M3 grid (3 mantissa bits, subnormal step 2^-9) in fp32, then convert exactly.
        bits = x.to(tl.uint32, bitcast=True)
        e = tl.maximum(((bits >> 23) & 0xFF).to(tl.int32) - 127, -6)
        quantum = ((e + 124).to(tl.uint32) << 23).to(tl.float32, bitcast=True)
        y = (x / quantum + 12582912.0) - 12582912.0  # 1.5 * 2^23: fp32 add rounds to an integer, ties to even
        r = tl.abs(y * quantum)
        return tl.where(x < 0, -r, r).to(tl.float8e4nv)
    else:
        return x.to(tl.float8e4nv, fp_downcast_rounding="rtne")


# --- fused cache write --------------------------------------------------------------------------------


@triton.jit
def mla_write_kernel(
    c_ptr, pe_ptr, slot_ptr, n_tokens, stride_c, stride_pe,
    lat_ptr, scl_ptr, rope_ptr,
    lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off, BS,
    R: tl.constexpr, P: tl.constexpr, CH: tl.constexpr, PP: tl.constexpr, BD: tl.constexpr,
    BT: tl.constexpr, FP8: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr = False,
):
    """BT tokens per program: token t's (c_kv, k_pe) -> cache slot slot_ptr[t] (FP8: quantised per 128). BD: R's
    next power of two."""
    enter(PDL)
    t = tl.program_id(0) * BT + tl.arange(0, BT)
    tmask = t < n_tokens
    blk, off = _slots(slot_ptr, t, tmask, BS)
    t64 = t.to(tl.int64)
    cols = tl.arange(0, BD)
    x = tl.load(c_ptr + t64[:, None] * stride_c + cols[None, :], mask=tmask[:, None] & (cols < R)[None, :], other=0.0)
    _store_latent(x.to(tl.float32), tmask, blk, off, lat_ptr, scl_ptr, lat_sb, lat_st, scl_sb, scl_st, scale_off, R,
                  CH, BD, FP8, EXACT)
    pc = tl.arange(0, PP)
    pm = tmask[:, None] & (pc < P)[None, :]
    pe = tl.load(pe_ptr + t64[:, None] * stride_pe + pc[None, :], mask=pm, other=0.0).to(tl.float32)
    rrow = blk * rope_sb + off * rope_st + rope_off
    tl.store(rope_ptr + rrow[:, None] + pc[None, :], _to_bf16_rne(pe, EXACT), mask=pm)


@triton.jit
def _slots(slot_ptr, t, tmask, BS):
    """Tokens t's cache slots (the plan's slot mapping) as (block, offset in the block)."""
    slot = tl.load(slot_ptr + t, mask=tmask, other=0).to(tl.int64)
    return slot // BS, slot % BS


@triton.jit
def _store_latent(x, tmask, blk, off, lat_ptr, scl_ptr, lat_sb, lat_st, scl_sb, scl_st, scale_off, R: tl.constexpr,
                  CH: tl.constexpr, BD: tl.constexpr, FP8: tl.constexpr, EXACT: tl.constexpr):
    """Latent rows x [BT, BD] float32 (zero past R) into their slots (blk, off): bf16, or E4M3 with a float32
    scale per CH columns (their absolute maximum / 448; DeepSeek's layout)."""
    NG: tl.constexpr = BD // CH
    g = tl.arange(0, NG)
    cols = (g * CH)[:, None] + tl.arange(0, CH)[None, :]  # [NG, CH]
    m = tmask[:, None, None] & (cols < R)[None, :, :]
    ptrs = lat_ptr + (blk * lat_sb + off * lat_st)[:, None, None] + cols[None, :, :]
    x = tl.reshape(x, (x.shape[0], NG, CH))
    if FP8:
        scale = tl.maximum(tl.max(tl.abs(x), axis=2), 1e-12) / 448.0
        q = tl.clamp(x / scale[:, :, None], -448.0, 448.0)
        tl.store(ptrs, _to_e4m3_rne(q, EXACT), mask=m)
        srow = blk * scl_sb + off * scl_st + scale_off
        tl.store(scl_ptr + srow[:, None] + g[None, :], scale, mask=tmask[:, None] & (g * CH < R)[None, :])
    else:
        tl.store(ptrs, _to_bf16_rne(x, EXACT), mask=m)


@triton.jit(do_not_specialize=["T"])
def mla_rope_norm_write_kernel(
    q_ptr, kv_ptr, kpe_ptr, w_ptr, pos_ptr, cache_ptr, qo_ptr, ckv_ptr, ko_ptr,
    T, RF, P, stride_qt, stride_qh, stride_kv, stride_p, stride_c, eps,
    slot_ptr, lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off, BS,
    H: tl.constexpr, HALF: tl.constexpr, HALF_P: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_Q: tl.constexpr, INTERLEAVED: tl.constexpr,
    R: tl.constexpr, CH: tl.constexpr, FP8: tl.constexpr, EXACT: tl.constexpr, PDL: tl.constexpr = False,
    EARLY: tl.constexpr = False,
):
    """mla_rope_norm_kernel's work for a block of tokens (cache_ptr / P: the cos-sin cache and its length), the
    c_kv and k_pe rows going straight from registers into the cache as mla_write_kernel writes them: the fused
    cache write with the rope applied, one launch instead of two (ckv_ptr / ko_ptr are not written; their
    dtype is the rows' rounding before the cache's). Before the PDL wait it reads what no kernel of the step
    writes: the norm's weight, the tokens' positions and cos / sin rows, and their cache slots (the plan's)."""
    t0 = tl.program_id(0) * BLOCK_T
    toks = t0 + tl.arange(0, BLOCK_T)
    tmask = toks < T
    cols = tl.arange(0, BLOCK_D)
    w = tl.load(w_ptr + cols, mask=cols < R, other=0.0).to(tl.float32)
    cos, sin = NRK._rope_angles(pos_ptr, cache_ptr, toks, tmask, P, stride_p, stride_c, HALF, HALF_P)
    blk, off = _slots(slot_ptr, toks, tmask, BS)
    enter(PDL, EARLY)
    mask = tmask[:, None] & (cols < R)[None, :]
    x = tl.load(kv_ptr + toks.to(tl.int64)[:, None] * stride_kv + cols[None, :], mask=mask, other=0.0).to(tl.float32)
    ia, ib, pmask, k_a, k_b = NRK._rope_apply(kpe_ptr, toks.to(tl.int64), 0, tmask, cos, sin, stride_kv, 0, HALF,
                                              HALF_P, INTERLEAVED)
    NRK._rope_block_queries(t0, q_ptr, pos_ptr, cache_ptr, qo_ptr, T, P, stride_qt, stride_qh, stride_p, stride_c, H,
                            HALF, HALF_P, BLOCK_T, BLOCK_Q, INTERLEAVED, EXACT)
    c_kv, _ = NRK._norm_rows(x, x, w, mask, ckv_ptr, ckv_ptr, toks, RF, 0, 0, eps, BLOCK_D, False, EXACT, False)
    _store_latent(c_kv, tmask, blk, off, lat_ptr, scl_ptr, lat_sb, lat_st, scl_sb, scl_st, scale_off, R, CH, BLOCK_D,
                  FP8, EXACT)
    rope_row = rope_ptr + (blk * rope_sb + off * rope_st + rope_off)[:, None]
    k_ty: tl.constexpr = ko_ptr.dtype.element_ty  # k_pe rounded to the rows' dtype, then to the cache's bf16
    tl.store(rope_row + ia[None, :], _to_bf16_rne(_cast(k_a, k_ty, EXACT).to(tl.float32), EXACT), mask=pmask)
    tl.store(rope_row + ib[None, :], _to_bf16_rne(_cast(k_b, k_ty, EXACT).to(tl.float32), EXACT), mask=pmask)


# --- split-KV attention ---------------------------------------------------------------------------------


@triton.jit
def _tile_rows(bt_row, start, kv_end, BS, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off,
               BN: tl.constexpr, ALIGNED: tl.constexpr):
    """Keys [start, start + BN): their row offsets in the latent / scale / rope views, and the valid mask.
    ALIGNED (BN divides the block size and start is a multiple of BN): the tile lies in one block, so one
    block-table read and regular addresses; otherwise each key looks its block up."""
    offs = start + tl.arange(0, BN)
    nmask = offs < kv_end
    if ALIGNED:
        blk = tl.load(bt_row + start // BS, mask=start < kv_end, other=0).to(tl.int64)
        off = start % BS + tl.arange(0, BN)
    else:
        blk = tl.load(bt_row + offs // BS, mask=nmask, other=0).to(tl.int64)
        off = offs % BS
    row = blk * lat_sb + off * lat_st
    srow = blk * scl_sb + off * scl_st + scale_off
    rrow = blk * rope_sb + off * rope_st + rope_off
    return offs, nmask, row, srow, rrow


@triton.jit
def _load_latent(lat_ptr, row, nmask, c: tl.constexpr, R: tl.constexpr, CH: tl.constexpr):
    """Chunk c of the latent of BN keys, [BN, CH], as stored (bf16, or float8_e4m3fn)."""
    cols = c * CH + tl.arange(0, CH)
    return tl.load(lat_ptr + row[:, None] + cols[None, :], mask=nmask[:, None] & (cols < R)[None, :], other=0.0)


@triton.jit
def _load_rope(rope_ptr, rrow, nmask, P: tl.constexpr, PP: tl.constexpr):
    pc = tl.arange(0, PP)
    return tl.load(rope_ptr + rrow[:, None] + pc[None, :], mask=nmask[:, None] & (pc < P)[None, :], other=0.0)


@triton.jit
def _load_fp8_chunk(lat_ptr, scl_ptr, row, srow, nmask, c: tl.constexpr, R: tl.constexpr, CH: tl.constexpr):
    """Chunk c of an FP8 key tile as stored (E4M3, [BN, CH]) and its per-token scales."""
    return _load_latent(lat_ptr, row, nmask, c, R, CH), tl.load(scl_ptr + srow + c, mask=nmask, other=0.0)


@triton.jit
def _load_fp8_tile(lat_ptr, scl_ptr, rope_ptr, row, srow, rrow, nmask, R: tl.constexpr, P: tl.constexpr,
                   CH: tl.constexpr, NC: tl.constexpr, PP: tl.constexpr):
    """A whole FP8 key tile: latent chunks with their scales, and the bf16 rope key. Chunks past NC repeat
    chunk 0; the caller never reads them."""
    n0, s0 = _load_fp8_chunk(lat_ptr, scl_ptr, row, srow, nmask, 0, R, CH)
    n1, s1, n2, s2, n3, s3 = n0, s0, n0, s0, n0, s0
    if NC > 1:
        n1, s1 = _load_fp8_chunk(lat_ptr, scl_ptr, row, srow, nmask, 1, R, CH)
    if NC > 2:
        n2, s2 = _load_fp8_chunk(lat_ptr, scl_ptr, row, srow, nmask, 2, R, CH)
    if NC > 3:
        n3, s3 = _load_fp8_chunk(lat_ptr, scl_ptr, row, srow, nmask, 3, R, CH)
    return n0, s0, n1, s1, n2, s2, n3, s3, _load_rope(rope_ptr, rrow, nmask, P, PP)


@triton.jit
def fp8_operand(k8, scale, FOLD: tl.constexpr, CVT: tl.constexpr, DOT_T: tl.constexpr, INTERP: tl.constexpr,
                F32: tl.constexpr = False):
    """E4M3 tile -> bf16 MMA operand (times the token's scale unless FOLD). CVT 0: the cvt chain (e4m3x2 ->
    f16x2 -> f32 -> bf16). CVT 1: bit placement, ((b & 0x7f) << 4) | ((b & 0x80) << 8) is exactly the E4M3
    value times 2^-120 as bf16 (subnormals included), then x 2^120 (LLVM makes it one mul.bf16x2): integer
    ops instead of the conversion unit."""
    if CVT == 1:
        b = k8.to(tl.uint8, bitcast=True).to(tl.uint16)
        bits = ((b & 0x7F) << 4) | ((b & 0x80) << 8)
        if INTERP:  # the interpreter mis-converts subnormal bf16: build the fp32 bits instead
            x = (bits.to(tl.uint32) << 16).to(tl.float32, bitcast=True) * 1.329227995784916e36
        else:
            x = bits.to(tl.bfloat16, bitcast=True).to(tl.float32) * 1.329227995784916e36  # 2^120
    else:
        x = k8.to(tl.float32)
    if not FOLD:
        x = x * scale[:, None]
    return _operand(x, DOT_T, F32)


@triton.jit
def fp8_operand_kernel(x_ptr, s_ptr, o_ptr, N: tl.constexpr, CVT: tl.constexpr, FOLD: tl.constexpr,
                       DOT_T: tl.constexpr, INTERP: tl.constexpr):
    """Test hook: fp8_operand over an [N, N] tile of E4M3 codes (scale per row), stored as float32."""
    r = tl.arange(0, N)
    y = fp8_operand(tl.load(x_ptr + r[:, None] * N + r[None, :]), tl.load(s_ptr + r), FOLD, CVT, DOT_T, INTERP)
    tl.store(o_ptr + r[:, None] * N + r[None, :], y.to(tl.float32))


@triton.jit
def _operand(x, DOT_T: tl.constexpr, F32: tl.constexpr):
    """An MMA operand: rounded to bf16 as FlashMLA does, or kept float32 (F32: exact float32 attention)."""
    if F32:
        return x.to(tl.float32)
    else:
        return x.to(tl.bfloat16).to(DOT_T)


@triton.jit
def _mma(a, b, acc, F32: tl.constexpr):
    """a @ b (+ acc) on the tensor cores, or in true float32 (F32: no TF32 rounding of the operands)."""
    if F32:
        return tl.dot(a, b, acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


@triton.jit
def _load_q(q_ptr, qrow, rmask, c: tl.constexpr, R: tl.constexpr, CH: tl.constexpr, DOT_T: tl.constexpr,
            F32: tl.constexpr):
    cols = c * CH + tl.arange(0, CH)
    q = tl.load(q_ptr + qrow[:, None] + cols[None, :], mask=rmask[:, None] & (cols < R)[None, :], other=0.0)
    return _operand(q, DOT_T, F32)


@triton.jit
def _store_o(out_ptr, orow, acc, inv_l, omask, c: tl.constexpr, R: tl.constexpr, CH: tl.constexpr):
    cols = c * CH + tl.arange(0, CH)
    o = acc * inv_l[:, None]
    tl.store(out_ptr + orow[:, None] + cols[None, :], o.to(out_ptr.dtype.element_ty),
             mask=omask[:, None] & (cols < R)[None, :])


@triton.jit
def mla_attn_kernel(
    q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh,
    lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off, BS,
    bt_ptr, bt_stride, meta_ptr, meta_stride, items_ptr,
    out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr,
    H, qk_scale, row_tiles,
    R: tl.constexpr, P: tl.constexpr, CH: tl.constexpr, NC: tl.constexpr, PP: tl.constexpr,
    BM: tl.constexpr, BN: tl.constexpr, FP8: tl.constexpr, INTERP: tl.constexpr, MAX_SPAN: tl.constexpr,
    DOT_T: tl.constexpr, ALIGNED: tl.constexpr, FOLD: tl.constexpr, CVT: tl.constexpr, F32: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program = one work item (a sequence's KV range [kv_lo, kv_hi)) x one tile of BM query rows.
    An item's row tiles are consecutive programs (a 1-D grid of items x row_tiles), so they run together and
    its key tiles come from HBM once, then from L2.

    Rows of a sequence are (query j, head h) pairs, row = j * H + h: all of a sequence's queries share its
    keys, and query j (position seq_len - qlen + j) sees keys up to its own position. Items with
    slot == -1 write the normalised output and lse directly; slot >= 0 writes float32 partials at partial
    rows slot + j for the combine kernel; slot < -1 is capacity padding and does nothing.
    """
    # The work item and its sequence's metadata come from the step's plan, which the host wrote before the
    # step's first kernel: read before the PDL wait, their two dependent loads overlap the previous kernel.
    item = tl.program_id(0) // row_tiles
    seq = tl.load(items_ptr + item * 4)
    kv_lo = tl.load(items_ptr + item * 4 + 1)
    kv_hi = tl.load(items_ptr + item * 4 + 2)
    slot = tl.load(items_ptr + item * 4 + 3)
    tok0 = tl.load(meta_ptr + seq)
    qlen = tl.load(meta_ptr + meta_stride + seq)
    slen = tl.load(meta_ptr + 2 * meta_stride + seq)
    enter(PDL)

    rows = (tl.program_id(0) % row_tiles) * BM + tl.arange(0, BM)
    j = rows // H
    h = rows % H
    rmask = (j < qlen) & (slot >= -1)
    pos = tl.where(rmask, slen - qlen + j, -1)
    kv_end = tl.minimum(kv_hi, tl.max(pos, axis=0) + 1)  # causal: no key past the tile's last query
    tok = (tok0 + j).to(tl.int64)

    qrow = tok * q_st + h * q_sh
    q0 = _load_q(q_ptr, qrow, rmask, 0, R, CH, DOT_T, F32)
    if NC > 1:
        q1 = _load_q(q_ptr, qrow, rmask, 1, R, CH, DOT_T, F32)
    if NC > 2:
        q2 = _load_q(q_ptr, qrow, rmask, 2, R, CH, DOT_T, F32)
    if NC > 3:
        q3 = _load_q(q_ptr, qrow, rmask, 3, R, CH, DOT_T, F32)
    pc = tl.arange(0, PP)
    qpe = tl.load(qpe_ptr + (tok * qpe_st + h * qpe_sh)[:, None] + pc[None, :],
                  mask=rmask[:, None] & (pc < P)[None, :], other=0.0)
    qpe = _operand(qpe, DOT_T, F32)

    # Running max starts finite so fully masked rows give p = 0 and alpha = 1 instead of NaN.
    m_i = tl.full([BM], -1.0e30, tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    acc0 = tl.zeros([BM, CH], tl.float32)
    if NC > 1:
        acc1 = tl.zeros([BM, CH], tl.float32)
    if NC > 2:
        acc2 = tl.zeros([BM, CH], tl.float32)
    if NC > 3:
        acc3 = tl.zeros([BM, CH], tl.float32)

    bt_row = bt_ptr + seq.to(tl.int64) * bt_stride
    rows_args = (BS, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off)
    tile_args = (lat_ptr, scl_ptr, rope_ptr)
    # FP8 tiles go through a conversion before the MMA. 64-row tiles leave the loads to Triton's pipeliner
    # (asynchronous copies to shared memory); 16 / 32-row tiles measured faster loading the next tile's bytes
    # into registers one iteration ahead (H200, 2026-11-29 sweeps).
    PREFETCH: tl.constexpr = FP8 and BM < 64
    if PREFETCH:
        _, nm, row, srow, rrow = _tile_rows(bt_row, kv_lo, kv_end, *rows_args, BN, ALIGNED)
        nxt = _load_fp8_tile(*tile_args, row, srow, rrow, nm, R, P, CH, NC, PP)
    # The interpreter cannot loop to a runtime bound (numpy 2): there a host constexpr bound, masked tail.
    for rel in range(0, MAX_SPAN if INTERP else kv_end - kv_lo, BN):
        offs, nmask, row, srow, rrow = _tile_rows(bt_row, kv_lo + rel, kv_end, *rows_args, BN, ALIGNED)
        if FP8:
            # FOLD: scales multiply the scores and probabilities ([BM, BN]) instead of the [BN, R] tile, and
            # the MMA operand is the exact E4M3 value in bf16 (bf16 keeps fp32's range: p * scale is safe).
            # Fewer ALU ops per key, but one score matrix per chunk: for 16/32-row tiles. Otherwise the
            # tile is dequantised (for 64-row tiles, whose registers the wgmma accumulator fills).
            if PREFETCH:
                n0, sc0, n1, sc1, n2, sc2, n3, sc3, kpe = nxt
                _, nm, nrow, nsrow, nrrow = _tile_rows(bt_row, kv_lo + rel + BN, kv_end, *rows_args, BN, ALIGNED)
                nxt = _load_fp8_tile(*tile_args, nrow, nsrow, nrrow, nm, R, P, CH, NC, PP)
            else:  # chunk by chunk: each chunk's bytes are dead once converted
                n0, sc0 = _load_fp8_chunk(lat_ptr, scl_ptr, row, srow, nmask, 0, R, CH)
            k0 = fp8_operand(n0, sc0, FOLD, CVT, DOT_T, INTERP, F32)
            if NC > 1:
                if not PREFETCH:
                    n1, sc1 = _load_fp8_chunk(lat_ptr, scl_ptr, row, srow, nmask, 1, R, CH)
                k1 = fp8_operand(n1, sc1, FOLD, CVT, DOT_T, INTERP, F32)
            if NC > 2:
                if not PREFETCH:
                    n2, sc2 = _load_fp8_chunk(lat_ptr, scl_ptr, row, srow, nmask, 2, R, CH)
                k2 = fp8_operand(n2, sc2, FOLD, CVT, DOT_T, INTERP, F32)
            if NC > 3:
                if not PREFETCH:
                    n3, sc3 = _load_fp8_chunk(lat_ptr, scl_ptr, row, srow, nmask, 3, R, CH)
                k3 = fp8_operand(n3, sc3, FOLD, CVT, DOT_T, INTERP, F32)
            if not PREFETCH:
                kpe = _load_rope(rope_ptr, rrow, nmask, P, PP)
            kpe = _operand(kpe, DOT_T, F32)
            if FOLD:
                s = _mma(q0, tl.trans(k0), None, F32) * sc0[None, :]
                if NC > 1:
                    s += _mma(q1, tl.trans(k1), None, F32) * sc1[None, :]
                if NC > 2:
                    s += _mma(q2, tl.trans(k2), None, F32) * sc2[None, :]
                if NC > 3:
                    s += _mma(q3, tl.trans(k3), None, F32) * sc3[None, :]
            else:
                s = _mma(q0, tl.trans(k0), None, F32)
                if NC > 1:
                    s = _mma(q1, tl.trans(k1), s, F32)
                if NC > 2:
                    s = _mma(q2, tl.trans(k2), s, F32)
                if NC > 3:
                    s = _mma(q3, tl.trans(k3), s, F32)
        else:
            k0 = _operand(_load_latent(lat_ptr, row, nmask, 0, R, CH), DOT_T, F32)
            s = _mma(q0, tl.trans(k0), None, F32)
            if NC > 1:
                k1 = _operand(_load_latent(lat_ptr, row, nmask, 1, R, CH), DOT_T, F32)
                s = _mma(q1, tl.trans(k1), s, F32)
            if NC > 2:
                k2 = _operand(_load_latent(lat_ptr, row, nmask, 2, R, CH), DOT_T, F32)
                s = _mma(q2, tl.trans(k2), s, F32)
            if NC > 3:
                k3 = _operand(_load_latent(lat_ptr, row, nmask, 3, R, CH), DOT_T, F32)
                s = _mma(q3, tl.trans(k3), s, F32)
            kpe = _operand(_load_rope(rope_ptr, rrow, nmask, P, PP), DOT_T, F32)
        s = _mma(qpe, tl.trans(kpe), s, F32)
        s = s * qk_scale
        s = tl.where((offs[None, :] <= pos[:, None]) & nmask[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        if FP8 and FOLD:
            acc0 = _mma(_operand(p * sc0[None, :], DOT_T, F32), k0, acc0 * alpha[:, None], F32)
            if NC > 1:
                acc1 = _mma(_operand(p * sc1[None, :], DOT_T, F32), k1, acc1 * alpha[:, None], F32)
            if NC > 2:
                acc2 = _mma(_operand(p * sc2[None, :], DOT_T, F32), k2, acc2 * alpha[:, None], F32)
            if NC > 3:
                acc3 = _mma(_operand(p * sc3[None, :], DOT_T, F32), k3, acc3 * alpha[:, None], F32)
        else:
            pb = _operand(p, DOT_T, F32)
            acc0 = _mma(pb, k0, acc0 * alpha[:, None], F32)
            if NC > 1:
                acc1 = _mma(pb, k1, acc1 * alpha[:, None], F32)
            if NC > 2:
                acc2 = _mma(pb, k2, acc2 * alpha[:, None], F32)
            if NC > 3:
                acc3 = _mma(pb, k3, acc3 * alpha[:, None], F32)
        m_i = m_new

    has = l_i > 0.0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, (m_i + tl.log2(tl.where(has, l_i, 1.0))) * _LN2, float("-inf"))
    direct = slot == -1
    # Direct rows go to out/lse of token tok; split rows to the partial buffers at row slot + j.
    prow = (slot + j).to(tl.int64) * H + h
    dmask = rmask & direct
    pmask = rmask & (slot >= 0)
    orow = tok * o_st + h * o_sh
    _store_o(out_ptr, orow, acc0, inv_l, dmask, 0, R, CH)
    _store_o(po_ptr, prow * R, acc0, inv_l, pmask, 0, R, CH)
    if NC > 1:
        _store_o(out_ptr, orow, acc1, inv_l, dmask, 1, R, CH)
        _store_o(po_ptr, prow * R, acc1, inv_l, pmask, 1, R, CH)
    if NC > 2:
        _store_o(out_ptr, orow, acc2, inv_l, dmask, 2, R, CH)
        _store_o(po_ptr, prow * R, acc2, inv_l, pmask, 2, R, CH)
    if NC > 3:
        _store_o(out_ptr, orow, acc3, inv_l, dmask, 3, R, CH)
        _store_o(po_ptr, prow * R, acc3, inv_l, pmask, 3, R, CH)
    tl.store(lse_ptr + tok * H + h, lse, mask=dmask)
    tl.store(plse_ptr + prow, lse, mask=pmask)


# --- combine ----------------------------------------------------------------------------------------------


@triton.jit
def mla_combine_kernel(
    tok_seq_ptr, meta_ptr, meta_stride, po_ptr, plse_ptr, out_ptr, lse_ptr, o_st, o_sh, H,
    R: tl.constexpr, HB: tl.constexpr, DC: tl.constexpr, ST: tl.constexpr, INTERP: tl.constexpr,
    MAX_SPLITS: tl.constexpr, PDL: tl.constexpr = False, EARLY: tl.constexpr = False,
):
    """Merge the split partials of token t, heads [h0, h0 + HB), columns [d0, d0 + DC): softmax-weighted by
    each split's lse, in split order (the result does not depend on the rest of the batch). Tokens of
    sequences without partials (first slot -1) were written directly by the attention kernel: skipped."""
    t = tl.program_id(0)
    hs = tl.program_id(1) * HB + tl.arange(0, HB)
    cols = tl.program_id(2) * DC + tl.arange(0, DC)
    hmask = hs < H
    cmask = cols < R
    # The plan's metadata (host-written before the step's first kernel) before the PDL wait, as in the attention
    # kernel; the partials, which the previous kernel wrote, after it.
    seq = tl.load(tok_seq_ptr + t)
    tok0 = tl.load(meta_ptr + seq)
    qlen = tl.load(meta_ptr + meta_stride + seq)
    nsplit = tl.load(meta_ptr + 3 * meta_stride + seq)
    first_slot = tl.load(meta_ptr + 4 * meta_stride + seq)
    enter(PDL, EARLY)
    base = tl.where(first_slot >= 0, first_slot + (t - tok0), -1)
    n_loop = tl.where(base >= 0, nsplit, 0)
    m = tl.full([HB], float("-inf"), tl.float32)
    den = tl.zeros([HB], tl.float32)
    acc = tl.zeros([HB, DC], tl.float32)
    for s0 in range(0, MAX_SPLITS if INTERP else n_loop, ST):  # host bound under the interpreter, as above
        s = s0 + tl.arange(0, ST)
        smask = s < n_loop
        prow = (base + s * qlen).to(tl.int64)[:, None] * H + hs[None, :]  # [ST, HB]
        lmask = smask[:, None] & hmask[None, :]
        l = tl.load(plse_ptr + prow, mask=lmask, other=float("-inf"))
        o = tl.load(po_ptr + prow[:, :, None] * R + cols[None, None, :], mask=lmask[:, :, None] & cmask[None, None, :],
                    other=0.0)
        m_new = tl.maximum(m, tl.max(l, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        w = tl.exp2((l - m_safe[None, :]) * _LOG2E)
        alpha = tl.exp2((m - m_safe) * _LOG2E)
        acc = acc * alpha[:, None] + tl.sum(w[:, :, None] * o, axis=0)
        den = den * alpha + tl.sum(w, axis=0)
        m = m_new
    # Split 0 holds key 0, visible to every query, so den > 0 for every token that reaches here.
    done = n_loop > 0
    safe_den = tl.where(den > 0.0, den, 1.0)
    tt = t.to(tl.int64)
    optr = out_ptr + tt * o_st + hs[:, None] * o_sh + cols[None, :]
    tl.store(optr, (acc / safe_den[:, None]).to(out_ptr.dtype.element_ty), mask=hmask[:, None] & cmask[None, :] & done)
    tl.store(lse_ptr + tt * H + hs, m + tl.log(safe_den), mask=hmask & done & (tl.program_id(2) == 0))


# MMA operand type: bf16 on the GPU; float32 under the interpreter, whose tl.dot multiplies bf16 operands'
# raw bits (Triton 3.6 with numpy 2). bf16 values are exact in float32, so the interpreter's result is the
# GPU's up to accumulation order.
DOT_GPU = tl.bfloat16
DOT_INTERP = tl.float32
