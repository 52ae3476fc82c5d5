"""MLA decode over the paged latent cache (bf16 or FP8), 64 query rows a program, on FlashMLA's "seesaw"
schedule (Gluon, Hopper).

Why: mla_gluon_kernels runs its two warpgroups in lockstep (scores, softmax, P.V, in turn), so the tensor cores
idle through every softmax and every hand-over of P; at 128 heads it reached 0.48-0.51 of the bf16 matmul rate
(benchmarks/RESULTS.md, issue 8). The output [64, 512] fills one warpgroup's registers per 256 columns, so two
output tiles (FlashAttention-3's ping-pong) do not fit. FlashMLA's answer, written here in Gluon: take key
blocks two at a time, K0 and K1 (64 keys each; in MLA the values are the keys' first 512 channels), and let

- warpgroup 0 own the left 256 output columns and compute block 0's scores,
- warpgroup 1 own the right 256 columns and compute block 1's scores,

with one running max m shared between them (a pair: m -> m0 -> m1):

    [0] s0 = q K0^T; m0 = max(m, rowmax s0); p0 = exp(s0 - m0) -> shared memory
        o_L = o_L * exp(m - m0) + p0 V0_L                                        (p0 from registers)
    [1] s1 = q K1^T; m1 = max(m0, rowmax s1); p1 = exp(s1 - m1) -> shared memory
        o_R = (o_R * exp(m - m0) + p0 V0_R) * exp(m0 - m1) + p1 V1_R             (p0 from [0])
    [0] o_L = o_L * exp(m0 - m1) + p1 V1_L                                       (p1 from [1])

so one warpgroup's softmax runs while the other's MMAs keep the tensor cores busy. It is FlashAttention's online
softmax, reordered: the same sums in a different association. Each warpgroup computes its next pair's scores at
the end of a pair, their first part queued behind its last product (warpgroup 1 reads p1 from its buffer there, so
no registers are held across the queue).

Memory: queries [64, 576] and two key blocks fill 216 KiB; the 8 KiB left hold p1, and p0 goes into block 0's
rope buffer (its last 64 channels), dead once block 0's scores are done. Each part of a block (left half, right
half, rope keys) is reloaded (cp.async, completion signalled on an mbarrier) by the warpgroup that uses it last,
right after that use, and the scores take the parts in the order they are freed. With only two blocks' room, a
pair's reloads are waited on by the next pair's scores, so each warpgroup first asks L2 for its next block (one
bulk prefetch a pair ahead): the reload then waits on L2, not HBM (8-9% faster at 128 heads on the H200,
benchmarks/RESULTS.md). The prefetch is a hint: it assumes the bf16 cache's contiguous 576-value rows.

Under a CUDA graph (mla_launch.seesaw_tma_usable) the parts come by TMA instead: one thread's bulk copies of
64 x 64 boxes from the cache's [blocks x 64, 576] rows, no cp.async issue by 128 threads and no proxy fence before
the wgmma that reads them (H200, 128 heads: 7-8% faster, benchmarks/RESULTS.md). TMA copies whole cache blocks, so
a sequence's last block is zeroed past its end before a product reads it as values (_zero_tail).

FP8 cache (DeepSeek's 656-byte rows; TMA only): the schedule is the same, with float16 in the latent MMAs, as in
mla_gluon_kernels' FP8 tile: the queries staged through registers, each row scaled by a power of two that the
scores undo, and P as float16. A latent half's E4M3 bytes land (two 64 x 128 boxes) in the upper half of its
float16 buffer, and the warpgroup whose scores read the block first widens them in place, times the tokens'
scales (_widen); the other warpgroup reads that block only after the probabilities published after those
scores. Rope keys come as bf16 boxes. Shared memory: the bf16 kernel's and the rows' factors.

Same contract as mla_attn_kernel / mla_attn_gluon_kernel (work items, rows = query x head, causal positions,
direct or partial outputs with log-sum-exp), for what mla_launch.seesaw_usable checks: bf16 queries, a bf16 or
FP8 cache, rank 512, rope 64, tiles aligned to blocks of 64. GPU only (Gluon has no interpreter): the
conformance tests run it on the H200 against the reference, and test_gluon_compile.py compiles it for sm_90 on
the CPU. The key blocks' copies, L2 prefetch and FP8 widening are in mla_seesaw_keys.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma, warpgroup_mma_wait,
)

from deepinfer.backends.cuda_sm100.mla_gluon_kernels import (
    _copy_query_rows, _gdc_enter, _lse, _stage_queries_f16, _store_lse, _store_rows, _work_item,
)
from deepinfer.backends.cuda_sm100.mla_seesaw_keys import (
    _HALF, BN, CP_L, PE_L, P, R, _cache_block, _load_part, _prefetch_block, _widen, _zero_tail,
)

BM = gl.constexpr(64)  # query rows a program (one wgmma M)
NUM_WARPS = 4  # warpgroup 0 (the default partition); warpgroup 1 is the worker
WORKER_REGS = gl.constexpr(240)  # each warpgroup's registers: the worker's setmaxnreg and the launch's maxnreg
MAXNREG = 240
# sm_90 compile, the largest variant (FP8): queries, two key blocks, p1, the exchange rows, the barriers, scratch
SMEM_BYTES = 231044

# mbarriers (one array). Loads: 128 cp.async arrivals (one a thread of the loading warpgroup), or under TMA one
# expect and the bytes. Exchanges: one arrival.
_Q, _K0L, _K0RE, _K1R, _K1L, _K1E, _X0, _X1, _L0, _L1 = (gl.constexpr(b) for b in range(10))
_NBARS = gl.constexpr(10)


@gluon.jit
def _landed(bars, bar, ph, TMA: gl.constexpr):
    """Wait for a part's copies; cp.async writes are generic-proxy, so order them before the wgmma's reads (TMA
    writes through the async proxy, as the wgmma reads)."""
    mbarrier.wait(bars.index(bar), ph)
    if not TMA:
        fence_async_shared()


@gluon.jit
def _scores_begin(a0, b0, bar0, bars, ph, zero, TMA: gl.constexpr):
    """Issue q K^T's first part for one key block once it has landed (the product stays in flight)."""
    _landed(bars, bar0, ph, TMA)
    return warpgroup_mma(a0, b0.permute((1, 0)), zero, use_acc=False, is_async=True)


