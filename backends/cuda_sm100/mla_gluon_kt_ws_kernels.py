"""Keys-as-M MLA decode over DeepSeek's FP8 cache with the widening in its own warps (warp-specialised).

Why: mla_gluon_kt_kernels.mla_attn_gluon_kt_e4m3_kernel takes 174336 B of shared memory, so one program an SM,
and that program runs a tile's steps one after another: wait for the copy, widen E4M3 to float16, score MMAs,
softmax, output MMAs. At 128 x 4096 keys x 16 heads a tile takes ~3.2 us where its 41 KiB need ~1.2 us at an SM's
share of HBM (0.40 of HBM read, H200; benchmarks/RESULTS.md, issue 8). Reading the E4M3 rows from L2 into the
widening with two programs an SM lost 3-10% (RESULTS.md, twenty-eighth session). Here the steps overlap:

- two producer warpgroups, one a ring slot, each load a tile's E4M3 rows, rope keys and scales from global
  memory into registers, wait for their slot to be empty, widen the rows to float16 and store all three into the
  two-slot ring in shared memory, then signal the slot's `full` barrier;
- the consumer warpgroup (the default partition) runs the MMAs and the softmax of mla_attn_gluon_kt_e4m3_kernel
  on the ring's slot and signals its `empty` barrier when the output MMAs are done.

So a tile's loads and widening run under the previous tile's MMAs and softmax. Shared memory: queries 18 KiB,
ring 2 x (64 + 8 + 1) KiB, probabilities 8 KiB: 172 KiB, one program an SM, three warpgroups.
Same contract and arguments as the keys-as-M kernels (mla_launch.launch_gluon_kt), less the shape constexprs.
GPU only (Gluon).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, warpgroup_mma_wait,
)

from deepinfer.backends.cuda_sm100.mla_gluon_kernels import (
    _block_of, _gdc_enter, _stage_queries_f16, _work_item, copy_layout,
)
from deepinfer.backends.cuda_sm100.mla_gluon_kt_kernels import (
    _column_softmax, _e4m3_epilogue, _e4m3_output_mmas, _e4m3_score_mmas, _e4m3_scores, _e4m3_state, _scaled_probs,
)

# Constexprs of the module, not arguments: a worker partition takes runtime values only.
R = gl.constexpr(512)  # latent width (DeepSeek's kv_lora_rank)
P = gl.constexpr(64)  # rope width
BM = gl.constexpr(16)  # query rows a program: the wgmma N
BN = gl.constexpr(64)  # keys a tile: the wgmma M of one warpgroup
NUM_WARPS = 4  # the consumer warpgroup (the default partition); the producer warpgroups are workers
STAGES = gl.constexpr(2)  # ring slots: a producer fills one while the consumer reads the other
G = gl.constexpr(R // 128)  # a token's scale groups
# Registers a thread: a producer holds a tile's E4M3 rows (64), rope keys (16) and scales; the consumer four
# 128 x 16 float32 outputs and five 64 x 16 score tiles. maxnreg for the launch: 384 threads x 168 fit the 64 Ki
# register file, and the producers' release lets the consumer grow.
PRODUCER_REGS = gl.constexpr(128)
MAXNREG = 168
# Shared memory a program takes (sm_90 compile).
SMEM_BYTES = 176424


@gluon.jit
def _tile_loads(lat_ptr, scl_ptr, rope_ptr, blk, start, kv_end, BS, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st,
                scale_off, rope_off, DQ_L: gl.constexpr, PE_L: gl.constexpr, SC_L: gl.constexpr, BN: gl.constexpr):
    """Key tile [start, start + BN) of cache block blk into registers: its E4M3 rows as four [BN, 128] pieces,
    rope keys [BN, P] (bf16) and scales [BN, G]; keys past kv_end are zeros (so a masked key's value times
    its zero probability stays 0, where the cache's stale bytes could be NaN)."""
    n = gl.arange(0, BN, layout=gl.SliceLayout(1, DQ_L))
    c = gl.arange(0, 128, layout=gl.SliceLayout(0, DQ_L))
    # Rows are 16-byte aligned (656 bytes, the rope at byte 528, the scales at 512), which runtime strides do
    # not show the compiler: say so, for 16-byte loads.
    row = gl.multiple_of(blk * lat_sb + (start % BS + n).to(gl.int64) * lat_st, 16)
    live = (start + n < kv_end)[:, None]
    ptrs = lat_ptr + row[:, None] + c[None, :]
    k0 = gl.load(ptrs, mask=live, other=0.0)
    k1 = gl.load(ptrs + 128, mask=live, other=0.0)
    k2 = gl.load(ptrs + 256, mask=live, other=0.0)
    k3 = gl.load(ptrs + 384, mask=live, other=0.0)
    n2 = gl.arange(0, BN, layout=gl.SliceLayout(1, PE_L))
    c2 = gl.arange(0, P, layout=gl.SliceLayout(0, PE_L))
    rrow = gl.multiple_of(blk * rope_sb + (start % BS + n2).to(gl.int64) * rope_st + rope_off, 8)
    pe = gl.load(rope_ptr + rrow[:, None] + c2[None, :], mask=(start + n2 < kv_end)[:, None], other=0.0)
    # A key's G scales are 16 contiguous bytes: two threads a key, each key once (four 4-byte loads a key, each
    # made by two threads, were ~480 of a tile's ~736 excess sectors: ncu, RESULTS.md issue 8).
    n3 = gl.arange(0, BN, layout=gl.SliceLayout(1, SC_L))
    g3 = gl.arange(0, G, layout=gl.SliceLayout(0, SC_L))
    srow = gl.multiple_of(blk * scl_sb + (start % BS + n3).to(gl.int64) * scl_st + scale_off, 4)
    sc = gl.load(scl_ptr + srow[:, None] + g3[None, :], mask=(start + n3 < kv_end)[:, None], other=0.0)
    return (k0, k1, k2, k3), pe, sc


@gluon.jit
def _produce(kh_ring, kpe_ring, scl_ring, full, empty, lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st,
             rope_sb, rope_st, scale_off, rope_off, BS, bt_row, kv_lo, kv_end, n_tiles, SLOT: gl.constexpr):
    """Fill ring slot SLOT with tiles SLOT, SLOT + STAGES, ...: load a tile into registers, wait for the slot to be
    empty, widen the E4M3 rows to float16 and store them, the rope keys and the scales (one [BN] row a group),
    then signal `full`. Each slot has its own producer warpgroup, so two tiles' loads are in flight at once, and
    a tile's loads are issued before the wait for its slot (one producer for both slots, its loads after the
    wait: 0.250 against the one-warpgroup kernel's 0.204 ms at 128 x 4096 x 16, H200)."""
    DQ_L: gl.constexpr = copy_layout("dq", 4)
    PE_L: gl.constexpr = copy_layout("pe", 4)
    SC_L: gl.constexpr = gl.BlockedLayout([1, G // 2], [16, 2], [4, 1], [1, 0])  # [BN, G] over 128 threads
    views = (lat_ptr, scl_ptr, rope_ptr)
    strides = (BS, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off)
    # the ring's scales as one [STAGES * G, BN] tile, so a slot's [G, BN] rows are one store
    scl_rows = scl_ring._reinterpret(gl.float32, [STAGES * G, BN], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for t in range(SLOT, n_tiles, STAGES):
        start = kv_lo + t * BN
        k, pe, sc = _tile_loads(*views, _block_of(bt_row, start, kv_end, BS), start, kv_end, *strides, DQ_L, PE_L,
                                SC_L, BN)
        # mbarriers start as if phase 1 had completed: the first pass over the ring does not wait.
        mbarrier.wait(empty.index(SLOT), ((t // STAGES) & 1) ^ 1)
        kh = kh_ring.index(SLOT)
        for g in gl.static_range(G):
            kh.slice(g * 128, 128, dim=1).store(k[g].to(gl.float16))
        scl_rows.slice(SLOT * G, G, dim=0).store(gl.permute(sc, (1, 0)))
        kpe_ring.index(SLOT).store(pe)
        fence_async_shared()  # generic-proxy stores, read by the consumer's wgmmas (async proxy) ...
        gl.thread_barrier()  # ... from every thread of this warpgroup, before its one arrive below
        mbarrier.arrive(full.index(SLOT), count=1)


# One function a producer partition: a worker takes runtime arguments only, and its slot is a constexpr.
@gluon.jit
def _producer0(kh_ring, kpe_ring, scl_ring, full, empty, lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st,
               rope_sb, rope_st, scale_off, rope_off, BS, bt_row, kv_lo, kv_end, n_tiles):
    """Ring slot 0's producer: tiles 0, 2, 4, ..."""
    _produce(kh_ring, kpe_ring, scl_ring, full, empty, lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st,
             rope_sb, rope_st, scale_off, rope_off, BS, bt_row, kv_lo, kv_end, n_tiles, 0)


@gluon.jit
def _producer1(kh_ring, kpe_ring, scl_ring, full, empty, lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st,
               rope_sb, rope_st, scale_off, rope_off, BS, bt_row, kv_lo, kv_end, n_tiles):
    """Ring slot 1's producer: tiles 1, 3, 5, ..."""
    _produce(kh_ring, kpe_ring, scl_ring, full, empty, lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st,
             rope_sb, rope_st, scale_off, rope_off, BS, bt_row, kv_lo, kv_end, n_tiles, 1)


@gluon.jit
def _consumer(q16_smem, qpe_smem, kh_ring, kpe_ring, scl_ring, p_smem, full, empty,
              q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh, out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr,
              row0, kv_lo, kv_end, slot, tok0, qlen, slen, n_tiles, H, qk_scale):
    """mla_attn_gluon_kt_e4m3_kernel's loop on the producers' ring: scores with the scales on them, the column
    softmax, scaled probabilities, outputs; then the output rows and log-sum-exp. (Starting tile t + 1's score
    MMAs before tile t's softmax, which waits for t + 1's slot first, lost 5-12% on the H200: tile t's slot is
    released later, and the producers wait on it.)"""
    PE_L: gl.constexpr = copy_layout("pe", 4)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    KEYS_L: gl.constexpr = gl.SliceLayout(1, S_L)
    q_fac = _stage_queries_f16(q16_smem, qpe_smem, q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh, row0, H, tok0, qlen,
                               slot, PE_L, gl.SliceLayout(0, S_L), BM, R, P, 4)
    fence_async_shared()
    gl.thread_barrier()  # every thread's query stores before the first wgmma reads them

    rs, pos, m_i, l_keys, s_zero, kn, acc0, acc1, acc2, acc3 = _e4m3_state(row0, H, qlen, slen, slot, S_L, BM, BN)
    for t in range(0, n_tiles):
        s = t % STAGES
        mbarrier.wait(full.index(s), (t // STAGES) & 1)
        kh = kh_ring.index(s)
        sp, s0, s1, s2, s3 = _e4m3_score_mmas(kh, kpe_ring.index(s), q16_smem, qpe_smem, s_zero)
        sc = (scl_ring.index(s * G).load(KEYS_L), scl_ring.index(s * G + 1).load(KEYS_L),
              scl_ring.index(s * G + 2).load(KEYS_L), scl_ring.index(s * G + 3).load(KEYS_L))
        sp, s0, s1, s2, s3 = warpgroup_mma_wait(num_outstanding=0, deps=(sp, s0, s1, s2, s3))
        sv = _e4m3_scores(sp, s0, s1, s2, s3, sc, q_fac)
        p, alpha, m_i, l_keys = _column_softmax(sv, kv_lo + t * BN + kn, pos, kv_end, qk_scale, m_i, l_keys)
        _scaled_probs(p_smem, p, sc)
        fence_async_shared()
        gl.thread_barrier()  # all of P is written
        acc0, acc1, acc2, acc3 = _e4m3_output_mmas(kh, p_smem, acc0, acc1, acc2, acc3, alpha)
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
        gl.thread_barrier()  # every warp is done with P and the slot before P is rewritten and the slot released
        mbarrier.arrive(empty.index(s), count=1)

    _e4m3_epilogue(acc0, acc1, acc2, acc3, m_i, l_keys, rs, (out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr), row0, H,
                   tok0, qlen, slot, S_L, R)


# Integers handed to the producer stay runtime values: one the JIT specialised to a constant (a block-table stride
# of 1) could not be passed to a worker partition. _tile_loads states the rows' alignment instead.
@gluon.jit(do_not_specialize=["lat_sb", "lat_st", "scl_sb", "scl_st", "rope_sb", "rope_st", "scale_off", "rope_off",
                              "BS", "bt_stride"])
def mla_attn_gluon_kt_e4m3_ws_kernel(
    q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh,
    lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off, BS,
    bt_ptr, bt_stride, meta_ptr, meta_stride, items_ptr,
    out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr,
    H, qk_scale, row_tiles,
    PDL: gl.constexpr = False,
):
    """mla_attn_gluon_kt_e4m3_kernel (one work item x at most 16 query rows of an FP8 cache) with the loads and
    widening in producer warpgroups (see the module docstring)."""
    row0, seq, kv_lo, kv_end, slot, tok0, qlen, slen = _work_item(items_ptr, meta_ptr, meta_stride, H, row_tiles, BM)
    n_tiles = gl.cdiv(gl.maximum(kv_end - kv_lo, 0), BN)
    bt_row = bt_ptr + seq.to(gl.int64) * bt_stride
    _gdc_enter(PDL)  # the plan is settled before the step; queries and cache are read after the wait

    q16_smem = gl.allocate_shared_memory(gl.float16, [BM, R], gl.NVMMASharedLayout.get_default_for([BM, R], gl.float16))
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, P],
                                        gl.NVMMASharedLayout.get_default_for([BM, P], gl.bfloat16))
    kh_ring = gl.allocate_shared_memory(gl.float16, [STAGES, BN, R],
                                       gl.NVMMASharedLayout.get_default_for([BN, R], gl.float16))
    kpe_ring = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, P],
                                        gl.NVMMASharedLayout.get_default_for([BN, P], gl.bfloat16))
    # a slot's group's scales, [BN] (index() drops the ring dimension)
    scl_ring = gl.allocate_shared_memory(gl.float32, [STAGES * G, BN], gl.SwizzledSharedLayout(1, 1, 1, [0]))
    p_smem = gl.allocate_shared_memory(gl.float16, [G, BN, BM], gl.NVMMASharedLayout.get_default_for([BN, BM],
                                                                                                      gl.float16))
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)  # the producer's one arrive
        mbarrier.init(empty.index(i), count=1)  # the consumer's
    fence_async_shared()
    producer_args = (kh_ring, kpe_ring, scl_ring, full, empty, lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb,
                     scl_st, rope_sb, rope_st, scale_off, rope_off, BS, bt_row, kv_lo, kv_end, n_tiles)
    gl.warp_specialize([
        (_consumer, (q16_smem, qpe_smem, kh_ring, kpe_ring, scl_ring, p_smem, full, empty,
                     q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh, out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr,
                     row0, kv_lo, kv_end, slot, tok0, qlen, slen, n_tiles, H, qk_scale)),
        (_producer0, producer_args),
        (_producer1, producer_args),
    ], [4, 4], [PRODUCER_REGS, PRODUCER_REGS])
