"""MLA decode over the paged latent cache (bf16 or FP8) in Gluon for tiles of at most 16 query rows, with the
keys as the MMAs' M dimension ("keys-as-M": the scores are computed transposed, S^T = K Q^T, and the output as
O^T = V^T P^T).

Why: a Hopper wgmma needs 64 rows in M, and 16 heads give 16. mla_attn_kernel runs them on mma.sync with the
tile converted in registers; with an FP8 cache that kernel is bound by the conversion's registers and latency,
not by HBM (H200, 128 x 4096 keys x 16 heads: 0.30 of HBM read; ncu: 255 registers with spills, 27% DRAM
throughput, 41% of issue slots busy; benchmarks/RESULTS.md, issue 8). Turned around, a 64-key tile fills the
wgmma's M and the query rows are its N (16), so:

- both MMAs read their operands from shared memory (the score MMA the key tile and the queries, the output MMA
  the same key tile transposed and the probabilities), as wgmma on 16-bit types allows either major order;
- key tiles come in through cp.async, two deep (an FP8 tile's bytes are dead once widened, so its slot is
  refilled before the tile's output MMA), and an FP8 tile is widened once into a float16 tile (see
  mla_attn_gluon_kt_e4m3_kernel);
- the softmax runs over the keys, i.e. down the accumulator's columns: the running max of a query row is a
  column max across the warpgroup (the compiler's cross-warp reduction), the row sums stay per thread until the
  end as in mla_gluon_kernels.

Same contract as mla_attn_kernel (work items, rows = query x head, direct or partial outputs with log-sum-exp),
restricted to what mla_launch.gluon_tile_usable checks (bf16 queries, rank 512, rope 64, tiles aligned to
blocks): mla_attn_gluon_kt_kernel for a bf16 cache, mla_attn_gluon_kt_e4m3_kernel for DeepSeek's FP8 cache
(where mla_gluon_kt_ws_kernels, its TMA-fed warp-specialised form, runs in CUDA graphs: mla_launch.keys_as_m_ws_usable).
GPU only: Gluon has no interpreter, so the conformance tests run them on the H200.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from deepinfer.backends.cuda_sm100.mla_gluon_kernels import (
    _block_of, _copy_queries, _copy_tile, _gdc_enter, _lse, _stage_queries_f16, _store_lse, _store_rows, _work_item,
    copy_layout,
)

R = 512  # latent width (DeepSeek's kv_lora_rank)
P = 64  # rope width
BM = 16  # query rows a program: the wgmma N
BN = 64  # keys a tile: the wgmma M of one warpgroup
NUM_WARPS = 4  # one warpgroup
# Ring slots for key tiles (the prologue fills both). Three E4M3 slots measured no faster than two (H200,
# mla_decode.py, five 16-head shapes; bf16 dequantisation then).
STAGES = gl.constexpr(2)
# Shared memory a program takes at most (sm_90 compile: the E4M3 kernel's queries, ring, float16 tile and four P
# buffers; the bf16 kernel takes 168192).
SMEM_BYTES = 174336


@gluon.jit
def _plan_reads(items_ptr, meta_ptr, meta_stride, bt_ptr, bt_stride, H, row_tiles, BS, BM: gl.constexpr,
                BN: gl.constexpr, PDL: gl.constexpr, EARLY: gl.constexpr):
    """The program's work item (_work_item's, less the sequence), its tile count, block-table row and first two
    tiles' cache blocks, then the PDL wait. They come from the step's plan, which the host wrote before the step's
    first kernel: read before the wait, their chain of dependent loads overlaps the previous kernel. The queries
    and the cache are read after it."""
    row0, seq, kv_lo, kv_end, slot, tok0, qlen, slen = _work_item(items_ptr, meta_ptr, meta_stride, H, row_tiles, BM)
    n_tiles = gl.cdiv(gl.maximum(kv_end - kv_lo, 0), BN)
    bt_row = bt_ptr + seq.to(gl.int64) * bt_stride
    blk0 = _block_of(bt_row, kv_lo, kv_end, BS)
    blk1 = _block_of(bt_row, kv_lo + BN, kv_end, BS)
    _gdc_enter(PDL, EARLY)
    return row0, kv_lo, kv_end, slot, tok0, qlen, slen, n_tiles, bt_row, blk0, blk1


@gluon.jit
def _column_state(row0, H, qlen, slen, slot, S_L: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """The softmax's starting state, a query row being a column of S^T: the rows, their query positions (-1:
    none), running maxima and per-thread partial sums [BN, BM]; a zero score tile and a tile's key offsets."""
    rs = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, S_L))
    pos = gl.where((rs // H < qlen) & (slot >= -1), slen - qlen + rs // H, -1)
    m_i = gl.full([BM], -1.0e30, gl.float32, layout=gl.SliceLayout(0, S_L))
    l_keys = gl.zeros([BN, BM], gl.float32, layout=S_L)
    s_zero = gl.zeros([BN, BM], gl.float32, layout=S_L)
    kn = gl.arange(0, BN, layout=gl.SliceLayout(1, S_L))
    return rs, pos, m_i, l_keys, s_zero, kn


@gluon.jit
def _column_softmax(s, offs, pos, kv_end, qk_scale, m_i, l_keys):
    """One tile of the online softmax down S^T's columns (keys offs): masked scores in the exp2 domain, the new
    running maxima, the probabilities. Returns (p, alpha: the old sums' and outputs' factor, m_i, l_keys)."""
    s = gl.where((offs[:, None] <= pos[None, :]) & (offs[:, None] < kv_end), s * qk_scale, float("-inf"))
    m_new = gl.maximum(m_i, gl.max(s, axis=0))
    alpha = gl.exp2(m_i - m_new)
    p = gl.exp2(s - m_new[None, :])
    return p, alpha, m_new, l_keys * alpha[None, :] + p


@gluon.jit
def _column_sums(l_keys, scale):
    """The rows' probability sums and their reciprocals times 1 / scale (0 for rows with no key)."""
    l_i = gl.sum(l_keys, axis=0)
    has = l_i > 0.0
    return l_i, gl.where(has, 1.0 / (gl.where(has, l_i, 1.0) * scale), 0.0)


@gluon.jit
def _kt_buffers(Q_T: gl.constexpr, K_T: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, R: gl.constexpr,
                P: gl.constexpr, STAGES: gl.constexpr):
    """A keys-as-M program's query and ring buffers, in allocation order: latent queries [BM, R] in the MMAs'
    16-bit type Q_T, rope queries [BM, P] (bf16), the ring's rope keys [STAGES, BN, P] (bf16) and key tiles
    [STAGES, BN, R] of K_T (bf16, or E4M3 bytes)."""
    q_smem = gl.allocate_shared_memory(Q_T, [BM, R], gl.NVMMASharedLayout.get_default_for([BM, R], Q_T))
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, P],
                                        gl.NVMMASharedLayout.get_default_for([BM, P], gl.bfloat16))
    kpe_bufs = gl.allocate_shared_memory(gl.bfloat16, [STAGES, BN, P],
                                        gl.NVMMASharedLayout.get_default_for([BN, P], gl.bfloat16))
    k_bufs = gl.allocate_shared_memory(K_T, [STAGES, BN, R], gl.NVMMASharedLayout.get_default_for([BN, R], K_T))
    return q_smem, qpe_smem, kpe_bufs, k_bufs


