"""The seesaw MLA decode kernel's key blocks (mla_seesaw_kernels): copying each part of a block (latent halves,
rope keys) from the paged latent cache into shared memory by cp.async or TMA, the bulk L2 prefetch a pair ahead,
an FP8 cache's E4M3 halves widened in place to float16 times their tokens' scales, and a TMA-copied block's tail
zeroed. The schedule that consumes them (scores, softmax, products, the exchanges between the warpgroups) is in
mla_seesaw_kernels; see its docstring for why each part is copied when it is.

GPU only (Gluon, Hopper); test_gluon_compile.py compiles the kernel that uses these for sm_90 on the CPU.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, mbarrier, tma

from deepinfer.backends.cuda_sm100.mla_gluon_kernels import _block_of, e4m3_scaled, e4m3_scaled_kept

R = gl.constexpr(512)  # latent width (DeepSeek's kv_lora_rank); each warpgroup owns half of it
P = gl.constexpr(64)  # rope width
BN = gl.constexpr(64)  # keys a block (the cache's block size)
_HALF = gl.constexpr(256)
BOX = gl.constexpr(64)  # channels a TMA box: one 128-byte swizzle row of bf16
# The layout of the key buffers' 64-channel columns, which the host's TMA descriptor carries too.
KV_SMEM = gl.constexpr(gl.NVMMASharedLayout.get_default_for([64, 64], gl.bfloat16))
# FP8 cache: a latent half's E4M3 bytes land as two [64, 128] boxes (one scale group each) in the upper half of
# its float16 buffer, and are widened in place (_widen); the host's descriptor carries this layout too.
E4M3_BOX = gl.constexpr(128)
E4M3_SMEM = gl.constexpr(gl.NVMMASharedLayout.get_default_for([64, 128], gl.float8e4nv))
# Copy layouts (one warpgroup, 16-byte vectors along a row): latent halves, and rope rows.
CP_L = gl.constexpr(gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0]))
PE_L = gl.constexpr(gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0]))


def _prefetch_asm(nbytes: int) -> gl.constexpr:
    """One thread asks L2 for a whole key block: `nbytes` contiguous bytes of the cache's rows."""
    return gl.constexpr("{ .reg .pred p; setp.eq.s32 p, $2, 0; "
                        f"@p cp.async.bulk.prefetch.L2.global [$1], {nbytes}; mov.b32 $0, 0; }}")


_PREFETCH_ASM = _prefetch_asm(64 * 576 * 2)  # 64 rows of 576 bf16 values
_PREFETCH_E4M3_ASM = _prefetch_asm(64 * 656)  # 64 rows of 656 bytes (FP8)


@gluon.jit
def _copy_rows(dst, ptr, row_off, col0, rmask, W: gl.constexpr, L: gl.constexpr):
    """cp.async rows (element offsets row_off [64], masked rows zero-filled) x W columns from col0 into dst."""
    c = col0 + gl.arange(0, W, layout=gl.SliceLayout(0, L))
    async_copy.async_copy_global_to_shared(dst, ptr + row_off[:, None] + c[None, :], mask=rmask[:, None])


@gluon.jit
def _key_rows(blk, start, kv_end, BS, sb, st, L: gl.constexpr):
    """Element offsets of keys [start, start + 64) in cache block blk (one cache block) and which are real."""
    n = gl.arange(0, BN, layout=gl.SliceLayout(1, L))
    return blk * sb + (start % BS + n).to(gl.int64) * st, start + n < kv_end


@gluon.jit
def _staging(dst, c: gl.constexpr):
    """E4M3 box c (0, 1) of the two [64, 128] in the upper half of a float16 latent-half buffer [64, 256]: bytes
    that _widen turns into the whole buffer (the buffer seen as [256, 128] bytes, rows 128 + 64 c on)."""
    return dst._reinterpret(gl.float8e4nv, [4 * BN, E4M3_BOX], E4M3_SMEM).slice((2 + c) * BN, BN)


@gluon.jit
def _cache_block(bt_row, start, kv_end, BS):
    """_block_of as int32: TMA's coordinates, and what the pair loop carries (in half the registers)."""
    return _block_of(bt_row, start, kv_end, BS).to(gl.int32)


