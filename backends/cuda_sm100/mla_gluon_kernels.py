"""MLA decode over the paged latent cache (bf16 or FP8) in Gluon, for 64-row tiles (64 query heads a program).

Why a second kernel: Triton 3.6 compiles mla_attn_kernel's 64-row tile with both warpgroups computing the
whole 64 x 64 score tile (its layout rule for chained dots puts all warps along M), on 32-wide wgmma
instructions, and its pipeliner issues the next key tile's copies at the end of an iteration, so every
iteration waits out a tile's memory latency (sm_90 compile, benchmarks/RESULTS.md, issue 8). Gluon states
layouts and shared memory explicitly, so here:

- the warpgroups split the score tile's keys (layout warps [4, 2]): each computes 32 of the 64 key columns
  over all 576 channels, no score is computed twice;
- the probabilities go through shared memory once and both warpgroups multiply them into their own 256 of
  the 512 output columns;
- key tile i + 2 is copied (cp.async) into the buffer tile i leaves, right after tile i's last MMA, so a
  tile's copy has a whole iteration of MMAs and softmax to land, and block-table entries are read one tile
  earlier still;
- FP8 cache: the E4M3 bytes are copied the same way (half the bytes) with their scales loaded into registers
  alongside, and each tile is dequantised once into a float16 tile in shared memory that both MMAs read (the
  shared memory of the second 16-bit buffer holds the two byte buffers), with float16 queries and P (H200,
  128 heads: 4% faster than a bf16 tile, whose scaling took three times the instructions).

Same contract as mla_attn_kernel (work items, rows = query x head, direct or partial outputs with log-sum-exp),
restricted to what mla_launch.gluon_tile_usable checks: bf16 queries, rank 512, rope 64, tiles aligned to
blocks. GPU only: Gluon has no interpreter, so the conformance tests run it on the H200 and the
CPU tests exercise mla_attn_kernel.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

_LN2 = gl.constexpr(0.6931471805599453)

R = 512  # latent width the kernel is written for (DeepSeek's kv_lora_rank)
P = 64  # rope width
BM = 64  # query rows per program: one wgmma M
BN = 64  # keys per tile
NUM_WARPS = 8  # two warpgroups
SMEM_BYTES = 229888  # shared memory a program takes (sm_90 compile): queries, two key tiles, P, scratch


@gluon.constexpr_function
def copy_layout(kind, warps, fp8=False):
    """A distributed layout of a program's copies and dequantisation, `warps` warps stacked along the rows: "q"
    query rows (16-byte vectors along a row), "lat" key tiles (bf16 as the queries, E4M3 bytes 16 a thread),
    "pe" rope rows, "dq" the E4M3 tile's dequantisation, "sc" its scales (rows as "dq"'s, a row's 4 a thread)."""
    if kind == "lat" and fp8:
        return gl.BlockedLayout([1, 16], [2, 16], [warps, 1], [1, 0])
    shapes = {"q": ([1, 8], [1, 32]), "lat": ([1, 8], [1, 32]), "pe": ([1, 8], [4, 8]), "dq": ([1, 16], [8, 4]),
              "sc": ([1, R // 128], [8, 4])}
    size, threads = shapes[kind]
    return gl.BlockedLayout(size, threads, [warps, 1], [1, 0])


@gluon.jit
def _gdc_enter(PDL: gl.constexpr, EARLY: gl.constexpr = False):
    """As pdl.enter: wait for the previous grid, then let the next one launch (EARLY: the other way round)."""
    if PDL:
        if EARLY:
            _gdc_launch_dependents()
        gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        if not EARLY:
            _gdc_launch_dependents()


@gluon.jit
def _gdc_launch_dependents():
    gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32, is_pure=False,
                              pack=1)


@gluon.jit
def _work_item(items_ptr, meta_ptr, meta_stride, H, row_tiles, BM: gl.constexpr):
    """This program's work item and row tile: (first row, sequence, first key, key end, partial slot, first query
    token, queries, sequence length). Causal: no key past the tile's last query (row0 + BM - 1, or the sequence's
    last); padding items and tiles without query rows get no keys."""
    item = gl.program_id(0) // row_tiles
    row0 = (gl.program_id(0) % row_tiles) * BM
    seq = gl.load(items_ptr + item * 4)
    kv_lo = gl.load(items_ptr + item * 4 + 1)
    kv_hi = gl.load(items_ptr + item * 4 + 2)
    slot = gl.load(items_ptr + item * 4 + 3)
    tok0 = gl.load(meta_ptr + seq)
    qlen = gl.load(meta_ptr + meta_stride + seq)
    slen = gl.load(meta_ptr + 2 * meta_stride + seq)
    last_j = gl.minimum((row0 + BM - 1) // H, qlen - 1)
    kv_end = gl.minimum(kv_hi, slen - qlen + last_j + 1)
    kv_end = gl.where((slot >= -1) & (row0 // H < qlen), kv_end, kv_lo)
    return row0, seq, kv_lo, kv_end, slot, tok0, qlen, slen


@gluon.jit
def _block_of(bt_row, start, kv_end, BS):
    """The cache block of the (block-aligned) key tile starting at `start`; 0 past kv_end (never read)."""
    return gl.load(bt_row + start // BS, mask=start < kv_end, other=0).to(gl.int64)


@gluon.jit
def _query_rows(ptr, stride_t, stride_h, row0, H, tok0, qlen, slot, col0, L: gl.constexpr, BM: gl.constexpr,
                W: gl.constexpr):
    """Pointers [BM, W] (layout L) to the tile's query rows (row = query x H + head), W columns from col0, of a
    [T, H, >= col0 + W] tensor, and the rows' mask [BM, 1]: false past the sequence's queries or in padding items."""
    r = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, L))
    tok = (tok0 + r // H).to(gl.int64)
    c = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, L))
    return ptr + (tok * stride_t + (r % H) * stride_h)[:, None] + c[None, :], ((r // H < qlen) & (slot >= -1))[:, None]


@gluon.jit
def _copy_query_rows(smem, ptr, stride_t, stride_h, row0, H, tok0, qlen, slot, col0, L: gl.constexpr,
                     BM: gl.constexpr, W: gl.constexpr):
    """cp.async _query_rows' rows into smem [BM, W]; masked rows are zero-filled."""
    ptrs, live = _query_rows(ptr, stride_t, stride_h, row0, H, tok0, qlen, slot, col0, L, BM, W)
    async_copy.async_copy_global_to_shared(smem, ptrs, mask=live)


@gluon.jit
def _copy_tile(k_buf, kpe_buf, lat_ptr, rope_ptr, blk, start, kv_end, BS, lat_sb, lat_st, rope_sb, rope_st, rope_off,
               LAT_L: gl.constexpr, PE_L: gl.constexpr, R: gl.constexpr, P: gl.constexpr, BN: gl.constexpr):
    """cp.async keys [start, start + BN) of block blk into k_buf [BN, R] (bf16, or E4M3 bytes) and kpe_buf
    [BN, P], one commit group; keys past kv_end are zero-filled (their scores are masked)."""
    n = gl.arange(0, BN, layout=gl.SliceLayout(1, LAT_L))
    off = (start % BS + n).to(gl.int64)
    c = gl.arange(0, R, layout=gl.SliceLayout(0, LAT_L))
    ptrs = lat_ptr + (blk * lat_sb + off * lat_st)[:, None] + c[None, :]
    async_copy.async_copy_global_to_shared(k_buf, ptrs, mask=(start + n < kv_end)[:, None])
    n2 = gl.arange(0, BN, layout=gl.SliceLayout(1, PE_L))
    off2 = (start % BS + n2).to(gl.int64)
    c2 = gl.arange(0, P, layout=gl.SliceLayout(0, PE_L))
    # Rows are 16-byte aligned (576 bf16 values, or 656 bytes with the rope at byte 528), which the FP8
    # strides (328 bf16 elements) do not show the compiler: say so, for 16-byte copies.
    rrow = gl.multiple_of(blk * rope_sb + off2 * rope_st + rope_off, 8)
    ptrs2 = rope_ptr + rrow[:, None] + c2[None, :]
    async_copy.async_copy_global_to_shared(kpe_buf, ptrs2, mask=(start + n2 < kv_end)[:, None])
    async_copy.commit_group()


@gluon.jit
def _load_scales(scl_ptr, blk, start, kv_end, BS, scl_sb, scl_st, scale_off, SC_L: gl.constexpr, G: gl.constexpr,
                 BN: gl.constexpr):
    """The per-token FP8 scales [BN, G] of the key tile at `start` (0 past kv_end), one 16-byte load a row."""
    n = gl.arange(0, BN, layout=gl.SliceLayout(1, SC_L))
    g = gl.arange(0, G, layout=gl.SliceLayout(0, SC_L))
    off = (start % BS + n).to(gl.int64)
    return gl.load(scl_ptr + (blk * scl_sb + off * scl_st + scale_off)[:, None] + g[None, :],
                   mask=(start + n < kv_end)[:, None], other=0.0)


@gluon.jit
def _lse(m, l):
    """Natural log-sum-exp of rows with running max m (exp2 domain) and sum l; -inf for rows with no key."""
    has = l > 0.0
    return gl.where(has, (m + gl.log2(gl.where(has, l, 1.0))) * _LN2, float("-inf"))


@gluon.jit
def _store_rows(o, co, out_args, row0, H, tok0, qlen, slot, O_L: gl.constexpr, R: gl.constexpr,
                T: gl.constexpr = False):
    """Store normalised output rows (tile rows row0 + i: query j = row // H, head h = row % H; columns co) to the
    direct output (bf16, token tok0 + j) when slot == -1, else to the float32 partial rows (slot + j) * H + h.
    Rows past qlen, and every row when slot < -1 (no output), are skipped. T: o is transposed ([columns, rows],
    as the keys-as-M kernel accumulates it)."""
    out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr = out_args
    if T:
        ro = row0 + gl.arange(0, o.shape[1], layout=gl.SliceLayout(0, O_L))
    else:
        ro = row0 + gl.arange(0, o.shape[0], layout=gl.SliceLayout(1, O_L))
    jo = ro // H
    ho = ro % H
    keep = (jo < qlen) & (slot >= -1)
    if slot == -1:
        tok = (tok0 + jo).to(gl.int64)
        gl.store(out_ptr + _outer(tok * o_st + ho * o_sh, co, T), o.to(gl.bfloat16), mask=_outer_mask(keep, T))
    else:
        prow = (slot + jo).to(gl.int64) * H + ho
        gl.store(po_ptr + _outer(prow * R, co, T), o, mask=_outer_mask(keep & (slot >= 0), T))


@gluon.jit
def _outer(row_off, co, T: gl.constexpr):
    """Element offsets of rows x columns: [rows, columns], or [columns, rows] when T."""
    if T:
        off = row_off[None, :] + co[:, None]
    else:
        off = row_off[:, None] + co[None, :]
    return off


@gluon.jit
def _outer_mask(keep, T: gl.constexpr):
    """The row mask keep laid out as _outer lays out its offsets (the store broadcasts it over the columns)."""
    if T:
        mask = keep[None, :]
    else:
        mask = keep[:, None]
    return mask


@gluon.jit
def _store_lse(lse, rs, out_args, H, tok0, qlen, slot):
    """Store the log-sum-exp of tile rows rs where _store_rows stores their outputs."""
    out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr = out_args
    jl = rs // H
    keep_l = (jl < qlen) & (slot >= -1)
    if slot == -1:
        gl.store(lse_ptr + (tok0 + jl).to(gl.int64) * H + rs % H, lse, mask=keep_l)
    else:
        gl.store(plse_ptr + (slot + jl).to(gl.int64) * H + rs % H, lse, mask=keep_l & (slot >= 0))


@gluon.jit
def _key_buffers(q_smem, FP8: gl.constexpr, SLOTS: gl.constexpr, BN: gl.constexpr, R: gl.constexpr,
                 P: gl.constexpr, LAT_S: gl.constexpr, PE_S: gl.constexpr):
    """The key-tile ring (SLOTS x [BN, R] bf16, or E4M3 bytes), its rope keys (SLOTS x [BN, P]) and, for FP8, the
    float16 tile each E4M3 tile is dequantised into (LAT_S: its layout; q_smem stands in for it with a bf16
    cache)."""
    kpe_bufs = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, BN, P], PE_S)
    if FP8:
        k_bufs = gl.allocate_shared_memory(gl.float8e4nv, [SLOTS, BN, R],
                                           gl.NVMMASharedLayout.get_default_for([BN, R], gl.float8e4nv))
        kb_smem = gl.allocate_shared_memory(gl.float16, [BN, R], LAT_S)
    else:
        k_bufs = gl.allocate_shared_memory(gl.bfloat16, [SLOTS, BN, R], LAT_S)
        kb_smem = q_smem  # unused
    return k_bufs, kpe_bufs, kb_smem


@gluon.jit
def _copy_queries(q_smem, qpe_smem, q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh, row0, H, tok0, qlen, slot,
                  Q_L: gl.constexpr, PE_L: gl.constexpr, BM: gl.constexpr, R: gl.constexpr, P: gl.constexpr):
    """cp.async the tile's latent and rope query rows into q_smem / qpe_smem as one commit group."""
    _copy_query_rows(q_smem, q_ptr, q_st, q_sh, row0, H, tok0, qlen, slot, 0, Q_L, BM, R)
    _copy_query_rows(qpe_smem, qpe_ptr, qpe_st, qpe_sh, row0, H, tok0, qlen, slot, 0, PE_L, BM, P)
    async_copy.commit_group()


@gluon.jit
def _stage_queries_f16(q_smem, qpe_smem, q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh, row0, H, tok0, qlen, slot,
                       PE_L: gl.constexpr, F_L: gl.constexpr, BM: gl.constexpr, R: gl.constexpr, P: gl.constexpr,
                       WARPS: gl.constexpr):
    """The tile's queries for an E4M3 cache's float16 MMAs, through registers: each row scaled by the power of two
    that puts its largest latent value in [2^14, 2^15) (exact; inside float16's range and above its subnormals,
    whatever the row's magnitude), the latent part stored as float16 into q_smem, the rope part (bf16, the same
    factor) into qpe_smem. Rows past the sequence's queries are zeros. Returns the factors that undo the scaling,
    one a row, in layout F_L. Reads the latent rows twice (the maximum, then the values: the second read hits L2)
    rather than holding them in registers."""
    L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [WARPS, 1], [1, 0])  # 128 columns, 16 bytes a thread
    rows, live = _query_rows(q_ptr, q_st, q_sh, row0, H, tok0, qlen, slot, 0, L, BM, 128)
    amax = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, L))
    for g in gl.static_range(R // 128):
        q = gl.load(rows + g * 128, mask=live, other=0.0).to(gl.float32)
        amax = gl.maximum(amax, gl.max(gl.abs(q), axis=1))
    # floor(log2(amax)) - 14 from the exponent bits; rows of zeros (padding) stop at 2^-100
    e = gl.minimum(gl.maximum(((amax.to(gl.int32, bitcast=True) >> 23) & 255) - 141, -100), 100).to(gl.float32)
    down = gl.exp2(-e)
    for g in gl.static_range(R // 128):
        q = gl.load(rows + g * 128, mask=live, other=0.0).to(gl.float32)
        q_smem.slice(g * 128, 128, dim=1).store((q * down[:, None]).to(gl.float16))
    pe_rows, pe_live = _query_rows(qpe_ptr, qpe_st, qpe_sh, row0, H, tok0, qlen, slot, 0, PE_L, BM, P)
    qp = gl.load(pe_rows, mask=pe_live, other=0.0).to(gl.float32)
    qpe_smem.store((qp * gl.convert_layout(down, gl.SliceLayout(1, PE_L))[:, None]).to(gl.bfloat16))
    return gl.convert_layout(gl.exp2(e), F_L)


# Four E4M3 values a call: two exact cvts to float16 pairs, each times its scale pair in one packed multiply.
# `x8.to(gl.float16) * s` compiles to the same cvts, but Triton unpacks each pair into halves, multiplies them one by
# one, and ptxas re-pairs the multiplies only to split and repack every result for the store: two PRMT a pair
# (sm_90 SASS of the seesaw kernel, thirty-fifth session). The _KEPT form first ands the bytes with a byte mask.
_E4M3_SCALED = ("cvt.rn.f16x2.e4m3x2 $0, lo; cvt.rn.f16x2.e4m3x2 $1, hi; "
                "mul.rn.f16x2 $0, $0, $3; mul.rn.f16x2 $1, $1, $4; }")
_E4M3_SCALED_ASM = gl.constexpr("{ .reg .b16 lo, hi; mov.b32 {lo, hi}, $2; " + _E4M3_SCALED)
_E4M3_SCALED_KEPT_ASM = gl.constexpr(
    "{ .reg .b32 x; .reg .b16 lo, hi; and.b32 x, $2, $5; mov.b32 {lo, hi}, x; " + _E4M3_SCALED)


@gluon.jit
def e4m3_scaled(x8, sc):
    """E4M3 tile x8 times float16 factors sc (broadcast to x8's shape), as float16: the widening is exact, so the one
    rounding is the product's, as in x8.to(float16) * sc."""
    return gl.inline_asm_elementwise(_E4M3_SCALED_ASM, "=r,=r,r,r,r", [x8, sc], dtype=gl.float16, is_pure=True,
                                     pack=4)


@gluon.jit
def e4m3_scaled_kept(x8, sc, keep):
    """e4m3_scaled with the values where int8 `keep` (broadcast) is 0 taken as zeros (it is -1 where they count):
    whatever their bytes hold, NaN included."""
    return gl.inline_asm_elementwise(_E4M3_SCALED_KEPT_ASM, "=r,=r,r,r,r,r", [x8, sc, keep], dtype=gl.float16,
                                     is_pure=True, pack=4)


@gluon.jit
def _dequantize_tile(k8, scales, kb, DQ_L: gl.constexpr, SC_L: gl.constexpr, R: gl.constexpr):
    """E4M3 tile k8 [BN, R] times its per-token scales [BN, R / 128] -> float16 tile kb, 128 columns at a time:
    the exact widening (one cvt per two values) times the scale rounded to float16 (one multiply per two), where
    a bf16 tile took six instructions per two values. Rounding: float16's 11 bits where bf16 had 8, down to
    2^-14 (below, float16's subnormals keep a value within 2^-25); the scale is rounded to 2^-12 for a group
    whose largest value is 0.027 or more (the scale is then a normal float16). A dequantised value past 65504
    (a latent value that large) would overflow."""
    g_idx = gl.arange(0, R // 128, layout=gl.SliceLayout(0, SC_L))
    for g in gl.static_range(R // 128):
        sc = gl.sum(gl.where(g_idx[None, :] == g, scales, 0.0), axis=1)  # each thread holds its rows' scales
        sc16 = gl.convert_layout(sc, gl.SliceLayout(1, DQ_L)).to(gl.float16)
        kb.slice(g * 128, 128, dim=1).store(e4m3_scaled(k8.slice(g * 128, 128, dim=1).load(DQ_L), sc16[:, None]))


@gluon.jit
def _ready_tile(k_bufs, kb_smem, buf, scales, PENDING: gl.constexpr, FP8: gl.constexpr, DQ_L: gl.constexpr,
                SC_L: gl.constexpr, R: gl.constexpr):
    """Wait for ring slot buf's copies (PENDING later commit groups may stay in flight) and order them before the
    wgmma's reads in every thread; an E4M3 tile is dequantised into kb_smem first. Returns the 16-bit key tile."""
    async_copy.wait_group(PENDING)
    fence_async_shared()  # copies are generic-proxy writes: order them before the wgmma's async-proxy reads
    gl.thread_barrier()  # ... in every thread
    if FP8:
        _dequantize_tile(k_bufs.index(buf), scales, kb_smem, DQ_L, SC_L, R)
        fence_async_shared()
        gl.thread_barrier()
        k = kb_smem
    else:
        k = k_bufs.index(buf)
    return k


@gluon.jit
def mla_attn_gluon_kernel(
    q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh,
    lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off, BS,
    bt_ptr, bt_stride, meta_ptr, meta_stride, items_ptr,
    out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr,
    H, qk_scale, row_tiles,
    R: gl.constexpr, P: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, FP8: gl.constexpr,
    PDL: gl.constexpr = False,
):
    """One program = one work item x one tile of BM query rows, as mla_attn_kernel (see its docstring; the
    cache views and strides are the same). FP8: the E4M3 tile is copied as bytes and dequantised into one float16
    tile in shared memory, which both MMAs read, with the queries and P in float16 too (_stage_queries_f16,
    _dequantize_tile)."""
    # Distributed layouts: copies and dequantisation (copy_layout), scores (warpgroups split the keys),
    # output (warpgroups split the 512 columns).
    Q_L: gl.constexpr = copy_layout("q", 8)
    LAT_L: gl.constexpr = copy_layout("lat", 8, FP8)
    PE_L: gl.constexpr = copy_layout("pe", 8)
    DQ_L: gl.constexpr = copy_layout("dq", 8)
    SC_L: gl.constexpr = copy_layout("sc", 8)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 32, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 2], instr_shape=[16, 256, 16])
    T: gl.constexpr = gl.float16 if FP8 else gl.bfloat16  # the latent MMAs' operands
    LAT_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, R], T)
    PE_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, P], gl.bfloat16)
    P_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, BN], T)

    _gdc_enter(PDL)
    row0, seq, kv_lo, kv_end, slot, tok0, qlen, slen = _work_item(items_ptr, meta_ptr, meta_stride, H, row_tiles, BM)
    n_tiles = gl.cdiv(gl.maximum(kv_end - kv_lo, 0), BN)
    bt_row = bt_ptr + seq.to(gl.int64) * bt_stride

    q_smem = gl.allocate_shared_memory(T, [BM, R], LAT_S)
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, P], PE_S)
    k_bufs, kpe_bufs, kb_smem = _key_buffers(q_smem, FP8, 2, BN, R, P, LAT_S, PE_S)
    p_smem = gl.allocate_shared_memory(T, [BM, BN], P_S)

    # Queries (bf16: one commit group), then key tiles 0 and 1.
    if not FP8:
        _copy_queries(q_smem, qpe_smem, q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh, row0, H, tok0, qlen, slot, Q_L,
                      PE_L, BM, R, P)
    tile_args = (lat_ptr, rope_ptr)
    addr_args = (kv_end, BS, lat_sb, lat_st, rope_sb, rope_st, rope_off)
    scale_args = (kv_end, BS, scl_sb, scl_st, scale_off)
    # FP8 scales ride in registers, loaded with their tile's copies: sc_a for the tile in use, sc_b the next.
    sc_a = gl.zeros([BN, R // 128], gl.float32, layout=SC_L)
    sc_b = sc_a
    blk = _block_of(bt_row, kv_lo, kv_end, BS)
    _copy_tile(k_bufs.index(0), kpe_bufs.index(0), *tile_args, blk, kv_lo, *addr_args, LAT_L, PE_L, R, P, BN)
    if FP8:
        sc_a = _load_scales(scl_ptr, blk, kv_lo, *scale_args, SC_L, R // 128, BN)
    blk = _block_of(bt_row, kv_lo + BN, kv_end, BS)
    _copy_tile(k_bufs.index(1), kpe_bufs.index(1), *tile_args, blk, kv_lo + BN, *addr_args, LAT_L, PE_L, R, P, BN)
    if FP8:
        sc_b = _load_scales(scl_ptr, blk, kv_lo + BN, *scale_args, SC_L, R // 128, BN)
    blk_next = _block_of(bt_row, kv_lo + 2 * BN, kv_end, BS)
    if FP8:  # the queries go through registers while the tiles fly
        q_fac = _stage_queries_f16(q_smem, qpe_smem, q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh, row0, H, tok0, qlen,
                                   slot, PE_L, gl.SliceLayout(1, S_L), BM, R, P, 8)

    # Score-side row data (query position of each row) and running softmax state.
    rs = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, S_L))
    pos = gl.where((rs // H < qlen) & (slot >= -1), slen - qlen + rs // H, -1)
    m_i = gl.full([BM], -1.0e30, gl.float32, layout=gl.SliceLayout(1, S_L))
    # Row sums stay per column until the end: summing the 64 keys every tile would take a cross-warpgroup
    # reduction (shared memory and barriers) that the running max already pays for.
    l_cols = gl.zeros([BM, BN], gl.float32, layout=S_L)
    acc = gl.zeros([BM, R], gl.float32, layout=O_L)
    s_zero = gl.zeros([BM, BN], gl.float32, layout=S_L)
    kn = gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))

    for t in range(0, n_tiles):
        buf = t % 2
        start = kv_lo + t * BN
        # this tile's group (and the queries') have landed; the next may be in flight
        k = _ready_tile(k_bufs, kb_smem, buf, sc_a, 1, FP8, DQ_L, SC_L, R)
        s = warpgroup_mma(q_smem, k.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(qpe_smem, kpe_bufs.index(buf).permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        if FP8:
            s = s * q_fac[:, None]
        offs = start + kn
        s = gl.where((offs[None, :] <= pos[:, None]) & (offs[None, :] < kv_end), s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=1))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[:, None])
        l_cols = l_cols * alpha[:, None] + p
        m_i = m_new
        p_smem.store(p.to(T))
        fence_async_shared()
        gl.thread_barrier()  # both warpgroups read all of P
        acc = acc * gl.convert_layout(alpha, gl.SliceLayout(1, O_L))[:, None]
        acc = warpgroup_mma(p_smem, k, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # every warpgroup is done with this buffer (and with P) before it is refilled
        _copy_tile(k_bufs.index(buf), kpe_bufs.index(buf), *tile_args, blk_next, start + 2 * BN, *addr_args, LAT_L,
                   PE_L, R, P, BN)
        if FP8:
            sc_a, sc_b = sc_b, _load_scales(scl_ptr, blk_next, start + 2 * BN, *scale_args, SC_L, R // 128, BN)
        blk_next = _block_of(bt_row, start + 3 * BN, kv_end, BS)
    async_copy.wait_group(0)

    l_i = gl.sum(l_cols, axis=1)
    has = l_i > 0.0
    inv_l = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    o = acc * gl.convert_layout(inv_l, gl.SliceLayout(1, O_L))[:, None]
    out_args = (out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr)
    _store_rows(o, gl.arange(0, R, layout=gl.SliceLayout(0, O_L)), out_args, row0, H, tok0, qlen, slot, O_L, R)
    _store_lse(_lse(m_i, l_i), rs, out_args, H, tok0, qlen, slot)
