"""FP8 block-scaled GEMM for large M in Gluon (Hopper): DeepGEMM's warp-specialised layout.

Why a second kernel: in gemm_kernel, Triton 3.6 retires each 128-wide K block's MMA before the warps that issued
it promote the partial product (scale it by the token-group x weight-block scales, add it to the float32 sum),
so the tensor cores idle during every promotion; three small CTAs per SM hide part of it (0.71-0.78x cuBLAS
row-wise FP8 at M=4096, benchmarks/RESULTS.md, issue 9). Here, as in DeepGEMM, one persistent CTA per SM has

- a one-warp producer that TMA-copies each tile's A rows (one 64-row piece per consumer) and B [128, 128] E4M3
  into rings of STAGES buffers, with each K block's scales (cp.async), signalled by mbarriers (ready: bytes
  landed; empty: every consumer is done);
- two or three consumer warpgroups, each owning 64 of the tile's rows: wgmma K blocks into partial
  accumulators, read the block's scales, release the buffers, promote. They run unsynchronised, so one's
  promotion overlaps the others' MMAs. Registers decide the shape: two consumers (240 registers each) hold two
  partials and wait once per two K blocks; three (160 each) hold one and wait once per block. A consumer with
  none of a tile's rows (a group's or the matrix's last tile) skips its MMAs;
- the producer running ahead across tile boundaries, so a tile's pipeline fill hides behind the last tile.

Layouts: 0, one matrix (TMA-stored output); 1, contiguous groups (rows sorted by expert, as gemm_kernel's
LAYOUT 1): a tile map from group_tile_map_kernel gives each row tile its group and row range, B tiles are read
from that group's weight, and rows past the group's end are masked on the store.

Numerics are gemm_kernel's (tests compare both with the reference): per K block, partial * (a_scale[row] x
b_scale[N block, K block]) added in float32, bf16 / fp16 output. GPU only (Gluon has no interpreter): tests
run it on the H200, and an sm_90 compile on the CPU (tests/conformance/test_gluon_compile.py).
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (
    fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
)

from deepinfer.backends.cuda_sm100.gemm_kernels import grouped_tile

BN = gl.constexpr(128)  # columns a tile: one weight scale block, so one B scale a K block
BK = gl.constexpr(128)  # one quantisation group
HALF = gl.constexpr(64)  # rows a consumer warpgroup owns (one wgmma M)
NUM_WARPS = 4  # the default partition (consumer 0); the other consumers and the producer are workers
PRODUCER_REGS = gl.constexpr(24)
GROUP_M = 8  # row tiles that walk the N tiles together
# consumers -> (ring stages, registers of each consumer, maxnreg the launch asks for so the partitions get them,
# shared memory of the sm_90 compile: rings, scale rings, output tiles, barriers). Two consumers had 6 stages until
# the scale rings took the room (4 to 6 measured within 1-2% of each other, RESULTS.md issue 9).
CONFIGS = {2: (5, 240, 168, 200800), 3: (4, 160, 128, 217452)}
SMEM_BYTES = max(c[3] for c in CONFIGS.values())


@gluon.jit
def _tile(tile, shape, GROUP_M: gl.constexpr, BM: gl.constexpr, LAYOUT: gl.constexpr):
    """Tile id -> (group, first row, end row, N tile). Grouped order: GROUP_M row tiles walk the N tiles
    together, so their B tiles stay in L2. A tile with end <= first has nothing to do (grouped layout)."""
    M, N, K, m_tiles, tmap_ptr = shape
    pid_m, pid_n = grouped_tile(tile, gl.cdiv(N, BN), m_tiles, GROUP_M)  # the tile kernel's order
    if LAYOUT == 0:
        return pid_m * 0, pid_m * BM, M, pid_n
    else:
        entry = tmap_ptr + 3 * pid_m
        return gl.load(entry), gl.load(entry + 1), gl.load(entry + 2), pid_n


@gluon.jit
def _k_range(item, tiles, k_iters, SPLIT: gl.constexpr):
    """Work item -> (tile, split, first K block, end K block): SPLIT consecutive slices of a tile's K blocks, the
    items of one slice for every tile before the next slice's (SPLIT 1: the tile and all its blocks)."""
    if SPLIT == 1:
        return item, 0, 0, k_iters
    tile = item % tiles
    split = item // tiles
    return tile, split, split * k_iters // SPLIT, (split + 1) * k_iters // SPLIT


