"""Keys-as-M MLA decode over DeepSeek's FP8 cache with the loads and the widening in their own warps.

Why: mla_gluon_kt_kernels.mla_attn_gluon_kt_e4m3_kernel takes 174336 B of shared memory, so one program an SM,
and that program runs a tile's steps one after another: wait for the copy, widen E4M3 to float16, score MMAs,
softmax, output MMAs (0.41 of HBM read at 128 x 4096 keys x 16 heads, H200). Here the steps overlap, in three
partitions meeting at mbarriers:

- the loader warp copies each 64-key tile by TMA, as two halves, into two raw slots (a half: its 32 E4M3 rows
  as four 128-byte boxes, its rope keys, its scales; 20992 B);
- the producer warpgroup reads a half into registers, hands the raw slot back, waits for its slot of the
  two-slot float16 ring to be empty, widens the rows and stores them, the rope keys and the scales there; a
  tile's two halves done, it signals the slot's `full` barrier;
- the consumer warpgroup (the default partition) runs the MMAs and the softmax of mla_attn_gluon_kt_e4m3_kernel
  on the ring's slot and signals its `empty` barrier when the output MMAs are done.

Before TMA, two producer warpgroups (one a ring slot) loaded the tiles into registers themselves: without the
consumer's MMAs they streamed at only 0.63 of HBM read at 32 x 65536 x 16, the L1 the busiest unit (ncu), and the
whole kernel ran 20% slower at 4096 keys and 7% at 65536 (RESULTS.md issue 8, twenty-ninth session). Now (ncu,
32 x 65536 x 16) shared memory is the busiest unit (L1/TEX 82%, ~337 KB a tile), yet not the bound: scores from
registers in the producer cut that by a quarter and ran no faster (0.467-0.48 against 0.47 ms; branch
tried/kt-ws-scores-in-registers). The tile's chain of hand-offs is, with one raw tile and two ring slots in
shared memory (RESULTS.md issue 8, thirtieth and thirty-first sessions).
Shared memory: queries 18 KiB, ring 2 x (64 + 8 + 1) KiB, probabilities 8 KiB, raw slots 41 KiB: 213 KiB, one
program an SM. Arguments: the keys-as-M kernels' contract (mla_launch.launch_gluon_kt) with the cache as three
TMA descriptors (mla_launch.e4m3_descriptors). GPU only (Gluon).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma_wait,
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
NUM_WARPS = 4  # the consumer warpgroup (the default partition); the producer and the loader are workers
STAGES = gl.constexpr(2)  # float16 ring slots: the producer fills one while the consumer reads the other
G = gl.constexpr(R // 128)  # a token's scale groups
HALF = gl.constexpr(32)  # keys a raw slot holds: half a tile
# E4M3 bytes of a row a TMA box carries: four boxes a row. 128-byte boxes ran 3-4% faster than 64-byte ones, with
# half the copies and half the producer's barriers (H200, RESULTS.md issue 8, twenty-ninth session).
PIECE = gl.constexpr(128)
HALF_BYTES = gl.constexpr(HALF * (R + 2 * P + 4 * G))  # a raw slot's bytes: 32 rows of 656
# The raw slots' layouts, which the host's TMA descriptors carry too: unswizzled rows.
LAT_SMEM = gl.constexpr(gl.NVMMASharedLayout(0, 8, 2))
PE_SMEM = gl.constexpr(gl.NVMMASharedLayout(0, 16, 2))
SC_SMEM = gl.constexpr(gl.NVMMASharedLayout(0, 32, 2))
# Registers a thread: the producer holds a half tile's E4M3 rows (32) and its widened pieces; the consumer four
# 128 x 16 float32 outputs and five 64 x 16 score tiles (the default partition takes what the workers leave).
PRODUCER_REGS = gl.constexpr(128)
LOADER_REGS = gl.constexpr(48)
MAXNREG = 168
# Shared memory a program takes (sm_90 compile).
SMEM_BYTES = 218440


@gluon.jit
def _issue_half(lat_desc, rope_desc, scl_desc, raw_lat, raw_pe, raw_sc, raw_full, bt_row, kv_lo, kv_end, BS, t,
                HH: gl.constexpr):
    """TMA half HH of key tile t (keys kv_lo + t * BN + HH * HALF, ...) into raw slot HH: its E4M3 rows as four
    [HALF, PIECE] boxes, its rope keys and its scales, all arriving on raw_full[HH]."""
    start = kv_lo + t * BN
    row = (_block_of(bt_row, start, kv_end, BS) * BS + start % BS + HH * HALF).to(gl.int32)
    bar = raw_full.index(HH)
    mbarrier.expect(bar, HALF_BYTES)
    for c in gl.static_range(R // PIECE):
        tma.async_copy_global_to_shared(lat_desc, [row, c * PIECE], bar, raw_lat.index(HH * (R // PIECE) + c))
    tma.async_copy_global_to_shared(rope_desc, [row, 0], bar, raw_pe.index(HH))
    tma.async_copy_global_to_shared(scl_desc, [row, 0], bar, raw_sc.index(HH))


@gluon.jit
def _loader(lat_desc, rope_desc, scl_desc, raw_lat, raw_pe, raw_sc, raw_full, raw_empty, BS, bt_row, kv_lo, kv_end,
            n_tiles):
    """The TMA warp: each key tile's two halves into the two raw slots, each once the producer has read the slot's
    previous half. (Issued from the producer warpgroup itself, each copy took a 128-thread barrier.)"""
    for t in range(0, n_tiles):
        for hh in gl.static_range(2):
            # mbarriers start as if phase 1 had completed: the first pass over the slots does not wait.
            mbarrier.wait(raw_empty.index(hh), (t & 1) ^ 1)
            _issue_half(lat_desc, rope_desc, scl_desc, raw_lat, raw_pe, raw_sc, raw_full, bt_row, kv_lo, kv_end, BS,
                        t, hh)


@gluon.jit
def _load_rows(raw_lat, first, L: gl.constexpr):
    """A raw slot's four [HALF, PIECE] E4M3 boxes (first, ..., first + 3) into registers."""
    return (raw_lat.index(first).load(L), raw_lat.index(first + 1).load(L), raw_lat.index(first + 2).load(L),
            raw_lat.index(first + 3).load(L))