@gluon.jit
def _load_part(dst_a, dst_b, bar, cache, bt_row, start, kv_end, HALF: gl.constexpr, ROPE: gl.constexpr,
               L: gl.constexpr, PL: gl.constexpr, TMA: gl.constexpr, FP8: gl.constexpr):
    """Copy one part of the key block at `start` and signal `bar` when it lands: latent half HALF (0 left, 1
    right, -1 none) into dst_a, and with ROPE the rope keys into dst_b. cp.async zero-fills keys past kv_end;
    TMA copies the whole cache block (its tail is zeroed before a product, _zero_tail). FP8 (TMA only): the
    half's E4M3 bytes into dst_a's upper half (_staging), for _widen. Returns the cache block, which _widen takes
    from the warpgroup's last copy of that key block rather than loading it again on its way to the scales."""
    lat_ptr, rope_ptr, BS, lat_sb, lat_st, rope_sb, rope_st, rope_off, kv_desc, pe_desc = cache[:10]
    blk = _cache_block(bt_row, start, kv_end, BS)
    row = blk * BS + start % BS  # TMA's cache row
    if FP8:
        mbarrier.expect(bar, BN * (_HALF * (HALF >= 0) + 2 * P * ROPE))
        if HALF >= 0:
            for c in gl.static_range(_HALF // E4M3_BOX):
                tma.async_copy_global_to_shared(kv_desc, [row, HALF * _HALF + c * E4M3_BOX], bar,
                                                _staging(dst_a, c))
        if ROPE:
            tma.async_copy_global_to_shared(pe_desc, [row, 0], bar, dst_b)
    elif TMA:
        mbarrier.expect(bar, BN * (_HALF * (HALF >= 0) + P * ROPE) * 2)
        if HALF >= 0:
            for c in gl.static_range(_HALF // BOX):
                tma.async_copy_global_to_shared(kv_desc, [row, HALF * _HALF + c * BOX], bar,
                                                dst_a.slice(c * BOX, BOX, dim=1))
        if ROPE:
            tma.async_copy_global_to_shared(kv_desc, [row, R], bar, dst_b)
    else:
        blk64 = blk.to(gl.int64)
        if HALF >= 0:
            rows, ok = _key_rows(blk64, start, kv_end, BS, lat_sb, lat_st, L)
            _copy_rows(dst_a, lat_ptr, rows, HALF * _HALF, ok, _HALF, L)
        if ROPE:
            prow, pok = _key_rows(blk64, start, kv_end, BS, rope_sb, rope_st, PL)
            _copy_rows(dst_b, rope_ptr, prow + rope_off, 0, pok, P, PL)
        async_copy.mbarrier_arrive(bar, increment_count=False)
    return blk


@gluon.jit
def _prefetch_block(cache, bt_row, start, kv_end, FP8: gl.constexpr):
    """Ask L2 for the 64 keys at `start` (one contiguous run of the cache's rows: a single bulk prefetch from one
    thread), a pair ahead of their reload, so that reload waits on L2 instead of HBM."""
    lat_ptr, rope_ptr, BS, lat_sb, lat_st = cache[:5]
    if start < kv_end:
        blk = _block_of(bt_row, start, kv_end, BS)
        ONE: gl.constexpr = gl.BlockedLayout([1], [32], [4], [0])  # one element a thread of the warpgroup
        lane = gl.arange(0, 128, layout=ONE)
        ptr = lat_ptr + blk * lat_sb + (start % BS) * lat_st + lane * 0
        ASM: gl.constexpr = _PREFETCH_E4M3_ASM if FP8 else _PREFETCH_ASM
        gl.inline_asm_elementwise(ASM, "=r,l,r", [ptr, lane], dtype=gl.int32, is_pure=False, pack=1)


@gluon.jit
def _widened(x8, sc, live, TAIL: gl.constexpr):
    """E4M3 values [64, 64] of one scale group times their tokens' scales (float16), as float16; TAIL: zeros past
    the sequence (the cache's bytes there may be NaN)."""
    if TAIL:  # the mask on the bytes (a select on the float16 pairs splits and repacks each)
        return e4m3_scaled_kept(x8, sc[:, None], gl.where(live, -1, 0).to(gl.int8)[:, None])
    return e4m3_scaled(x8, sc[:, None])


@gluon.jit
def _widen_boxes(dst, sc0, sc1, live, TAIL: gl.constexpr):
    """_widen's conversion of both landed E4M3 boxes into dst. The first box's float16 fills the lower half, which
    holds no staged bytes; the second's overwrites both boxes, so every thread reads it first."""
    a = _staging(dst, 0)
    for c in gl.static_range(2):
        dst.slice(c * BOX, BOX, dim=1).store(_widened(a.slice(c * BOX, BOX, dim=1).load(PE_L), sc0, live, TAIL))
    b = _staging(dst, 1)
    b0 = b.slice(0, BOX, dim=1).load(PE_L)
    b1 = b.slice(BOX, BOX, dim=1).load(PE_L)
    gl.thread_barrier()  # every thread has read the second box
    dst.slice(2 * BOX, BOX, dim=1).store(_widened(b0, sc1, live, TAIL))
    dst.slice(3 * BOX, BOX, dim=1).store(_widened(b1, sc1, live, TAIL))


@gluon.jit
def _widen(dst, bars, bar, ph, cache, blk, start, kv_end, HALF: gl.constexpr):
    """Once latent half HALF of the key block at `start` has landed in dst's upper half (_load_part, FP8), widen
    it in place: E4M3 times the per-token scales of its two groups, rounded to float16 (as
    mla_gluon_kernels._dequantize_tile), over the whole buffer, 64 columns at a time (PE_L: 8 bytes a thread, a
    swizzled 128-byte row of float16 a quarter warp; _widen_boxes). The scales are asked for before the wait, so
    their latency hides behind it. blk: the cache block (_load_part's)."""
    BS = cache[2]
    scl_ptr, scl_sb, scl_st, scale_off = cache[10:]
    n = gl.arange(0, BN, layout=gl.SliceLayout(1, PE_L))
    live = start + n < kv_end
    sp = scl_ptr + blk.to(gl.int64) * scl_sb + (start % BS + n).to(gl.int64) * scl_st + scale_off + 2 * HALF
    sc = gl.load(sp.to(gl.pointer_type(gl.int64)), mask=live, other=0)
    sc0 = sc.to(gl.int32).to(gl.float32, bitcast=True).to(gl.float16)
    sc1 = (sc >> 32).to(gl.int32).to(gl.float32, bitcast=True).to(gl.float16)
    mbarrier.wait(bars.index(bar), ph)
    # The mask in a branch of its own, stores included: as a select on every block, ptxas split, selected and
    # repacked each float16 pair, three times the widening's instructions (sm_90 SASS: 1691 PRMT in the kernel).
    if start + BN <= kv_end:
        _widen_boxes(dst, sc0, sc1, live, False)
    else:
        _widen_boxes(dst, sc0, sc1, live, True)
    fence_async_shared()  # generic-proxy stores, read by wgmma (async proxy) ...
    gl.thread_barrier()  # ... of every thread of this warpgroup (the other reads these halves only after the
    # probabilities this one publishes later)


@gluon.jit
def _zero_tail(v, start, kv_end, TMA: gl.constexpr, L: gl.constexpr):
    """Zero a TMA-copied value half's keys past kv_end (what the cache holds there may be NaN, and 0 * NaN is NaN
    in a product whose probabilities are 0). Only a sequence's last block has such keys; cp.async zero-fills."""
    if TMA:
        if start + BN > kv_end:
            live = (start + gl.arange(0, BN, layout=gl.SliceLayout(1, L)) < kv_end)[:, None]
            for c in gl.static_range(_HALF // BOX):  # a box at a time: the output holds 128 registers a thread
                box = v.slice(c * BOX, BOX, dim=1)
                box.store(gl.where(live, box.load(L), 0.0).to(gl.bfloat16))
            fence_async_shared()
            gl.thread_barrier()  # the wgmma reads every warp's rows