@gluon.jit
def _producer(a_desc, b_desc, a0, a1, a2, sa0, sa1, sa2, ring, scales, shape, GROUP_M: gl.constexpr,
              CONSUMERS: gl.constexpr, LAYOUT: gl.constexpr, SPLIT: gl.constexpr):
    """A tile is CONSUMERS 64-row pieces, one ring per consumer (a2, sa2 unused with two). With each K block's
    pieces go their a_scale rows (the sa rings) and the block's b_scale (the sb ring, copied to all 64 columns so
    that it reads back in the rows' layout).

    The scales go by cp.async, each lane's copies arriving on the block's ready barrier when they land (the
    barrier counts the producer's expect and its 32 lanes). Consumers loading them themselves stalled their
    wgmma issue: a warpgroup's wgmma fence waits for its loads in flight (ncu on the H200, RESULTS.md issue 9).
    """
    b_bufs, ready, empty, sb = ring
    as_ptr, stride_asm, stride_ask, bs_ptr, stride_bsg, stride_bsn, stride_bsk = scales
    M, N, K, m_tiles, tmap_ptr = shape
    CP: gl.constexpr = gl.BlockedLayout([HALF // 32], [32], [1], [0])
    r = gl.arange(0, HALF, layout=CP)
    BM: gl.constexpr = CONSUMERS * HALF
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    k_iters = gl.cdiv(K, BK)
    nbytes: gl.constexpr = (BM + BN) * BK  # e4m3: one byte an element
    i = 0
    tiles = m_tiles * gl.cdiv(N, BN)
    for item in range(gl.program_id(0), tiles * SPLIT, gl.num_programs(0)):
        tile, split, kb_lo, kb_hi = _k_range(item, tiles, k_iters, SPLIT)
        g, row0, row_end, pid_n = _tile(tile, shape, GROUP_M, BM, LAYOUT)
        if row0 < row_end:
            b_row = g * N + pid_n * BN  # B viewed as [groups * N, K]
            sb_ptrs = bs_ptr + g * stride_bsg + pid_n * stride_bsn + r * 0
            for kk in range(kb_lo, kb_hi):
                s = i % STAGES
                # mbarriers start as if phase 1 had completed: the first pass over the ring does not wait.
                mbarrier.wait(empty.index(s), ((i // STAGES) & 1) ^ 1)
                mbarrier.expect(ready.index(s), nbytes)
                tma.async_copy_global_to_shared(a_desc, [row0, kk * BK], ready.index(s), a0.index(s))
                tma.async_copy_global_to_shared(a_desc, [row0 + HALF, kk * BK], ready.index(s), a1.index(s))
                if CONSUMERS == 3:
                    tma.async_copy_global_to_shared(a_desc, [row0 + 2 * HALF, kk * BK], ready.index(s), a2.index(s))
                tma.async_copy_global_to_shared(b_desc, [b_row, kk * BK], ready.index(s), b_bufs.index(s))
                # Rows past the end (the matrix's or the group's) take the last row's scales: not stored.
                _copy_a_scales(sa0, s, as_ptr, row0, row_end, r, kk, stride_asm, stride_ask)
                _copy_a_scales(sa1, s, as_ptr, row0 + HALF, row_end, r, kk, stride_asm, stride_ask)
                if CONSUMERS == 3:
                    _copy_a_scales(sa2, s, as_ptr, row0 + 2 * HALF, row_end, r, kk, stride_asm, stride_ask)
                async_copy.async_copy_global_to_shared(sb.index(s), sb_ptrs + kk * stride_bsk)
                async_copy.mbarrier_arrive(ready.index(s), increment_count=False)
                i += 1


@gluon.jit
def _copy_a_scales(sa, s, as_ptr, row0, row_end, r, kk, stride_asm, stride_ask):
    """cp.async K block kk's a_scale of rows row0 + r (clamped to the last real row) into slot s of ring sa."""
    rows = gl.minimum(row0 + r, row_end - 1)
    async_copy.async_copy_global_to_shared(sa.index(s), as_ptr + rows * stride_asm + kk * stride_ask)


@gluon.jit
def _start_mma(a_bufs, b_bufs, ready, i, part):
    """Wait for ring slot i's tiles and start their MMA into part's registers (use_acc=False: part is dead)."""
    s = i % b_bufs.type.shape[0]
    mbarrier.wait(ready.index(s), (i // b_bufs.type.shape[0]) & 1)
    return warpgroup_mma(a_bufs.index(s), b_bufs.index(s).permute((1, 0)), part, use_acc=False, is_async=True)


@gluon.jit
def _k_scale(sa, sb, i, ROW: gl.constexpr):
    """a_scale x b_scale of ring slot i's K block for this warpgroup's 64 rows, from shared memory (the producer's
    copies, landed with the slot's tiles)."""
    s = i % sa.type.shape[0]
    return sa.index(s).load(ROW) * sb.index(s).load(ROW)


@gluon.jit
def _store(acc, out, row0, row_end, col0, N, W: gl.constexpr):
    """This warpgroup's [64, 128] output through its shared-memory tile: a TMA store (clipped at the tensor's
    edges) where all 64 rows are the tile's, else (a group's last rows; the next rows are another group's)
    row-masked stores."""
    c_desc, c_smem, c_ptr, stride_cm, stride_cw = out
    c_half = c_smem.index(W)
    tma.store_wait(0)  # this warpgroup's last store has left c_half
    c_half.store(acc.to(c_desc.dtype))
    if row0 + HALF <= row_end:
        fence_async_shared()
        tma.async_copy_shared_to_global(c_desc, [row0, col0], c_half)
    else:
        ST: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [4, 1], [1, 0])
        r = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, ST))
        c = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, ST))
        ptrs = c_ptr + r.to(gl.int64)[:, None] * stride_cm + c[None, :]
        gl.store(ptrs, c_half.load(ST), mask=(r < row_end)[:, None] & (c < N)[None, :])


@gluon.jit
def _store_partial(acc, out, split, row0, row_end, col0, N, L: gl.constexpr):
    """This warpgroup's [64, 128] float32 partial of K slice `split`, straight from registers into the split-K
    workspace (out's c_ptr: [SPLIT, M, N], slices stride_cw apart; rows past row_end are not stored)."""
    c_desc, c_smem, c_ptr, stride_cm, stride_cw = out
    r = row0 + gl.arange(0, HALF, layout=gl.SliceLayout(1, L))
    c = col0 + gl.arange(0, BN, layout=gl.SliceLayout(0, L))
    ptrs = c_ptr + split.to(gl.int64) * stride_cw + r.to(gl.int64)[:, None] * stride_cm + c[None, :]
    gl.store(ptrs, acc, mask=(r < row_end)[:, None] & (c < N)[None, :])


@gluon.jit
def _consumer(a_bufs, sa, ring, out, shape, GROUP_M: gl.constexpr, CONSUMERS: gl.constexpr, LAYOUT: gl.constexpr,
              W: gl.constexpr, SPLIT: gl.constexpr):
    """Warpgroup W's 64 rows (its own rings a_bufs of A pieces and sa of their scales) of every tile this CTA takes.

    Two consumers: two K blocks a wait (both MMAs, into two partials, back to back; then both promote). Three: one
    (their registers hold one partial).
    """
    b_bufs, ready, empty, sb = ring
    M, N, K, m_tiles, tmap_ptr = shape
    BM: gl.constexpr = CONSUMERS * HALF
    STAGES: gl.constexpr = b_bufs.type.shape[0]
    PAIRS: gl.constexpr = CONSUMERS == 2
    L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BN, 32])
    ROW: gl.constexpr = gl.SliceLayout(1, L)
    k_iters = gl.cdiv(K, BK)
    # Partials are dead once promoted: their registers take the next MMAs (use_acc=False), so the loop carries
    # them and no register moves are needed.
    p0 = gl.zeros([HALF, BN], gl.float32, L)
    p1 = gl.zeros([HALF, BN], gl.float32, L)
    i = 0
    tiles = m_tiles * gl.cdiv(N, BN)
    for item in range(gl.program_id(0), tiles * SPLIT, gl.num_programs(0)):
        tile, split, kb_lo, kb_hi = _k_range(item, tiles, k_iters, SPLIT)
        n_k = kb_hi - kb_lo
        g, row0, row_end, pid_n = _tile(tile, shape, GROUP_M, BM, LAYOUT)
        row0 += W * HALF
        if row0 >= row_end and row0 < row_end + W * HALF:
            # The tile has rows but none of this warpgroup's (a group's or the matrix's last tile): skip the MMAs,
            # still take each K block's buffers in turn (after they land: the producer reuses them).
            for kk in range(n_k):
                mbarrier.wait(ready.index(i % STAGES), (i // STAGES) & 1)
                mbarrier.arrive(empty.index(i % STAGES), count=1)
                i += 1
        elif row0 < row_end:
            acc = gl.zeros([HALF, BN], gl.float32, L)
            if PAIRS:
                for kk in range(0, n_k - 1, 2):
                    t0 = _start_mma(a_bufs, b_bufs, ready, i, p0)
                    t1 = _start_mma(a_bufs, b_bufs, ready, i + 1, p1)
                    # Scales read under the MMAs, before the slots are released: +2-3% on the H200. Three
                    # consumers (one block a wait) lost ~1% that way, so they read them after the wait.
                    s0 = _k_scale(sa, sb, i, ROW)
                    s1 = _k_scale(sa, sb, i + 1, ROW)
                    p0, p1 = warpgroup_mma_wait(0, deps=[t0, t1])
                    mbarrier.arrive(empty.index(i % STAGES), count=1)
                    mbarrier.arrive(empty.index((i + 1) % STAGES), count=1)
                    acc += p0 * s0[:, None]
                    acc += p1 * s1[:, None]
                    i += 2
                if n_k % 2 == 1:  # the last block alone
                    t0 = _start_mma(a_bufs, b_bufs, ready, i, p0)
                    s0 = _k_scale(sa, sb, i, ROW)
                    p0 = warpgroup_mma_wait(0, deps=[t0])
                    mbarrier.arrive(empty.index(i % STAGES), count=1)
                    acc += p0 * s0[:, None]
                    i += 1
            else:
                for kk in range(n_k):
                    t0 = _start_mma(a_bufs, b_bufs, ready, i, p0)
                    p0 = warpgroup_mma_wait(0, deps=[t0])
                    s0 = _k_scale(sa, sb, i, ROW)
                    mbarrier.arrive(empty.index(i % STAGES), count=1)
                    acc += p0 * s0[:, None]
                    i += 1
            if SPLIT == 1:
                _store(acc, out, row0, row_end, pid_n * BN, N, W)
            else:
                _store_partial(acc, out, split, row0, row_end, pid_n * BN, N, L)
    tma.store_wait(0)


# Every integer stays a runtime value: an argument the JIT specialised to a constant (a stride of 1) could not be
# handed to the worker partitions.
@gluon.jit(do_not_specialize=["stride_asm", "stride_ask", "stride_bsg", "stride_bsn", "stride_bsk", "stride_cm",
                              "stride_cw", "M", "N", "K", "m_tiles"])
def fp8_gemm_ws_kernel(a_desc, b_desc, c_desc, c_ptr, stride_cm, stride_cw, as_ptr, stride_asm, stride_ask, bs_ptr,
                       stride_bsg, stride_bsn, stride_bsk, tmap_ptr, M, N, K, m_tiles, GROUP_M: gl.constexpr,
                       CONSUMERS: gl.constexpr, STAGES: gl.constexpr, CONSUMER_REGS: gl.constexpr,
                       LAYOUT: gl.constexpr, SPLIT: gl.constexpr = 1):
    """C [M, N] = (A [M, K] e4m3 x a_scale [M, K/128]) @ (B [G?, N, K] e4m3 x b_scale [G?, N/128, K/128])^T.

    Persistent over m_tiles x N/128 tiles (m_tiles: row tiles, or the tile map's entries for groups). The A
    descriptor's block is one consumer's [64, 128] piece, B's [128, 128] over the weight viewed as [G * N, K],
    C's [64, 128] (one matrix only; groups store through c_ptr).
    SPLIT > 1 (one matrix): each tile's K blocks in SPLIT slices, each slice a work item whose float32 partial goes
    to c_ptr, a [SPLIT, M, N] workspace (stride_cm = N, stride_cw = M * N), for splitk_reduce_kernel to sum.
    """
    a0 = gl.allocate_shared_memory(a_desc.dtype, [STAGES, HALF, BK], a_desc.layout)
    a1 = gl.allocate_shared_memory(a_desc.dtype, [STAGES, HALF, BK], a_desc.layout)
    a2 = gl.allocate_shared_memory(a_desc.dtype, [STAGES, HALF, BK], a_desc.layout) if CONSUMERS == 3 else a1
    b_bufs = gl.allocate_shared_memory(b_desc.dtype, [STAGES, BN, BK], b_desc.layout)
    SL: gl.constexpr = gl.SwizzledSharedLayout(1, 1, 1, [0])  # a slot's (index() drops the ring dimension)
    sa0 = gl.allocate_shared_memory(gl.float32, [STAGES, HALF], SL)
    sa1 = gl.allocate_shared_memory(gl.float32, [STAGES, HALF], SL)
    sa2 = gl.allocate_shared_memory(gl.float32, [STAGES, HALF], SL) if CONSUMERS == 3 else sa1
    sb = gl.allocate_shared_memory(gl.float32, [STAGES, HALF], SL)
    c_smem = gl.allocate_shared_memory(c_desc.dtype, [CONSUMERS, HALF, BN], c_desc.layout)
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1 + 32)  # the producer's expect, its lanes' scale copies
        mbarrier.init(empty.index(s), count=CONSUMERS)  # one arrive from each consumer warpgroup
    fence_async_shared()
    ring = (b_bufs, ready, empty, sb)
    scales = (as_ptr, stride_asm, stride_ask, bs_ptr, stride_bsg, stride_bsn, stride_bsk)
    out = (c_desc, c_smem, c_ptr, stride_cm, stride_cw)
    shape = (M, N, K, m_tiles, tmap_ptr)
    if CONSUMERS == 3:
        gl.warp_specialize([
            (_consumer, (a0, sa0, ring, out, shape, GROUP_M, CONSUMERS, LAYOUT, 0, SPLIT)),
            (_consumer, (a1, sa1, ring, out, shape, GROUP_M, CONSUMERS, LAYOUT, 1, SPLIT)),
            (_consumer, (a2, sa2, ring, out, shape, GROUP_M, CONSUMERS, LAYOUT, 2, SPLIT)),
            (_producer, (a_desc, b_desc, a0, a1, a2, sa0, sa1, sa2, ring, scales, shape, GROUP_M, CONSUMERS, LAYOUT,
                         SPLIT)),
        ], [4, 4, 1], [CONSUMER_REGS, CONSUMER_REGS, PRODUCER_REGS])
    else:
        gl.warp_specialize([
            (_consumer, (a0, sa0, ring, out, shape, GROUP_M, CONSUMERS, LAYOUT, 0, SPLIT)),
            (_consumer, (a1, sa1, ring, out, shape, GROUP_M, CONSUMERS, LAYOUT, 1, SPLIT)),
            (_producer, (a_desc, b_desc, a0, a1, a2, sa0, sa1, sa2, ring, scales, shape, GROUP_M, CONSUMERS, LAYOUT,
                         SPLIT)),
        ], [4, 1], [CONSUMER_REGS, PRODUCER_REGS])
