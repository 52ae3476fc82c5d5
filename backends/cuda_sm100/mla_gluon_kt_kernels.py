"""MLA decode over the paged latent cache (bf16 or FP8) in Gluon for tiles of at most 16 query rows, with the
keys as the MMAs' M dimension ("keys-as-M": the scores are computed transposed, S^T = K Q^T, and the output as
O^T = V^T P^T).

Why: a Hopper wgmma needs 64 rows in M, and 16 heads give 16. mla_attn_kernel runs them on mma.sync with the
tile converted in registers; with an FP8 cache that kernel is bound by the conversion's registers and latency,
not by HBM (H200, 128 x 4096 keys x 16 heads: 0.30 of HBM read; ncu: 255 registers with spills, 27% DRAM
throughput, 41% of issue slots busy; benchmarks/RESULTS.md, issue 8). Turned around, a 64-key tile fills the
wgmma's M and the query rows are its N (16), so:

- both MMAs read their operands from shared memory (the score MMA the key tile and the queries, the output MMA
  the same key tile transposed and the probabilities), as wgmma on bf16 allows either major order;
- key tiles come in through cp.async, two deep (an FP8 tile's bytes are dead once dequantised, so its slot is
  refilled before the tile's output MMA), and an FP8 tile is dequantised once into a bf16 tile;
- the softmax runs over the keys, i.e. down the accumulator's columns: the running max of a query row is a
  column max across the warpgroup (the compiler's cross-warp reduction), the row sums stay per thread until the
  end as in mla_gluon_kernels.

Same contract as mla_attn_kernel (work items, rows = query x head, direct or partial outputs with log-sum-exp),
restricted to what mla_launch.gluon_tile_usable checks (bf16 queries, rank 512, rope 64, tiles aligned to
blocks). GPU only: Gluon has no interpreter, so the conformance tests run it on the H200.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait

from deepinfer.backends.cuda_sm100.mla_gluon_kernels import (
    _block_of, _copy_queries, _copy_tile, _gdc_enter, _key_buffers, _load_scales, _lse, _ready_tile, _store_lse,
    _store_rows, _work_item, copy_layout,
)

R = 512  # latent width (DeepSeek's kv_lora_rank)
P = 64  # rope width
BM = 16  # query rows a program: the wgmma N
BN = 64  # keys a tile: the wgmma M of one warpgroup
NUM_WARPS = 4  # one warpgroup
# Ring slots for key tiles (the prologue fills both). Three E4M3 slots measured no faster than two (H200,
# mla_decode.py, five 16-head shapes).
STAGES = gl.constexpr(2)
SMEM_BYTES = 168192  # shared memory a program takes (sm_90 compile, either cache): queries, two key tiles, P


@gluon.jit
def _issue_tile(t, blk, k_bufs, kpe_bufs, kv_lo, tile_args, addr_args, scale_args, scl_ptr, LAT_L: gl.constexpr,
                PE_L: gl.constexpr, SC_L: gl.constexpr, R: gl.constexpr, P: gl.constexpr, BN: gl.constexpr,
                STAGES: gl.constexpr, FP8: gl.constexpr):
    """cp.async key tile t (in cache block blk) into ring slot t % STAGES (one commit group, empty past the last
    tile so the group count stays fixed) and return its FP8 scales (zeros for bf16)."""
    start = kv_lo + t * BN
    _copy_tile(k_bufs.index(t % STAGES), kpe_bufs.index(t % STAGES), *tile_args, blk, start, *addr_args, LAT_L,
               PE_L, R, P, BN)
    if FP8:
        sc = _load_scales(scl_ptr, blk, start, *scale_args, SC_L, R // 128, BN)
    else:
        sc = gl.zeros([BN, R // 128], gl.float32, layout=SC_L)
    return sc


@gluon.jit
def mla_attn_gluon_kt_kernel(
    q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh,
    lat_ptr, scl_ptr, rope_ptr, lat_sb, lat_st, scl_sb, scl_st, rope_sb, rope_st, scale_off, rope_off, BS,
    bt_ptr, bt_stride, meta_ptr, meta_stride, items_ptr,
    out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr,
    H, qk_scale, row_tiles,
    R: gl.constexpr, P: gl.constexpr, BM: gl.constexpr, BN: gl.constexpr, FP8: gl.constexpr,
    PDL: gl.constexpr = False,
):
    """One program = one work item x one tile of BM (<= 16) query rows, as mla_attn_kernel (see its docstring;
    the cache views and strides are the same), one warpgroup."""
    # Copies and dequantisation as mla_gluon_kernels' (one warpgroup). S_L: S^T [keys, rows] and O^T [columns,
    # rows], 16 rows of M a warp.
    Q_L: gl.constexpr = copy_layout("q", 4)
    LAT_L: gl.constexpr = copy_layout("lat", 4, FP8)
    PE_L: gl.constexpr = copy_layout("pe", 4)
    DQ_L: gl.constexpr = copy_layout("dq", 4)
    SC_L: gl.constexpr = copy_layout("sc", 4)
    S_L: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BM, 16])
    LAT_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, R], gl.bfloat16)
    PE_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, P], gl.bfloat16)
    Q_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, R], gl.bfloat16)
    QPE_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BM, P], gl.bfloat16)
    P_S: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BN, BM], gl.bfloat16)

    # The work item, its sequence's metadata and the first tiles' cache blocks come from the step's plan, which
    # the host wrote before the step's first kernel: read before the PDL wait, their chain of dependent loads
    # overlaps the previous kernel. The queries and the cache are read after it.
    row0, seq, kv_lo, kv_end, slot, tok0, qlen, slen = _work_item(items_ptr, meta_ptr, meta_stride, H, row_tiles, BM)
    n_tiles = gl.cdiv(gl.maximum(kv_end - kv_lo, 0), BN)
    bt_row = bt_ptr + seq.to(gl.int64) * bt_stride
    blk0 = _block_of(bt_row, kv_lo, kv_end, BS)
    blk1 = _block_of(bt_row, kv_lo + BN, kv_end, BS)
    _gdc_enter(PDL)

    q_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, R], Q_S)
    qpe_smem = gl.allocate_shared_memory(gl.bfloat16, [BM, P], QPE_S)
    k_bufs, kpe_bufs, kb_smem = _key_buffers(q_smem, FP8, STAGES, BN, R, P, LAT_S, PE_S)
    p_smem = gl.allocate_shared_memory(gl.bfloat16, [BN, BM], P_S)

    # Queries (one commit group), then key tiles 0 and 1 (the ring's two slots), one group each.
    _copy_queries(q_smem, qpe_smem, q_ptr, qpe_ptr, q_st, q_sh, qpe_st, qpe_sh, row0, H, tok0, qlen, slot, Q_L, PE_L,
                  BM, R, P)
    tile_args = (lat_ptr, rope_ptr)
    addr_args = (kv_end, BS, lat_sb, lat_st, rope_sb, rope_st, rope_off)
    scale_args = (kv_end, BS, scl_sb, scl_st, scale_off)
    ring = (k_bufs, kpe_bufs, kv_lo, tile_args, addr_args, scale_args, scl_ptr)
    # FP8 scales ride in registers beside their tiles' copies: sc0 for the tile in use, then the next ones.
    sc0 = _issue_tile(0, blk0, *ring, LAT_L, PE_L, SC_L, R, P, BN, STAGES, FP8)
    sc1 = _issue_tile(1, blk1, *ring, LAT_L, PE_L, SC_L, R, P, BN, STAGES, FP8)

    # Per query row (a column of S^T): its position, running max; per thread: partial row sums.
    rs = row0 + gl.arange(0, BM, layout=gl.SliceLayout(0, S_L))
    pos = gl.where((rs // H < qlen) & (slot >= -1), slen - qlen + rs // H, -1)
    m_i = gl.full([BM], -1.0e30, gl.float32, layout=gl.SliceLayout(0, S_L))
    l_keys = gl.zeros([BN, BM], gl.float32, layout=S_L)
    acc = gl.zeros([R, BM], gl.float32, layout=S_L)
    s_zero = gl.zeros([BN, BM], gl.float32, layout=S_L)
    kn = gl.arange(0, BN, layout=gl.SliceLayout(1, S_L))

    for t in range(0, n_tiles):
        buf = t % STAGES
        start = kv_lo + t * BN
        # this tile's group (and the queries') landed; later ones may still fly
        k = _ready_tile(k_bufs, kb_smem, buf, sc0, STAGES - 1, FP8, DQ_L, SC_L, R)
        s = warpgroup_mma(k, q_smem.permute((1, 0)), s_zero, use_acc=False, is_async=True)
        s = warpgroup_mma(kpe_bufs.index(buf), qpe_smem.permute((1, 0)), s, is_async=True)
        s = warpgroup_mma_wait(num_outstanding=0, deps=(s,))
        offs = start + kn
        s = gl.where((offs[:, None] <= pos[None, :]) & (offs[:, None] < kv_end), s * qk_scale, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, axis=0))
        alpha = gl.exp2(m_i - m_new)
        p = gl.exp2(s - m_new[None, :])
        l_keys = l_keys * alpha[None, :] + p
        m_i = m_new
        p_smem.store(p.to(gl.bfloat16))
        fence_async_shared()
        gl.thread_barrier()  # all of P is written; every warp is past this tile's score MMAs
        if FP8:
            # The E4M3 bytes and rope keys are dead (dequantised; the score MMAs are done): refill the slot
            # before the output MMA rather than after it.
            blk = _block_of(bt_row, start + STAGES * BN, kv_end, BS)
            sc0, sc1 = sc1, _issue_tile(t + STAGES, blk, *ring, LAT_L, PE_L, SC_L, R, P, BN, STAGES, FP8)
        acc = acc * alpha[None, :]
        acc = warpgroup_mma(k.permute((1, 0)), p_smem, acc, is_async=True)
        acc = warpgroup_mma_wait(num_outstanding=0, deps=(acc,))
        gl.thread_barrier()  # every warp is done with P and the key tile before they are rewritten
        if not FP8:
            _issue_tile(t + STAGES, _block_of(bt_row, start + STAGES * BN, kv_end, BS), *ring, LAT_L, PE_L, SC_L,
                        R, P, BN, STAGES, FP8)
    async_copy.wait_group(0)

    l_i = gl.sum(l_keys, axis=0)
    has = l_i > 0.0
    inv_l = gl.where(has, 1.0 / gl.where(has, l_i, 1.0), 0.0)
    out_args = (out_ptr, lse_ptr, o_st, o_sh, po_ptr, plse_ptr)
    co = gl.arange(0, R, layout=gl.SliceLayout(1, S_L))
    _store_rows(acc * inv_l[None, :], co, out_args, row0, H, tok0, qlen, slot, S_L, R, T=True)
    _store_lse(_lse(m_i, l_i), rs, out_args, H, tok0, qlen, slot)