@gluon.jit
def _issue_tile(t, blk, k_bufs, kpe_bufs, kv_lo, tile_args, addr_args, LAT_L: gl.constexpr, PE_L: gl.constexpr,
                R: gl.constexpr, P: gl.constexpr, BN: gl.constexpr, STAGES: gl.constexpr):
    """cp.async key tile t (in cache block blk) into ring slot t % STAGES: one commit group, empty past the last
    tile so the group count stays fixed."""
    _copy_tile(k_bufs.index(t % STAGES), kpe_bufs.index(t % STAGES), *tile_args, blk, kv_lo + t * BN, *addr_args,
               LAT_L, PE_L, R, P, BN)


@gluon.jit
def mla_attn_gluon_kt_kernel(
    q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh,
    lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off, BS,
    bt_ptr, bt_stride, meta_ptr, meta_stride, items_ptr,
    out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr,
    H, qk_scale, row_tiles,
    R: gl.constexpr, P: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
    PDL: gl.constexpr = False, EARLY: gl.constexpr = False,
):
    """One program = one work item x one tile of BM (<= 16) query rows of a bf16 cache, as mla_attn_kernel (see
    its docstring; the cache views and strides are the same), one warpgroup."""
    # Copies as mla_gluon_kernels' (one warpgroup). S_L: S^T [keys, rows] and O^T [columns, rows], 16 rows of M
    # a warp.
    Q_L: gl.constexpr = copy_layout("q", 4)
    LAT_L: gl.constexpr = copy_layout("lat", 4)
    PE_L: gl.constexpr = copy_layout("pe", 4)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])

    row0, kv_lo, kv_end, slot, tok0, qlen, slen, n_tiles, bt_row, blk0, blk1 = _plan_reads(
        items_ptr, meta_ptr, meta_stride, bt_ptr, bt_stride, H, row_tiles, BS, BM, BN, PDL, EARLY)

    q_smem, qpe_smem, kpe_bufs, k_bufs = _kt_buffers(gl.bfloat16, gl.bfloat16, BM, BN, R, P, STAGES)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BM],
                                      gl.NVMMASharedLayout.get_default_for([BN, BM], gl.bfloat16))

    # Queries (one commit group), then key tiles 0 and 1 (the ring's two slots), one group each.
    _copy_queries(q_smem, qpe_smem, q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh, row0, H, tok0, qlen, slot, Q_L, PE_L,
                  BM, R, P)
    ring = (k_bufs, kpe_bufs, kv_lo, (lat_ptr, rope_ptr), (kv_end, BS, lat_sb, lat_st, rope_sb, rope_st, rope_off))
    _issue_tile(0, blk0, *ring, LAT_L, PE_L, R, P, BN, STAGES)
    _issue_tile(1, blk1, *ring, LAT_L, PE_L, R, P, BN, STAGES)

    rs, pos, m_i, l_keys, s_zero, kn = _column_state(row0, H, qlen, slen, slot, S_L, BM, BN)
    acc = gl.zeros([R, BM], gl.float32, layout=S_L)

    for t in range(0, n_tiles):
        buf = t % STAGES
        start = kv_lo + t * BN
        async_copy.wait_group(STAGES - 1)  # this tile's group (and the queries') landed; the next may fly
        fence_async_shared()  # copies are generic-proxy writes: order them before the wgmma's reads ...
        gl.thread_barrier()  # ... in every thread
        k = k_bufs.index(buf)
        s = warpgroup_mma(k, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(kpe_bufs.index(buf), qpe_smem.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        p, alpha, m_i, l_keys = _column_softmax(s, start + kn, pos, kv_end, qk_scale, m_i, l_keys)
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # all of P is written; every warp is past this tile's score MMAs
        acc = acc * alpha[None, :]
        acc = warpgroup_mma(k.permute((1, 0)), p_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # every warp is done with P and the key tile before they are rewritten
        _issue_tile(t + STAGES, _block_of(bt_row, start + STAGES * BN, kv_end, BS), *ring, LAT_L, PE_L, R, P, BN,
                    STAGES)
    async_copy.wait_group(0)

    l_i, inv_l = _column_sums(l_keys, 1.0)
    out_args = (out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr)
    co = gl.arange(0, R, layout=gl.SliceLayout(1, S_L))
    _store_rows(acc * inv_l[None, :], co, out_args, row0, H, tok0, qlen, slot, S_L, R, T=True)
    _store_lse(_lse(m_i, l_i), rs, out_args, H, tok0, qlen, slot)


# E4M3 tiles: the MMAs read the tile as float16 without its scales (an exact widening: E4M3 is a subset of
# float16, one cvt per two values, where scaling into bf16 took six instructions, half the loop's), and the
# per-token scales of each 128-value group are applied to that group's scores and probabilities instead:
#   S^T = K_pe Q_pe^T + sum_g diag(s_g) K_g Q_g^T,    O_g^T = K_g^T (diag(s_g) P^T)    (g = 0..3).
# The probabilities times a scale are stored as float16 times 2^8 (and the outputs divided by it) so that
# scales down to 2^-22 stay normal; a scale of 256 or more (a 128-value group with |x| >= 114688) would
# overflow, far outside what a latent cache holds. H200, mla_decode.py, 16 heads: 128 x 4096 keys 0.242 -> 0.204 ms,
# 32 x 65536 0.891 -> 0.733 against the bf16 dequantisation (sm_90 SASS: 1100 instructions a thread a tile, from
# 1560).
_P_SHIFT = gl.constexpr(256.0)


@gluon.jit
def _tile_scales(scl_ptr, blk, start, kv_end, BS, scl_sb, scl_st, scale_off, L: gl.constexpr, BN: gl.constexpr):
    """The key tile's per-token scales, one [BN] vector per 128-value group (R = 512: four), 0 past kv_end."""
    n = gl.arange(0, BN, layout=L)
    row = scl_ptr + blk * scl_sb + (start % BS + n).to(gl.int64) * scl_st + scale_off
    live = start + n < kv_end
    return (gl.load(row, mask=live, other=0.0), gl.load(row + 1, mask=live, other=0.0),
            gl.load(row + 2, mask=live, other=0.0), gl.load(row + 3, mask=live, other=0.0))


@gluon.jit
def _widen_tile(k8, kh, DQ_L: gl.constexpr, R: gl.constexpr):
    """E4M3 tile k8 [BN, R] -> float16 tile kh, unscaled, 128 columns at a time."""
    for g in gl.static_range(R // 128):
        kh.slice(g * 128, 128, dim=1).store(k8.slice(g * 128, 128, dim=1).load(DQ_L).to(gl.float16))


@gluon.jit
def _scaled_probs(p_smem, p, sc):
    """Store P^T times the keys' scales of the four groups (times 2^8) as float16, one buffer a group."""
    s0, s1, s2, s3 = sc
    p_smem.index(0).store((p * (s0 * _P_SHIFT)[:, None]).to(gl.float16))
    p_smem.index(1).store((p * (s1 * _P_SHIFT)[:, None]).to(gl.float16))
    p_smem.index(2).store((p * (s2 * _P_SHIFT)[:, None]).to(gl.float16))
    p_smem.index(3).store((p * (s3 * _P_SHIFT)[:, None]).to(gl.float16))


@gluon.jit
def _e4m3_state(row0, H, qlen, slen, slot, S_L: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr):
    """_column_state's, and the four 128-column output groups O_g^T [128, BM], zero."""
    rs, pos, m_i, l_keys, s_zero, kn = _column_state(row0, H, qlen, slen, slot, S_L, BM, BN)
    acc = gl.zeros([128, BM], gl.float32, layout=S_L)
    return rs, pos, m_i, l_keys, s_zero, kn, acc, acc, acc, acc


@gluon.jit
def _e4m3_scores(sp, s0, s1, s2, s3, sc, q_fac):
    """A tile's scores from its finished score MMAs: each group's times its keys' scales, plus the rope part, times
    the queries' factors (_stage_queries_f16)."""
    c0, c1, c2, c3 = sc
    return (sp + s0 * c0[:, None] + s1 * c1[:, None] + s2 * c2[:, None] + s3 * c3[:, None]) * q_fac[None, :]


@gluon.jit
def _e4m3_score_mmas(kh, kpe, q16_smem, qpe_smem, s_zero):
    """Start a float16 key tile's score MMAs (not waited on): the rope part and each 128-channel group's, which
    meet their scales once done. Returns (rope, group 0..3) score tiles [BN, BM]."""
    sp = warpgroup_mma(kpe, qpe_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
    s0 = warpgroup_mma(kh.slice(0, 128, dim=1), q16_smem.slice(0, 128, dim=1).permute((1, 0)), s_zero,
                       use_acc=False, is_async=True)
    s1 = warpgroup_mma(kh.slice(128, 128, dim=1), q16_smem.slice(128, 128, dim=1).permute((1, 0)), s_zero,
                       use_acc=False, is_async=True)
    s2 = warpgroup_mma(kh.slice(256, 128, dim=1), q16_smem.slice(256, 128, dim=1).permute((1, 0)), s_zero,
                       use_acc=False, is_async=True)
    s3 = warpgroup_mma(kh.slice(384, 128, dim=1), q16_smem.slice(384, 128, dim=1).permute((1, 0)), s_zero,
                       use_acc=False, is_async=True)
    return sp, s0, s1, s2, s3


@gluon.jit
def _e4m3_output_mmas(kh, p_smem, acc0, acc1, acc2, acc3, alpha):
    """Start the output MMAs (not waited on): O_g^T = acc_g * alpha + K_g^T (scaled P^T of group g)."""
    acc0 = warpgroup_mma(kh.slice(0, 128, dim=1).permute((1, 0)), p_smem.index(0), acc0 * alpha[None, :],
                         is_async=True)
    acc1 = warpgroup_mma(kh.slice(128, 128, dim=1).permute((1, 0)), p_smem.index(1), acc1 * alpha[None, :],
                         is_async=True)
    acc2 = warpgroup_mma(kh.slice(256, 128, dim=1).permute((1, 0)), p_smem.index(2), acc2 * alpha[None, :],
                         is_async=True)
    acc3 = warpgroup_mma(kh.slice(384, 128, dim=1).permute((1, 0)), p_smem.index(3), acc3 * alpha[None, :],
                         is_async=True)
    return acc0, acc1, acc2, acc3


@gluon.jit
def _e4m3_epilogue(acc0, acc1, acc2, acc3, m_i, l_keys, rs, out_args, row0, H, tok0, qlen, slot, S_L: gl.constexpr,
                   R: gl.constexpr):
    """Store the E4M3 kernels' normalised outputs O^T (four 128-column groups, the probabilities' 2^8 undone) and
    log-sum-exp of tile rows rs."""
    l_i, inv_l = _column_sums(l_keys, _P_SHIFT)
    inv_l = inv_l[None, :]
    co = gl.arange(0, 128, layout=gl.SliceLayout(1, S_L))
    _store_rows(acc0 * inv_l, co, out_args, row0, H, tok0, qlen, slot, S_L, R, T=True)
    _store_rows(acc1 * inv_l, co + 128, out_args, row0, H, tok0, qlen, slot, S_L, R, T=True)
    _store_rows(acc2 * inv_l, co + 256, out_args, row0, H, tok0, qlen, slot, S_L, R, T=True)
    _store_rows(acc3 * inv_l, co + 384, out_args, row0, H, tok0, qlen, slot, S_L, R, T=True)
    _store_lse(_lse(m_i, l_i), rs, out_args, H, tok0, qlen, slot)


@gluon.jit
def mla_attn_gluon_kt_e4m3_kernel(
    q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh,
    lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off, BS,
    bt_ptr, bt_stride, meta_ptr, meta_stride, items_ptr,
    out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr,
    H, qk_scale, row_tiles,
    R: gl.constexpr, P: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr,
    PDL: gl.constexpr = False, EARLY: gl.constexpr = False,
):
    """mla_attn_gluon_kt_kernel for DeepSeek's FP8 cache: the E4M3 tile is widened to float16 once and its scales
    are applied to scores and probabilities per 128-value group (see above)."""
    LAT_L: gl.constexpr = copy_layout("lat", 4, True)
    PE_L: gl.constexpr = copy_layout("pe", 4)
    DQ_L: gl.constexpr = copy_layout("dq", 4)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    KEYS_L: gl.constexpr = gl.SliceLayout(1, S_L)

    row0, kv_lo, kv_end, slot, tok0, qlen, slen, n_tiles, bt_row, blk0, blk1 = _plan_reads(
        items_ptr, meta_ptr, meta_stride, bt_ptr, bt_stride, H, row_tiles, BS, BM, BN, PDL, EARLY)

    q16_smem, qpe_smem, kpe_bufs, k_bufs = _kt_buffers(gl.float16, gl.float8e4nv, BM, BN, R, P, STAGES)
    kh_smem = gl.allocate_shared_memory(gl.float16, [BN, R], gl.NVMMASharedLayout.get_default_for([BN, R], gl.float16))
    p_smem = gl.allocate_shared_memory(gl.float16, [R // 128, BN, BM],
                                      gl.NVMMASharedLayout.get_default_for([BN, BM], gl.float16))

    # Key tiles 0 and 1 (one commit group each), then the queries through registers while the tiles fly.
    ring = (k_bufs, kpe_bufs, kv_lo, (lat_ptr, rope_ptr), (kv_end, BS, lat_sb, lat_st, rope_sb, rope_st, rope_off))
    scale_args = (kv_end, BS, scl_sb, scl_st, scale_off)
    _issue_tile(0, blk0, *ring, LAT_L, PE_L, R, P, BN, STAGES)
    _issue_tile(1, blk1, *ring, LAT_L, PE_L, R, P, BN, STAGES)
    # A tile's scales ride in registers, loaded with its copy (two tiles ahead: 2% faster than one, H200,
    # mla_decode.py 16 heads, the same registers and stack).
    sc = _tile_scales(scl_ptr, blk0, kv_lo, *scale_args, KEYS_L, BN)
    sc_n = _tile_scales(scl_ptr, blk1, kv_lo + BN, *scale_args, KEYS_L, BN)
    q_fac = _stage_queries_f16(q16_smem, qpe_smem, q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh, row0, H, tok0, qlen,
                               slot, PE_L, gl.SliceLayout(0, S_L), BM, R, P, 4)

    rs, pos, m_i, l_keys, s_zero, kn, acc0, acc1, acc2, acc3 = _e4m3_state(row0, H, qlen, slen, slot, S_L, BM, BN)

    for t in range(0, n_tiles):
        buf = t % STAGES
        start = kv_lo + t * BN
        async_copy.wait_group(STAGES - 1)  # this tile's group landed; the next may fly
        fence_async_shared()
        gl.thread_barrier()
        _widen_tile(k_bufs.index(buf), kh_smem, DQ_L, R)
        fence_async_shared()
        gl.thread_barrier()
        s, s0, s1, s2, s3 = _e4m3_score_mmas(kh_smem, kpe_bufs.index(buf), q16_smem, qpe_smem, s_zero)
        s, s0, s1, s2, s3 = warpgroup_mma_wait(num_outstanding=0, deps=(s, s0, s1, s2, s3))
        s = _e4m3_scores(s, s0, s1, s2, s3, sc, q_fac)
        p, alpha, m_i, l_keys = _column_softmax(s, start + kn, pos, kv_end, qk_scale, m_i, l_keys)
        _scaled_probs(p_smem, p, sc)
        fence_async_shared()
        gl.thread_barrier()  # all of P is written; every warp is past this tile's score MMAs
        # The E4M3 bytes and rope keys are dead (widened; the score MMAs are done): refill the slot now, before
        # the output MMAs rather than after them.
        blk = _block_of(bt_row, start + STAGES * BN, kv_end, BS)
        _issue_tile(t + STAGES, blk, *ring, LAT_L, PE_L, R, P, BN, STAGES)
        sc, sc_n = sc_n, _tile_scales(scl_ptr, blk, start + STAGES * BN, *scale_args, KEYS_L, BN)
        acc0, acc1, acc2, acc3 = _e4m3_output_mmas(kh_smem, p_smem, acc0, acc1, acc2, acc3, alpha)
        acc0, acc1, acc2, acc3 = warpgroup_mma_wait(num_outstanding=0, deps=(acc0, acc1, acc2, acc3))
        gl.thread_barrier()  # every warp is done with P and the float16 tile before they are rewritten
    async_copy.wait_group(0)

    _e4m3_epilogue(acc0, acc1, acc2, acc3, m_i, l_keys, rs, (out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr), row0, H,
                   tok0, qlen, slot, S_L, R)