@gluon.jit
def _scores_end(s, a1, b1, bar1, a2, b2, bar2, bars, ph, TMA: gl.constexpr):
    """Add q K^T's other two parts, each once it has landed, and wait for the scores."""
    _landed(bars, bar1, ph, TMA)
    s = warpgroup_mma(a1, b1.permute((1, 0)), s, is_async=True)
    _landed(bars, bar2, ph, TMA)
    s = warpgroup_mma(a2, b2.permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(s,))


@gluon.jit
def _scores(a0, b0, bar0, a1, b1, bar1, a2, b2, bar2, bars, ph, zero, TMA: gl.constexpr):
    """q K^T for one key block, part by part in the order their copies land (each part waits on its barrier)."""
    s = _scores_begin(a0, b0, bar0, bars, ph, zero, TMA)
    return _scores_end(s, a1, b1, bar1, a2, b2, bar2, bars, ph, TMA)


@gluon.jit
def _widen_and_score(s, a, b, bars, bar, ph, cache, blk, start, kv_end, HALF: gl.constexpr):
    """FP8: widen latent half HALF of the key block at `start` (_widen), then add its part of q K^T to s (in
    flight), so that the next part's widening runs under this product."""
    _widen(b, bars, bar, ph, cache, blk, start, kv_end, HALF)
    return warpgroup_mma(a, b.permute((1, 0)), s, is_async=True)


@gluon.jit
def _rope_scores(s, a, b):
    """Add q K^T's rope part (landed already) to s and wait for the scores."""
    s = warpgroup_mma(a, b.permute((1, 0)), s, is_async=True)
    return warpgroup_mma_wait(num_outstanding=0, deps=(s,))


@gluon.jit
def _p0(rope_buf, p1_buf):
    """Block 0's rope-key buffer as p0's (p1's type: float16 for FP8, else bf16); dead once its scores are done."""
    return rope_buf._reinterpret(p1_buf.dtype, [BM, BN], p1_buf.type.layout)


@gluon.jit
def _masked(s, start, pos, kv_end, qk_scale, S_L: gl.constexpr):
    """Scores in the exp2 domain (qk_scale: a scalar, or [64, 1] where each row's queries were scaled), -inf where
    a key is past the row's query position or the item's end."""
    offs = start + gl.arange(0, BN, layout=gl.SliceLayout(0, S_L))
    return gl.where((offs[None, :] <= pos[:, None]) & (offs[None, :] < kv_end), s * qk_scale, float("-inf"))