@gluon.jit
def _read_half(raw_lat, raw_pe, raw_sc, raw_full, raw_empty, t, HH: gl.constexpr, DQ_L: gl.constexpr,
               PE_L: gl.constexpr, SC_L: gl.constexpr):
    """Tile t's half HH from its raw slot into registers (E4M3 rows as four pieces, rope keys, scales), then the
    slot back to the loader."""
    mbarrier.wait(raw_full.index(HH), t & 1)
    lat = _load_rows(raw_lat, HH * (R // PIECE), DQ_L)
    pe = raw_pe.index(HH).load(PE_L)
    sc = raw_sc.index(HH).load(SC_L)
    gl.thread_barrier()  # every thread's reads of the raw slot before the loader refills it
    mbarrier.arrive(raw_empty.index(HH), count=1)
    return lat, pe, sc


@gluon.jit
def _store_parts(rows, pe_rows, sc_cols, half, first, kv_end, n, n2, n3, MASKED: gl.constexpr):
    """A half tile's registers (keys first, ...) into its ring slot rows: the E4M3 rows widened to float16, the rope
    keys, the scales transposed; MASKED: zeros for keys past kv_end. (The mask took ~70% of the producer's
    instructions: each float16 pair split, selected and repacked; so only an item's last half tile takes it.)"""
    lat, pe, sc = half
    for c in gl.static_range(R // PIECE):
        x = lat[c].to(gl.float16)
        if MASKED:
            x = gl.where((first + n < kv_end)[:, None], x, 0.0)
        rows.slice(c * PIECE, PIECE, dim=1).store(x)
    if MASKED:
        pe = gl.where((first + n2 < kv_end)[:, None], pe, 0.0).to(gl.bfloat16)
        sc = gl.where((first + n3 < kv_end)[:, None], sc, 0.0)
    pe_rows.store(pe)
    sc_cols.store(gl.permute(sc, (1, 0)))


@gluon.jit
def _store_half(kh, kpe, scl_rows, half, start, kv_end, HH: gl.constexpr, n, n2, n3):
    """A half tile (keys start + HH * HALF, ...) into its rows of a ring slot (_store_parts), masked only where a
    key is past kv_end."""
    first = start + HH * HALF
    parts = (kh.slice(HH * HALF, HALF, dim=0), kpe.slice(HH * HALF, HALF, dim=0),
             scl_rows.slice(HH * HALF, HALF, dim=1))
    if first + HALF <= kv_end:  # every key live: all but an item's last half tile
        _store_parts(*parts, half, first, kv_end, n, n2, n3, False)
    else:
        _store_parts(*parts, half, first, kv_end, n, n2, n3, True)


@gluon.jit
def _widen(kh_ring, kpe_ring, scl_ring, full, empty, raw_lat, raw_pe, raw_sc, raw_full, raw_empty, kv_lo, kv_end,
           n_tiles):
    """The producer warpgroup: fill the two-slot float16 ring with key tiles 0, 1, ... A tile comes as two halves
    in the two raw slots. Each half's bytes are read into registers and the slot handed back to the loader at
    once, so the loader's next copy is in flight while the half waits for its ring slot, is widened and stored.
    (Reading both halves before the wait for the ring slot ran 1% slower: H200, RESULTS.md issue 8.) Keys past
    kv_end are zeros (a masked key's value times its zero probability stays 0, where the cache's stale bytes
    could be NaN)."""
    # [HALF, PIECE], half a warp a row, 8 bytes a thread: a half warp's 8-byte loads take a row's 128 bytes, a quarter
    # warp's 16-byte float16 stores a swizzled 128-byte row of the ring, both free of bank conflicts
    # (gl.bank_conflicts). 16 bytes a thread made the stores 2-way conflicted (8 threads a row) or the loads (4):
    # 11% and 5% slower at 32 x 65536 x 16 (H200, RESULTS.md issue 8, thirtieth session).
    DQ_L: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
    PE_L: gl.constexpr = copy_layout("pe", 4)
    SC_L: gl.constexpr = gl.BlockedLayout([1, 1], [8, 4], [4, 1], [1, 0])  # [HALF, G]: one scale a thread
    n = gl.arange(0, HALF, layout=gl.SliceLayout(1, DQ_L))
    n2 = gl.arange(0, HALF, layout=gl.SliceLayout(1, PE_L))
    n3 = gl.arange(0, HALF, layout=gl.SliceLayout(1, SC_L))
    # the ring's scales as [STAGES, G, BN] rows, so a half tile's [G, HALF] is one store
    scl_rows = scl_ring._reinterpret(gl.float32, [STAGES, G, BN], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    for t in range(0, n_tiles):
        s = t % STAGES
        start = kv_lo + t * BN
        h0 = _read_half(raw_lat, raw_pe, raw_sc, raw_full, raw_empty, t, 0, DQ_L, PE_L, SC_L)
        # mbarriers start as if phase 1 had completed: the first pass over the ring does not wait.
        mbarrier.wait(empty.index(s), ((t // STAGES) & 1) ^ 1)
        _store_half(kh_ring.index(s), kpe_ring.index(s), scl_rows.index(s), h0, start, kv_end, 0, n, n2, n3)
        h1 = _read_half(raw_lat, raw_pe, raw_sc, raw_full, raw_empty, t, 1, DQ_L, PE_L, SC_L)
        _store_half(kh_ring.index(s), kpe_ring.index(s), scl_rows.index(s), h1, start, kv_end, 1, n, n2, n3)
        fence_async_shared()  # generic-proxy stores, read by the consumer's wgmmas (async proxy) ...
        gl.thread_barrier()  # ... from every thread of this warpgroup, before its one arrive below
        mbarrier.arrive(full.index(s), count=1)


@gluon.jit
def _consumer(q16_smem, qpe_smem, kh_ring, kpe_ring, scl_ring, p_smem, full, empty,
              q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh, out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr,
              row0, kv_lo, kv_end, slot, tok0, qlen, slen, n_tiles, H, qk_scale):
    """mla_attn_gluon_kt_e4m3_kernel's loop on the producer's ring: scores with the scales on them, the column
    softmax, scaled probabilities, outputs; then the output rows and log-sum-exp. (Starting tile t + 1's score
    MMAs before tile t's softmax, which waits for t + 1's slot first, lost 5-12% on the H200 with the register-
    loading producers: tile t's slot is released later, and the producers wait on it. Waiting for tile t's output
    MMAs together with tile t + 1's score MMAs lost 2.5% for the same reason; waiting for the output MMAs alone
    with wait_group 5 there makes ptxas serialise every wgmma, C7514.)"""
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


@gluon.jit(do_not_specialize=["BS", "bt_stride"])
def mla_attn_gluon_kt_e4m3_ws_kernel(
    q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh,
    lat_desc, rope_desc, scl_desc, BS,
    bt_ptr, bt_stride, meta_ptr, meta_stride, items_ptr,
    out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr,
    H, qk_scale, row_tiles,
    PDL: gl.constexpr = False, EARLY: gl.constexpr = False,
):
    """mla_attn_gluon_kt_e4m3_kernel (one work item x at most 16 query rows of an FP8 cache) with the loads and
    widening in a producer warpgroup (see the module docstring). The cache comes as three TMA descriptors over
    its [blocks x BS, 656] bytes: the E4M3 rows, the rope keys and the scales (mla_launch.e4m3_descriptors).
    BS and bt_stride stay runtime values: one the JIT specialised to a constant could not go to a worker."""
    row0, seq, kv_lo, kv_end, slot, tok0, qlen, slen = _work_item(items_ptr, meta_ptr, meta_stride, H, row_tiles, BM)
    n_tiles = gl.cdiv(gl.maximum(kv_end - kv_lo, 0), BN)
    bt_row = bt_ptr + seq.to(gl.int64) * bt_stride
    _gdc_enter(PDL, EARLY)  # the plan is settled before the step; queries and cache are read after the wait

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
    # the TMA landing slots, one a half tile
    raw_lat = gl.allocate_shared_memory(gl.float8e4nv, [2 * (R // PIECE), HALF, PIECE], LAT_SMEM)
    raw_pe = gl.allocate_shared_memory(gl.bfloat16, [2, HALF, P], PE_SMEM)
    raw_sc = gl.allocate_shared_memory(gl.float32, [2, HALF, G], SC_SMEM)
    full = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    raw_full = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    raw_empty = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(STAGES):
        mbarrier.init(full.index(i), count=1)  # the producer's one arrive
        mbarrier.init(empty.index(i), count=1)  # the consumer's
        mbarrier.init(raw_full.index(i), count=1)  # the loader's expect, then the TMA bytes
        mbarrier.init(raw_empty.index(i), count=1)  # the producer's
    fence_async_shared()
    gl.warp_specialize([
        (_consumer, (q16_smem, qpe_smem, kh_ring, kpe_ring, scl_ring, p_smem, full, empty,
                     q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh, out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr,
                     row0, kv_lo, kv_end, slot, tok0, qlen, slen, n_tiles, H, qk_scale)),
        (_widen, (kh_ring, kpe_ring, scl_ring, full, empty, raw_lat, raw_pe, raw_sc, raw_full, raw_empty, kv_lo, kv_end,
                  n_tiles)),
        (_loader, (lat_desc, rope_desc, scl_desc, raw_lat, raw_pe, raw_sc, raw_full, raw_empty, BS, bt_row, kv_lo,
                   kv_end, n_tiles)),
    ], [4, 1], [PRODUCER_REGS, LOADER_REGS])