@gluon.jit
def _publish(rows_buf, x, p_buf, p, bars, bar, P_TOO: gl.constexpr):
    """Hand the other warpgroup a row vector (and probabilities [64, 64] for its wgmma, which reads through the
    async proxy) in shared memory, with one arrival once every thread stored."""
    rows_buf.store(x)
    if P_TOO:
        p_buf.store(p.to(p_buf.dtype))
        fence_async_shared()
    gl.thread_barrier()
    mbarrier.arrive(bars.index(bar))


@gluon.jit
def _rows(x, L: gl.constexpr):
    """A row vector as a column broadcastable over layout L's tiles."""
    return gl.convert_layout(x, gl.SliceLayout(1, L))[:, None]


@gluon.jit
def _store_direct(o, stage, col0, dst, row0, H, tok0, qlen):
    """_store_rows' direct bf16 output (slot -1) of normalised rows, columns [col0, col0 + 256), through `stage` (a
    dead [64, 256] bf16 key buffer), so that each warp stores whole rows of 512 bytes rather than the wgmma
    layout's 4 bytes a thread (H100, bf16 cache, 64 x 4096 x 128: 1.5-2.3% faster, benchmarks/RESULTS.md issue 8,
    thirty-ninth session)."""
    stage.store(o.to(gl.bfloat16))
    gl.thread_barrier()
    L: gl.constexpr = gl.BlockedLayout([1, 8], [1, 32], [4, 1], [1, 0])
    co = col0 + gl.arange(0, _HALF, layout=gl.SliceLayout(0, L))
    _store_rows(stage.load(L), co, dst, row0, H, tok0, qlen, -1, L, R)


@gluon.jit
def _finish(o, m, l, smem, bars, W: gl.constexpr, out_args, O_L: gl.constexpr, S_L: gl.constexpr,
            FP8: gl.constexpr):
    """Add the other warpgroup's row sums, normalise this warpgroup's 256 columns and store them (the direct output
    or a float32 partial); warpgroup 0 stores the log-sum-exp. Once the other warpgroup's sums have arrived its
    loop is over, so no key buffer is read any more: a bf16 cache's direct output goes through this warpgroup's
    (_store_direct; with an FP8 cache it measured ~1% slower, so its rows are stored from registers)."""
    q_l, q_r, q_e, k_l, k_r, k_e, p1_buf, xch, q_fac = smem
    out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr, row0, H, tok0, qlen, slot = out_args
    _publish(xch.slice((2 + W) * BM, BM), l, xch, l, bars, _L0 + W, False)
    mbarrier.wait(bars.index(_L1 - W), 0)
    l = l + xch.slice((3 - W) * BM, BM).load(gl.SliceLayout(1, S_L))
    has = l > 0.0
    inv_l = gl.where(has, 1.0 / gl.where(has, l, 1.0), 0.0)
    dst = (out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr)
    o = o * _rows(inv_l, O_L)
    if not FP8 and slot == -1:
        stage = k_l.index(0) if W == 0 else k_r.index(0)
        _store_direct(o, stage, W * _HALF, dst, row0, H, tok0, qlen)
    else:
        co = W * _HALF + gl.arange(0, _HALF, layout=gl.SliceLayout(0, O_L))
        _store_rows(o, co, dst, row0, H, tok0, qlen, slot, O_L, R)
    if W == 0:
        _store_lse(_lse(m, l), row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, S_L)), dst, H, tok0, qlen, slot)


@gluon.jit
def _warpgroup(smem, bars, cache, bt_row, kv_lo, kv_end, n_pairs, pos_args, qk_scale, out_args, W: gl.constexpr,
               TMA: gl.constexpr, FP8: gl.constexpr):
    """Warpgroup W's side of the seesaw (W 0: left columns, even blocks; W 1: right columns, odd blocks). FP8:
    each warpgroup widens the latent halves of the blocks whose scores it computes, before those scores; the
    other warpgroup's products over them follow the probabilities it publishes after."""
    q_l, q_r, q_e, k_l, k_r, k_e, p1_buf, xch, q_fac = smem
    ZERO_TAIL: gl.constexpr = TMA and not FP8  # _widen zeroes an FP8 block's tail
    row0, H, qlen, slen, slot = pos_args
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 64, 16])
    O_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, 256, 16])
    A_L: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=O_L, k_width=2)

    rs = row0 + gl.arange(0, BM, layout=gl.SliceLayout(1, S_L))
    pos = gl.where((rs // H < qlen) & (slot >= -1), slen - qlen + rs // H, -1)
    m = gl.full([BM], -1.0e30, gl.float32, layout=gl.SliceLayout(1, S_L))  # finite: masked rows give p = 0
    l = gl.zeros([BM], gl.float32, layout=gl.SliceLayout(1, S_L))
    o = gl.zeros([BM, _HALF], gl.float32, layout=O_L)
    zero = gl.zeros([BM, BN], gl.float32, layout=S_L)
    mbarrier.wait(bars.index(_Q), 0)
    if FP8:  # the queries' float16 scaling, undone on the scores (_stage_queries_f16)
        qk_scale = _rows(q_fac.load(gl.SliceLayout(1, S_L)), S_L) * qk_scale
    s0 = zero  # each warpgroup computes a pair's scores at the end of the one before (under its last product)
    if n_pairs > 0:
        if FP8:  # FP8: each latent half widened under the product before it
            if W == 0:
                blk = _cache_block(bt_row, kv_lo, kv_end, cache[2])
                _widen(k_l.index(0), bars, _K0L, 0, cache, blk, kv_lo, kv_end, 0)
                s0 = _scores_begin(q_l.index(0), k_l.index(0), _K0L, bars, 0, zero, TMA)
                s0 = _widen_and_score(s0, q_r.index(0), k_r.index(0), bars, _K0RE, 0, cache, blk, kv_lo, kv_end, 1)
                s0 = _rope_scores(s0, q_e.index(0), k_e.index(0))
            else:
                blk = _cache_block(bt_row, kv_lo + BN, kv_end, cache[2])
                s0 = _scores_begin(q_e.index(0), k_e.index(1), _K1E, bars, 0, zero, TMA)
                s0 = _widen_and_score(s0, q_l.index(0), k_l.index(1), bars, _K1L, 0, cache, blk, kv_lo + BN, kv_end, 0)
                s0 = _widen_and_score(s0, q_r.index(0), k_r.index(1), bars, _K1R, 0, cache, blk, kv_lo + BN, kv_end, 1)
                s0 = warpgroup_mma_wait(num_outstanding=0, deps=(s0,))
        elif W == 0:
            s0 = _scores(q_l.index(0), k_l.index(0), _K0L, q_r.index(0), k_r.index(0), _K0RE, q_e.index(0),
                         k_e.index(0), _K0RE, bars, 0, zero, TMA)
        else:
            s0 = _scores(q_e.index(0), k_e.index(1), _K1E, q_l.index(0), k_l.index(1), _K1L, q_r.index(0),
                         k_r.index(1), _K1R, bars, 0, zero, TMA)
    for i in range(n_pairs):
        ph = i & 1
        more = i + 1 < n_pairs
        start = kv_lo + (2 * i + W) * BN
        # Buffers through an index that is 0 but varies with i: with constant buffers the compiler hoists the
        # wgmma's ~80 shared-memory descriptors out of the loop, and they spill (sm_90 compile, 576 B of stack).
        z = i >> 30
        ql = q_l.index(z)
        qr = q_r.index(z)
        qe = q_e.index(z)
        _prefetch_block(cache, bt_row, start + 2 * BN, kv_end, FP8)  # this warpgroup's block of the next pair
        if W == 0:
            s = _masked(s0, start, pos, kv_end, qk_scale, S_L)
            m0 = gl.maximum(m, gl.max(s, axis=1))
            p = gl.exp2(s - m0[:, None])
            # K0's rope part is dead: p0 there
            _publish(xch.slice(0, BM), m0, _p0(k_e.index(z), p1_buf), p, bars, _X0, True)
            scale = gl.exp2(m - m0)
            l = l * scale + gl.sum(p, axis=1)
            o = o * _rows(scale, O_L)
            _zero_tail(k_l.index(z), start, kv_end, ZERO_TAIL, PE_L)
            o = warpgroup_mma(gl.convert_layout(p.to(k_l.dtype), A_L), k_l.index(z), o, is_async=True)
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            nb = 0  # the next pair's first cache block, for its widening
            if more:  # K0's left half is done with: the next pair's, in flight from now
                gl.thread_barrier()
                nb = _load_part(k_l.index(z), k_e.index(z), bars.index(_K0L), cache, bt_row, start + 2 * BN, kv_end,
                                0, False, CP_L, PE_L, TMA, FP8)
            mbarrier.wait(bars.index(_X1), ph)
            m = xch.slice(BM, BM).load(gl.SliceLayout(1, S_L))
            scale = gl.exp2(m0 - m)
            l = l * scale
            o = o * _rows(scale, O_L)
            fence_async_shared()
            _zero_tail(k_l.index(z + 1), start + BN, kv_end, ZERO_TAIL, PE_L)
            oa = warpgroup_mma(p1_buf, k_l.index(z + 1), o, is_async=True)  # p1 . V1_L
            if more:
                # The next pair's scores over K0's left half (reloaded after p0 . V0_L) queue behind p1 . V1_L, so
                # the tensor cores go on from one to the other (H200, 128 heads: ~1.7% faster, RESULTS.md).
                if FP8:
                    _widen(k_l.index(z), bars, _K0L, ph ^ 1, cache, nb, start + 2 * BN, kv_end, 0)
                sn = _scores_begin(ql, k_l.index(z), _K0L, bars, ph ^ 1, zero, TMA)
                o = warpgroup_mma_wait(num_outstanding=1, deps=(oa,))
                gl.thread_barrier()  # the last use of K1's left half
                _load_part(k_l.index(z + 1), k_e.index(z + 1), bars.index(_K1L), cache, bt_row, start + 3 * BN,
                           kv_end, 0, False, CP_L, PE_L, TMA, FP8)
                if FP8:
                    sn = _widen_and_score(sn, qr, k_r.index(z), bars, _K0RE, ph ^ 1, cache, nb, start + 2 * BN,
                                          kv_end, 1)
                    s0 = _rope_scores(sn, qe, k_e.index(z))
                else:
                    s0 = _scores_end(sn, qr, k_r.index(z), _K0RE, qe, k_e.index(z), _K0RE, bars, ph ^ 1, TMA)
            else:
                o = warpgroup_mma_wait(num_outstanding=0, deps=(oa,))
        else:
            # Parts in the order they were freed: rope keys (after these scores), the left half (after warpgroup
            # 0's last product), the right half (after this warpgroup's own last product).
            s = s0
            if more:  # K1's rope keys are done with (p1 has a buffer of its own): the next pair's, from now
                gl.thread_barrier()
                _load_part(k_e.index(z + 1), k_e.index(z + 1), bars.index(_K1E), cache, bt_row, start + 2 * BN,
                           kv_end, -1, True, CP_L, PE_L, TMA, FP8)
            s = _masked(s, start, pos, kv_end, qk_scale, S_L)
            mp = gl.max(s, axis=1)
            mbarrier.wait(bars.index(_X0), ph)
            m0 = xch.slice(0, BM).load(gl.SliceLayout(1, S_L))
            m1 = gl.maximum(m0, mp)
            p = gl.exp2(s - m1[:, None])
            _publish(xch.slice(BM, BM), m1, p1_buf, p, bars, _X1, True)
            # o_R = (o_R * e^(m - m0) + p0 V0_R) * e^(m0 - m1) + p1 V1_R: p0 (in m0 units) is there already, so its
            # product runs while this warpgroup finishes its softmax.
            o = o * _rows(gl.exp2(m - m0), O_L)
            fence_async_shared()
            _zero_tail(k_r.index(z), start - BN, kv_end, ZERO_TAIL, PE_L)
            o = warpgroup_mma(_p0(k_e.index(z), p1_buf), k_r.index(z), o, is_async=True)  # p0 . V0_R
            l = l * gl.exp2(m - m1) + gl.sum(p, axis=1)
            m = m1
            o = warpgroup_mma_wait(num_outstanding=0, deps=(o,))
            if more:  # the last use of K0's right half and of p0 (its rope buffer)
                gl.thread_barrier()
                _load_part(k_r.index(z), k_e.index(z), bars.index(_K0RE), cache, bt_row, start + BN, kv_end, 1,
                           True, CP_L, PE_L, TMA, FP8)
            o = o * _rows(gl.exp2(m0 - m1), O_L)
            _zero_tail(k_r.index(z + 1), start, kv_end, ZERO_TAIL, PE_L)
            oa = warpgroup_mma(p1_buf, k_r.index(z + 1), o, is_async=True)  # p1 as published: no registers held
            if more:
                # The next pair's scores over K1's rope keys (reloaded after these scores) queue behind p1 . V1_R
                sn = _scores_begin(qe, k_e.index(z + 1), _K1E, bars, ph ^ 1, zero, TMA)
                o = warpgroup_mma_wait(num_outstanding=1, deps=(oa,))
                gl.thread_barrier()
                nb = _load_part(k_r.index(z + 1), k_e.index(z + 1), bars.index(_K1R), cache, bt_row, start + 2 * BN,
                                kv_end, 1, False, CP_L, PE_L, TMA, FP8)
                if FP8:
                    sn = _widen_and_score(sn, ql, k_l.index(z + 1), bars, _K1L, ph ^ 1, cache, nb, start + 2 * BN,
                                          kv_end, 0)
                    sn = _widen_and_score(sn, qr, k_r.index(z + 1), bars, _K1R, ph ^ 1, cache, nb, start + 2 * BN,
                                          kv_end, 1)
                    s0 = warpgroup_mma_wait(num_outstanding=0, deps=(sn,))
                else:
                    s0 = _scores_end(sn, ql, k_l.index(z + 1), _K1L, qr, k_r.index(z + 1), _K1R, bars, ph ^ 1, TMA)
            else:
                o = warpgroup_mma_wait(num_outstanding=0, deps=(oa,))
    _finish(o, m, l, smem, bars, W, out_args, O_L, S_L, FP8)


@gluon.jit
def _first_pair(k_l, k_r, k_e, bars, cache, bt_row, kv_lo, kv_end, TMA: gl.constexpr, FP8: gl.constexpr):
    """The prologue's copies of the first pair of key blocks, every part on its barrier."""
    _load_part(k_l.index(0), k_e.index(0), bars.index(_K0L), cache, bt_row, kv_lo, kv_end, 0, False, CP_L, PE_L,
               TMA, FP8)
    _load_part(k_r.index(0), k_e.index(0), bars.index(_K0RE), cache, bt_row, kv_lo, kv_end, 1, True, CP_L, PE_L,
               TMA, FP8)
    _load_part(k_e.index(1), k_e.index(1), bars.index(_K1E), cache, bt_row, kv_lo + BN, kv_end, -1, True, CP_L,
               PE_L, TMA, FP8)
    _load_part(k_r.index(1), k_e.index(1), bars.index(_K1R), cache, bt_row, kv_lo + BN, kv_end, 1, False, CP_L,
               PE_L, TMA, FP8)
    _load_part(k_l.index(1), k_e.index(1), bars.index(_K1L), cache, bt_row, kv_lo + BN, kv_end, 0, False, CP_L,
               PE_L, TMA, FP8)


@gluon.jit
def mla_seesaw_kernel(
    q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh,
    lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off, BS,
    bt_ptr, bt_stride, meta_ptr, meta_stride, items_ptr,
    out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr,
    H, qk_scale, row_tiles, kv_desc, pe_desc,
    TMA: gl.constexpr = False,
    FP8: gl.constexpr = False,
    PDL: gl.constexpr = False,
):
    """One program = one work item x 64 query rows, as mla_attn_kernel (see its docstring; same arguments), then
    the cache as TMA descriptors where TMA (else unused): bf16, kv_desc over its rows in 64 x 64 boxes (pe_desc
    unused); FP8 (TMA only), kv_desc over the E4M3 rows in 64 x 128 boxes and pe_desc over the rope keys. The
    prologue (default partition) copies the queries and the first pair of blocks, then the two warpgroups run
    the seesaw. FP8: float16 queries, each row scaled as mla_gluon_kernels' FP8 tile does, widened keys and P."""
    KD: gl.constexpr = gl.float16 if FP8 else gl.bfloat16  # the latent MMAs' operands
    HALF_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, _HALF], KD)
    PE_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, P], gl.bfloat16)

    _gdc_enter(PDL)
    row0, seq, kv_lo, kv_end, slot, tok0, qlen, slen = _work_item(items_ptr, meta_ptr, meta_stride, H, row_tiles, BM)
    n_pairs = gl.cdiv(gl.cdiv(gl.maximum(kv_end - kv_lo, 0), BN), 2)  # an odd last block pairs with a masked one
    bt_row = bt_ptr + seq.to(gl.int64) * bt_stride

    # [1, ...]: see _warpgroup's loop. FP8: the latent halves are one allocation, which _stage_queries_f16 sees as
    # a [64, 512] tile (its 64-column blocks are the halves' in turn).
    if FP8:
        q_lr = gl.allocate_shared_memory(KD, [2, BM, _HALF], HALF_S)
        q_l = q_lr.index(0)._reinterpret(KD, [1, BM, _HALF], HALF_S)
        q_r = q_lr.index(1)._reinterpret(KD, [1, BM, _HALF], HALF_S)
    else:
        q_l = gl.allocate_shared_memory(KD, [1, BM, _HALF], HALF_S)
        q_r = gl.allocate_shared_memory(KD, [1, BM, _HALF], HALF_S)
    q_e = gl.allocate_shared_memory(gl.bfloat16, [1, BM, P], PE_S)
    k_l = gl.allocate_shared_memory(KD, [2, BN, _HALF], HALF_S)
    k_r = gl.allocate_shared_memory(KD, [2, BN, _HALF], HALF_S)
    k_e = gl.allocate_shared_memory(gl.bfloat16, [2, BN, P], PE_S)  # rope keys; block 0's then holds p0
    p1_buf = gl.allocate_shared_memory(KD, [BM, BN], gl.NVMMASharedLayout.get_default_for([BM, P], KD))
    xch = gl.allocate_shared_memory(gl.float32, [4 * BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))  # m0, m1, l0, l1
    if FP8:  # the factors that undo the queries' scaling, one a row
        q_fac = gl.allocate_shared_memory(gl.float32, [BM], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    else:
        q_fac = xch  # unused
    bars = gl.allocate_shared_memory(gl.int64, [_NBARS, 1], mbarrier.MBarrierLayout())
    for b in gl.static_range(_NBARS):
        # cp.async loads count each thread (the bf16 queries always come by cp.async); TMA's one expect; the FP8
        # queries' stores and the exchanges one arrival
        mbarrier.init(bars.index(b), count=128 if (b == _Q and not FP8) or (b != _Q and b <= _K1E and not TMA) else 1)
    fence_async_shared()
    gl.thread_barrier()

    row_args = (row0, H, tok0, qlen, slot)
    cache = (lat_ptr, rope_ptr, BS, lat_sb, lat_st, rope_sb, rope_st, rope_off, kv_desc, pe_desc, scl_ptr, scl_sb,
             scl_st, scale_off)
    if FP8:
        Q_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, R], KD)
        fac = _stage_queries_f16(q_lr._reinterpret(KD, [BM, R], Q_S), q_e.index(0), q_ptr, qpe_ptr, q_st, q_sh,
                                 qpe_st, qpe_sh, *row_args, PE_L, gl.SliceLayout(1, PE_L), BM, R, P, 4)
        q_fac.store(fac)
        fence_async_shared()  # the query tiles are read by wgmma
        gl.thread_barrier()
        mbarrier.arrive(bars.index(_Q))
    else:
        _copy_query_rows(q_l.index(0), q_ptr, q_st, q_sh, *row_args, 0, CP_L, BM, _HALF)
        _copy_query_rows(q_r.index(0), q_ptr, q_st, q_sh, *row_args, _HALF, CP_L, BM, _HALF)
        _copy_query_rows(q_e.index(0), qpe_ptr, qpe_st, qpe_sh, *row_args, 0, PE_L, BM, P)
        async_copy.mbarrier_arrive(bars.index(_Q), increment_count=False)
    # After the queries, FP8's too: issued before their staging through registers they ran 1% slower (H200,
    # RESULTS.md issue 8, thirty-fourth session)
    if n_pairs > 0:
        _first_pair(k_l, k_r, k_e, bars, cache, bt_row, kv_lo, kv_end, TMA, FP8)

    smem = (q_l, q_r, q_e, k_l, k_r, k_e, p1_buf, xch, q_fac)
    pos_args = (row0, H, qlen, slen, slot)
    out_args = (out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr, row0, H, tok0, qlen, slot)
    gl.warp_specialize([
        (_warpgroup, (smem, bars, cache, bt_row, kv_lo, kv_end, n_pairs, pos_args, qk_scale, out_args, 0, TMA, FP8)),
        (_warpgroup, (smem, bars, cache, bt_row, kv_lo, kv_end, n_pairs, pos_args, qk_scale, out_args, 1, TMA, FP8)),
    ], [4], [WORKER_REGS])
